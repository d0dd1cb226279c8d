"""Small rank-aware helpers the harness shares with the steps (which call them through
common.py): join the group, print once, and take the same branch on every rank.

They live here, below common.py, so that the package never imports from the root.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from .errors import STORE_PREFIX, PeerFailure, remember_store


def join_group(backend: str, rank: int, world_size: int, timeout_s: float, **kwargs) -> None:
    """`dist.init_process_group`, with a check-in that names the ranks that never came.

    The store is the one init_process_group would make from the launcher's variables (env://);
    every rank writes "joined" into it first. When the group then does not form within the
    timeout (a rank failed before it got here, say on a flag only its node rejects), the ranks
    that waited say which ranks they waited for, instead of blaming a crashed peer.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store, rank, world_size = next(dist.rendezvous("env://", rank=rank,
                                                       world_size=world_size, timeout=timeout))
    except getattr(dist, "DistStoreError", RuntimeError):  # the wait for the others timed out
        if by_hand(world_size):
            raise PeerFailure(f"waited {timeout_s:g} s (--timeout) for the other ranks of "
                              f"WORLD_SIZE={world_size} at MASTER_PORT="
                              f"{os.environ.get('MASTER_PORT')}; none came. WORLD_SIZE and "
                              f"RANK={rank} were set by hand, not by torchrun: if they are left "
                              f"over in the shell, unset them") from None
        raise
    store.set_timeout(timeout)
    store = dist.PrefixStore("default_pg", store)  # the prefix init_process_group would add
    store.set(f"{STORE_PREFIX}/joined/{rank}", socket.gethostname())
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout, **kwargs)
    except RuntimeError:
        try:
            missing = [r for r in range(world_size)
                       if not store.check([f"{STORE_PREFIX}/joined/{r}"])]
        except RuntimeError:  # the store left with node 0's agent: node 0 failed
            raise PeerFailure("lost the group's store (hosted by node 0) before the group "
                              "formed: node 0 failed; its own output says why") from None
        if not missing:
            raise
        raise PeerFailure(f"waited {timeout_s:g} s (--timeout) for rank(s) "
                          f"{', '.join(map(str, missing))} to join the group; they never did: "
                          f"their own output says why (an error on their node)") from None
    remember_store(store)


def by_hand(world_size: int) -> bool:
    """A world of several processes that neither torchrun nor srun started. (An sbatch script
    sets SLURM_PROCID too, for its one task: srun is several tasks.)"""
    srun = int(os.environ.get("SLURM_STEP_NUM_TASKS", 1)) > 1  # (checked a whole number)
    return world_size > 1 and not srun and "TORCHELASTIC_RUN_ID" not in os.environ


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
