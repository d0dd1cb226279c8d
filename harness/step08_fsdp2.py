"""What step 08 needs besides sharding itself: its one-file checkpoint restored into shards, the
optimizer state in the form a plain optimizer saves, and what each rank holds (its shards, its
peak memory).

Step 08 first needs it. 08 gathers the whole state to rank 0 and writes it as 07 does
(harness/checkpoint.py); torch's state-dict API names the optimizer's parameters ("fc1.weight")
where `optimizer.state_dict()` numbers them (0, 1, ...): the file keeps the numbers, so that
any step, and a plain Net with its SGD, loads it.
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

from . import checkpoint
from .errors import UserError, first_line
from .ranks import log


def numbered(optim_state: dict) -> dict:
    """An optimizer state keyed by parameter names, keyed by numbers as optimizer.state_dict()
    keys it (the order of the param groups, which is the model's order)."""
    names = [name for group in optim_state["param_groups"] for name in group["params"]]
    number = {name: i for i, name in enumerate(names)}
    return {"state": {number[name]: s for name, s in optim_state["state"].items()},
            "param_groups": [{**group, "params": [number[n] for n in group["params"]]}
                             for group in optim_state["param_groups"]]}


def named(optim_state: dict, model) -> dict:
    """The inverse of numbered(), for `model`'s parameters."""
    names = [name for name, _ in model.named_parameters()]
    return {"state": {names[i]: s for i, s in optim_state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                             for group in optim_state["param_groups"]]}


def restore(path: Path, run, model, optimizer, scheduler) -> dict:
    """checkpoint.restore for a sharded model: every rank reads the whole file to the CPU and
    keeps its shards of every tensor (full_state_dict: the file holds whole tensors)."""
    saved = checkpoint.load(path)
    try:
        set_state_dict(model, optimizer, model_state_dict=saved["model"],
                       optim_state_dict=named(saved["optimizer"], model),
                       options=StateDictOptions(full_state_dict=True))
        scheduler.load_state_dict(saved["scheduler"])
    except (KeyError, IndexError, RuntimeError, ValueError, TypeError) as err:
        raise UserError(f"checkpoint {path} does not fit this model/optimizer "
                        f"({first_line(err, 160)})") from None
    log(run, f"resumed from {path} after epoch {saved['epoch']}")
    return saved


def peak_memory_mib(run) -> float:
    """The most memory this process has held so far: on a GPU, the tensors torch allocated
    there; on the CPU, the process's peak resident set (Linux reports it in KiB)."""
    if run.device.type == "cuda":
        return torch.cuda.max_memory_allocated(run.device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def describe_shards(model) -> str:
    """The line 08 prints: how much of the model this rank holds (its shards of every DTensor)."""
    held = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    return (f"FSDP2: each rank holds {held:,} of the {total:,} parameters "
            f"({100 * held / total:.1f}%), and as much of their gradients and optimizer state")


def held_per_rank(model, optimizer, run, memory_after_build: float) -> dict:
    """For summary.json (a collective): the elements each rank holds of the parameters and of
    the optimizer state (its shards), and its peak memory (MiB) once its model was built, and
    at most."""
    state = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    mine = (sum(p.to_local().numel() for p in model.parameters()),
            sum(t.to_local().numel() for t in state), memory_after_build, peak_memory_mib(run))
    everyone = [None] * run.world_size
    dist.all_gather_object(everyone, mine)
    return {"params_per_rank": [e[0] for e in everyone],
            "params_total": sum(p.numel() for p in model.parameters()),
            "optimizer_state_per_rank": [e[1] for e in everyone],
            "memory_after_build_mib": [e[2] for e in everyone],
            "peak_memory_mib": [e[3] for e in everyone]}
