"""Gradient clipping on FSDP2's sharded parameters, run under torchrun on N ranks:

    torchrun --standalone --nproc-per-node 2 tests/clip_probe.py OUT_DIR

Every rank trains one batch (the same on every rank) on two copies of the same Net: one whole,
one sharded by step 08's own shard(). Both clip with `clip_grad_norm_`. Then a third copy with
fc2 left out of `fully_shard` tries to clip. Each rank writes OUT_DIR/rank<R>.json: the two
norms clip_grad_norm_ returned, the norm of the same gradients summed in float64, the largest
difference between the gradients before clipping, the norm of the sharded model's gradients
after clipping, and the error the third copy met.
"""

import argparse
import gc
import importlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import common  # noqa: E402
from harness.model import Net  # noqa: E402

MAX_NORM = 0.5  # well below this batch's gradient norm, so clipping scales every gradient


def backward(model, images, labels):
    F.cross_entropy(model(images), labels).backward()


def clip(model):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


def full_gradients(model):
    """Every gradient whole: a DTensor's shards gathered from every rank (a collective)."""
    return [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in model.parameters()]


def float64_norm(gradients):
    return torch.linalg.vector_norm(torch.stack([g.double().norm() for g in gradients])).item()


def main():
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    run = common.Run(torch.device("cpu"), dist.get_rank(), dist.get_rank(), dist.get_world_size())
    step08 = importlib.import_module("08_fsdp2")
    torch.manual_seed(0)
    images, labels = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    whole = Net().eval()  # eval: no dropout, so every copy computes the same function
    sharded, left_out = Net().eval(), Net().eval()
    sharded.load_state_dict(whole.state_dict())
    left_out.load_state_dict(whole.state_dict())

    backward(whole, images, labels)
    options = argparse.Namespace(hsdp=False, mixed_precision=False, reshard_after_forward=True)
    step08.shard(sharded, run, options)
    backward(sharded, images, labels)
    before = full_gradients(sharded)
    difference = max((a - b).abs().max().item() for a, b in zip(full_gradients(whole), before))
    exact_norm = float64_norm(before)
    whole_norm, sharded_norm = clip(whole), clip(sharded)  # the second: a DTensor
    clipped_norm = float64_norm(full_gradients(sharded))

    mesh = init_device_mesh("cpu", (run.world_size,))
    for layer in (left_out.conv1, left_out.conv2, left_out.fc1):  # fc2 forgotten, no root
        fully_shard(layer, mesh=mesh)
    backward(left_out, images, labels)
    try:
        clip(left_out)
        error = None
    except RuntimeError as err:
        error = str(err)
    (out / f"rank{run.rank}.json").write_text(json.dumps({
        "whole_norm": whole_norm.item(), "sharded_norm": sharded_norm.full_tensor().item(),
        "float64_norm": exact_norm, "gradient_difference": difference,
        "clipped_norm": clipped_norm, "left_out_error": error}))


if __name__ == "__main__":
    main()
    # The sharded models hold their meshes' groups: gone first, then the groups. Destroyed the
    # other way round, 2 runs of 26 aborted at the end ("terminate called without an active
    # exception", SIGABRT; torch 2.14.1, gloo) after both ranks had written their results; this
    # way, 0 of 32.
    gc.collect()
    dist.destroy_process_group()
