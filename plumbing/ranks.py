"""Two small rank-aware helpers the plumbing shares with the steps (which call them through
common.py): print once, and take the same branch on every rank.

They live here, below common.py, so that the package never imports from the root.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def log(run, message: str) -> None:
    """Print from rank 0 only: N ranks printing the same line is noise."""
    if run.is_main:
        print(message, flush=True)


def all_ranks_agree(run, flag: bool, any_rank: bool = False) -> bool:
    """True only if `flag` is true on every rank (on any rank, with any_rank=True), so that
    all ranks take the same branch."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)], device=run.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX if any_rank else dist.ReduceOp.MIN)
    return bool(value.item())
