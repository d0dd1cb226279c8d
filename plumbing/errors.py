"""Errors a user can act on: one line and a non-zero exit, never a traceback.

Step 00 first needs it (every step ends with `common.run_main(main)`, which is this run_main).
"""

from __future__ import annotations

import gc
import os
import sys

import torch.distributed as dist


class UserError(Exception):
    """A problem with the input that one line can explain (missing data, a bad file, ...)."""


def launcher_rank() -> int:
    """This process's rank as its launcher set it (0 under plain python)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def run_main(main) -> None:
    """Run a step's `main()`, turning the failures a user can act on into one line each.

    - UserError: exit 2. Every rank meets the same bad input, so rank 0 alone prints it,
      except for an error raised inside one rank's DataLoader worker, which only that rank sees.
    - A collective that failed because a peer died or stalled (gloo raises; see
      explain_collective_failure): exit 3, printed by the rank that noticed.
    If main() failed before its own `dist.destroy_process_group()`, the group is torn down
    here, after its objects are gone: destroying a gloo group that a DDP model still holds
    has been seen to abort the process.
    """
    code = 0
    try:
        main()
    except UserError as err:
        message = str(err)
        in_worker = "DataLoader worker" in message  # re-raised with the worker's traceback
        if in_worker:
            message = message.rsplit("UserError: ", 1)[-1].strip()
        if in_worker or launcher_rank() == 0:
            prefix = f"rank {launcher_rank()}: " if in_worker else ""
            print(f"error: {prefix}{message}", file=sys.stderr, flush=True)
        code = 2
    except RuntimeError as err:
        explanation = explain_collective_failure(err)
        if explanation is None:
            raise
        print(f"error: rank {launcher_rank()}: {explanation}", file=sys.stderr, flush=True)
        code = 3
    finally:
        gc.collect()
        if dist.is_initialized() and code != 3:  # a broken group cannot be torn down cleanly
            dist.destroy_process_group()
    if code:
        sys.exit(code)


def explain_collective_failure(err: RuntimeError) -> str | None:
    """One line for a gloo collective that failed because of a peer, else None.

    gloo raises a RuntimeError with a transport-level message ("Connection reset by peer",
    "Timed out waiting 600000ms ..."); the user needs to know it means a peer-side problem.
    (NCCL does not raise here: its watchdog thread notices the timeout, logs "Watchdog caught
    collective operation timeout" and ends the process.)
    """
    message = str(err)
    first_line = message.strip().splitlines()[0] if message.strip() else type(err).__name__
    detail = first_line.split("] ", 1)[-1][:160]  # drop gloo's "[/path/to/file.cc:123]"
    if "timed out" in message.lower() or "timeout" in message.lower():
        return (f"a collective timed out ({detail}): another rank stalled or died without "
                f"closing its connections; check the other ranks' output, or raise --timeout "
                f"if some ranks legitimately take longer (e.g. a slow first step)")
    if any(marker in message for marker in ("Connection reset", "Connection closed",
                                            "Connection refused", "Broken pipe")):
        return (f"lost contact with a peer during a collective ({detail}): another rank "
                f"crashed or was killed; its own output above says why")
    return None
