"""Peak memory per rank while a sharded model is built: on the meta device (step 08's way) or
whole on every rank first. Run under torchrun, on the CPU (the peak resident set of each rank):

    torchrun --standalone --nproc-per-node 2 bench/meta_init.py --init meta --model layers
    torchrun --standalone --nproc-per-node 2 bench/meta_init.py --init whole --model layers
    torchrun --standalone --nproc-per-node 2 bench/meta_init.py --init meta --model net --width 64

`layers` is 8 equal Linear(4096, 4096) layers (64 MiB each, 512 MiB in all): no layer dominates.
`net` is the tutorial's CNN, whose fc1 is 94% of it at any --width. The broadcast from rank 0
(set_model_state_dict with broadcast_from_rank0) sends one whole tensor at a time, so every
rank briefly holds the largest tensor; rank 0 holds the whole model, on its CPU.
"""

import argparse
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.flags import Parser, integer  # noqa: E402
from harness.model import build_model  # noqa: E402


def build(opts) -> nn.Module:
    if opts.model == "net":
        return build_model(argparse.Namespace(dropout=True, width=opts.width), seed=0)
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(8)])


def shard(model: nn.Module) -> nn.Module:
    for layer in model.children():
        if any(p.requires_grad for p in layer.parameters()):
            fully_shard(layer)
    return fully_shard(model)


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux: KiB


def main():
    parser = Parser(prog="bench/meta_init.py", description=__doc__,  # one-line errors
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init", choices=["meta", "whole"], required=True)
    parser.add_argument("--model", choices=["layers", "net"], default="layers")
    parser.add_argument("--width", type=integer(1, 64, "--width"), default=64)
    opts = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("start it with torchrun (see the top): it measures each rank of a group")
    dist.init_process_group("gloo")
    rank, before = dist.get_rank(), peak_mib()
    if opts.init == "meta":
        with torch.device("meta"):
            model = shard(build(opts))
        model.to_empty(device="cpu")
        set_model_state_dict(model, build(opts).state_dict() if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True,
                                                      broadcast_from_rank0=True))
    else:
        model = shard(build(opts))
    grown = peak_mib() - before
    shards = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**20
    whole = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (round(grown), round(shards)))
    if rank == 0:
        print(f"{opts.model} ({whole:.0f} MiB), --init {opts.init}, {len(everyone)} ranks: "
              f"peak growth while building / shards held, MiB per rank: "
              + ", ".join(f"{g} / {s}" for g, s in everyone), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
