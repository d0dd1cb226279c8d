"""The checked twins of step 08's own functions, taken in before its main() runs (twins.py).

08 writes out plain versions: sharding, the one file gathered to rank 0, its resume into shards,
what each rank holds. take_in(step) takes in 07's twins (step07_fault_tolerance) and replaces:
- save_gathered by checkpoint.save (atomic, no NaN weights, a full disk is one line);
- resume by restore() (checked reading, one line when the file does not fit) and 07's checks;
- held_per_rank by the one below, which adds each rank's optimizer state and its memory after
  the build to summary.json.
The file keeps the optimizer state numbered as optimizer.state_dict() numbers it (08's
numbered()); named() is its inverse, for restoring.
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

from . import checkpoint, step07_fault_tolerance
from .errors import UserError, first_line
from .ranks import log


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


def resume(path: Path, run, model, optimizer, scheduler, settings: dict):
    """08's resume(), checked: the epoch to continue, the position in it, this rank's RNG."""
    saved = restore(path, run, model, optimizer, scheduler)
    return step07_fault_tolerance.continue_from(saved, settings, path, run)


def take_in(step: dict) -> None:
    """07's twins, then 08's own (above)."""
    step07_fault_tolerance.take_in(step)
    step.update(save_gathered=checkpoint.save, resume=resume, held_per_rank=held_per_rank)
