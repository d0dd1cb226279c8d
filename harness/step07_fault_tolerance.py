"""What the harness checks around steps 07a to 09 (their restart mechanics are their own,
and common.py's): around(script) refuses restarts without a fresh store (check_restart_store),
makes a stop signal that cannot wait for a checkpoint end as errors.run_main ends a signal's
run (common.end_now, replaced while the step runs: one line, the watchdog), and lets the
checked reading of common.restore_checkpoint continue a checkpoint written mid-epoch (07a to
08 continue there; 00-06 refuse it). The --out-dir lock (claim_out_dir) comes in with
common.Metrics.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from pathlib import Path

import torch.distributed as dist

import common

from . import checkpoint, checkpoint_reading
from .errors import UserError, interrupt


def end_now(signum: int, why: str) -> None:
    """common.end_now, checked: errors.run_main's one line and exit 128 + the signal's number,
    ended by the watchdog within GRACE_S even when the main thread is blocked in C."""
    raise interrupt(signum, why)


@contextlib.contextmanager
def around(script: Path):
    """Before step 07's (or 08's, 09's) main(): the store check; while it runs, the checked
    end_now and mid-epoch reading."""
    check_restart_store()  # before anything: a restarted group must not meet at a stale store
    saved = common.end_now, checkpoint_reading.CONTINUES_MID_EPOCH
    common.end_now, checkpoint_reading.CONTINUES_MID_EPOCH = end_now, True
    try:
        yield
    finally:
        common.end_now, checkpoint_reading.CONTINUES_MID_EPOCH = saved


_out_dir_lock = None  # the lock's descriptor, open for the life of the process: closing unlocks
_claimed = set()  # the --out-dirs this process has claimed


def claim_out_dir(out_dir: Path, run) -> None:
    """One run at a time in an --out-dir: two runs at once would replace each other's
    checkpoints, and a restart of one could continue from the other's. Rank 0 holds an
    exclusive lock on <out-dir>/.lock for as long as it lives; the kernel releases it when the
    process ends, however it ends, so a restart or a requeue is never locked out. A second run
    is refused, on every rank, in one line naming the first.
    (Where the filesystem has no locks, some Lustre mounts, nothing is checked.)
    Steps 00-06 claim theirs when metrics.Metrics starts; a second call is a no-op."""
    if Path(out_dir).absolute() in _claimed:  # (every rank records it: all return here)
        return
    holder, problem = None, None
    if run.is_main:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            problem = checkpoint.foreign(out_dir / ".lock")  # a hard link, a FIFO: refused
            holder = None if problem else lock_for_life(out_dir / ".lock")
        except OSError as err:
            if err.errno == errno.ELOOP:  # a symbolic link: never written through
                problem = (f"{out_dir / '.lock'} is a symbolic link; not writing through it. "
                           f"Remove it (a run makes it a plain file)")
        except ImportError:
            pass  # no locks here, or no --out-dir yet: writing there will say why
    said = [holder, problem]
    if dist.is_initialized():
        dist.broadcast_object_list(said, src=0)
    if said[1]:
        raise UserError(said[1])
    if said[0]:
        raise UserError(f"--out-dir {out_dir} is in use by another run ({said[0]}): two runs "
                        f"in one --out-dir would replace each other's checkpoints. Give each "
                        f"run its own --out-dir")
    _claimed.add(Path(out_dir).absolute())


def lock_for_life(path: Path) -> str | None:
    """Lock `path` until this process ends; None, or the holder's line if another has it.

    A flock on a read-only descriptor: one open for writing would keep the filesystem from
    being remounted read-only (mount says "busy"). NFS emulates flock with POSIX locks, which
    need a writable descriptor: there, lockf on one. Forked children (DataLoader workers)
    close their copy: a worker that outlives a killed rank 0 by a second must not hold the
    lock against its restart.
    Every open is O_NOFOLLOW: a symbolic link planted as .lock would have us write the holder's
    line into whatever it names (ELOOP instead: claim_out_dir refuses)."""
    import fcntl  # (POSIX)
    global _out_dir_lock
    nofollow = os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NONBLOCK | nofollow, 0o644)  # (FIFO)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise
        except OSError:  # EBADF: flock emulated by POSIX locks (NFS)
            os.close(fd)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | nofollow, 0o644)
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # (EAGAIN or EACCES: held)
        os.close(fd)
        with open(os.open(path, os.O_RDONLY | nofollow), encoding="utf-8",
                  errors="replace") as f:
            return f.read(200).strip() or "a process"
    _out_dir_lock = fd
    os.register_at_fork(after_in_child=lambda: os.close(fd))
    with open(os.open(path, os.O_WRONLY | os.O_TRUNC | nofollow), "w") as f:  # (closed again)
        f.write(f"process {os.getpid()} on {socket.gethostname()}\n")
    return None


def check_restart_store() -> None:
    """torchrun --max-restarts restarts the group, and by default the new group meets at the
    same store as the dead one (hosted by node 0's agent), where the dead group's addresses are
    still written: gloo then connects to processes that no longer exist (pytorch/pytorch#135712).
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, set where torchrun starts, gives every round a fresh
    store hosted by its rank 0."""
    if (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        raise UserError("torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
                        "torchrun's environment, or a restarted group reads the dead group's "
                        "addresses and cannot connect (pytorch/pytorch#135712)")
