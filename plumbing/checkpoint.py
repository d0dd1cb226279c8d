"""Checkpoints: written atomically, loaded to the CPU with weights_only=True, checked.

Step 00 first needs it. A checkpoint holds the plain model's weights (no `module.` or
`_orig_mod.` prefixes, so any step, and a plain `Net`, can load it), the optimizer and
scheduler, and the number of finished epochs; step 07 adds the position in an epoch and every
rank's random state.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import socket
from pathlib import Path

import torch

from .errors import UserError, first_line
from .ranks import log

REQUIRED = {"model": dict, "optimizer": dict, "scheduler": dict, "epoch": int}


def save(path: Path, model, optimizer, scheduler, epoch: int, **extra) -> None:
    """Write `path` atomically: a temporary file, fsync, then a rename over the old one.

    A crash or a full disk mid-write leaves the previous checkpoint as it was: the rename is
    atomic on POSIX, and a failed write removes its temporary file. (A full disk inside
    torch.save raises a RuntimeError "[enforce fail at inline_container.cc...]", not an
    OSError.) A temporary file left by a process killed mid-save (SIGKILL runs no cleanup) is
    removed by the next save on that machine.
    """
    # (Step 08 passes the state dicts themselves: it gathers them from every rank's shards.)
    state = {"model": model if isinstance(model, dict) else model.state_dict(),
             "optimizer": optimizer if isinstance(optimizer, dict) else optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "epoch": epoch, **extra}
    if not all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point()):
        raise UserError(f"the weights became NaN or infinite; not saving them over {path}. "
                        f"Try a lower --lr")
    try:
        write_atomically(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as err:
        raise UserError(f"could not write checkpoint {path}: {write_failure(err, path)}; the "
                        f"previous checkpoint is unchanged") from None


def write_atomically(path: Path, write) -> None:
    """`write(f)` fills a temporary file beside `path` (a binary file of this process), which
    is then fsynced and renamed over `path`: `path` is whole or as it was, never cut short.

    On any failure the temporary file goes (where the filesystem still lets it: see discard)
    and the error is raised as it came; a temporary file that a killed process left (SIGKILL
    runs no cleanup) is removed by the next write of `path` on that machine. Every atomic write
    of the tutorial (checkpoints, summary.json, step 09's small files, step 06's HDF5 file, the
    profiler's summaries) goes through here.
    """
    remove_dead_temporaries(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    finally:
        discard(tmp)


def discard(path: Path) -> None:
    """Remove `path` if it is there, and never raise: on a filesystem that turned read-only,
    unlink fails (EROFS) even for a file that does not exist, and a cleanup must not replace
    the error that made it necessary."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def temporary_name(path: Path) -> Path:
    """`.<name>.<host>.<pid>.tmp` beside `path`: two writers (two runs, or two nodes on a shared
    filesystem) never write into the same temporary file."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def remove_dead_temporaries(path: Path) -> None:
    """Remove the temporary files of `path` that processes of this machine, now dead, left."""
    for tmp in path.parent.glob(f".{path.name}.{socket.gethostname()}.*.tmp"):
        pid = tmp.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not process_exists(int(pid)):
            discard(tmp)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def write_failure(err: BaseException, path: Path) -> str:
    """Why a write failed, in words: OSError's strerror (with a note when what ran out is
    inodes, not bytes), or for torch's RuntimeError its first line and the free space left."""
    if isinstance(err, OSError) and err.strerror:
        if err.errno == errno.ENOSPC and no_inodes_left(path.parent):
            return f"{err.strerror} (no inodes left there, though bytes are: see df -i)"
        return err.strerror
    return f"{first_line(err)}{free_space(path)}"


def free_space(path: Path) -> str:
    """'; 1.2 MiB free there: disk full?' for the filesystem of `path`, or '' when unknown."""
    try:
        return f"; {shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free there: disk full?"
    except OSError:
        return ""


def no_inodes_left(folder: Path) -> bool:
    """A filesystem can run out of inodes (one per file) with bytes to spare: then it says
    "No space left on device" too."""
    try:
        stats = os.statvfs(folder)
    except OSError:
        return False
    return stats.f_files > 0 and stats.f_favail == 0


def load(path: Path) -> dict:
    """Load to the CPU, accepting plain tensors and containers only, and check it is ours.

    To the CPU first: `load_state_dict` then copies each tensor to where its parameter lives,
    and what must stay on the CPU (step 07's RNG states) does.
    """
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 -- truncated zip, pickle error, ...
        raise UserError(f"checkpoint {path} is corrupt or not a checkpoint "
                        f"({type(err).__name__}: {first_line(err, 120)})") from None
    if not isinstance(checkpoint, dict):
        raise UserError(f"checkpoint {path} holds a {type(checkpoint).__name__}, not a "
                        f"checkpoint of this tutorial")
    for key, kind in REQUIRED.items():
        if not isinstance(checkpoint.get(key), kind):
            raise UserError(f"checkpoint {path} is not one of this tutorial's: its {key!r} is "
                            f"{type(checkpoint.get(key)).__name__}, expected {kind.__name__}")
    check_position_and_rng(checkpoint, path)
    weights = checkpoint["model"]
    if not all(torch.is_tensor(t) for t in weights.values()):
        raise UserError(f"checkpoint {path} is not one of this tutorial's: its model holds "
                        f"something other than tensors")
    if not all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point()):
        raise UserError(f"checkpoint {path} holds NaN or infinite weights; resume from an "
                        f"earlier one")
    return checkpoint


def check_position_and_rng(checkpoint: dict, path: Path) -> None:
    """Step 07's additions, when present: the position in an epoch (whole numbers of steps and
    samples, a finite loss sum) and one random state per rank (a CPU byte tensor each)."""
    position, rng = checkpoint.get("position"), checkpoint.get("rng")
    counts = (position.get("step"), position.get("samples")) if isinstance(position, dict) else ()
    if position is not None and not (
            counts and all(type(n) is int and n >= 0 for n in counts)
            and type(position.get("loss_sum")) in (int, float)
            and math.isfinite(position["loss_sum"])):
        raise UserError(f"checkpoint {path} is not one of this tutorial's: its 'position' is "
                        f"{position!r:.80}, expected whole numbers of steps and samples and a "
                        f"loss sum")
    if rng is not None and not (isinstance(rng, list) and all(
            isinstance(state, dict) and torch.is_tensor(state.get("cpu"))
            and state["cpu"].dtype == torch.uint8 for state in rng)):
        raise UserError(f"checkpoint {path} is not one of this tutorial's: its 'rng' is not a "
                        f"list of random states")


def restore(path: Path, run, model, optimizer, scheduler) -> dict:
    """Load a checkpoint into the model, optimizer and scheduler; return it (its "epoch",
    the number of finished epochs, is where to continue)."""
    checkpoint = load(path)
    try:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])  # moves state to the params' device
        scheduler.load_state_dict(checkpoint["scheduler"])
    except (KeyError, RuntimeError, ValueError, TypeError) as err:
        raise UserError(f"checkpoint {path} does not fit this model/optimizer "
                        f"({first_line(err)})") from None
    log(run, f"resumed from {path} after epoch {checkpoint['epoch']}")
    return checkpoint
