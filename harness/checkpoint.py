"""Checkpoints: written atomically, loaded to the CPU with weights_only=True, checked.

Step 00 first needs it. A checkpoint holds the plain model's weights (no `module.` or
`_orig_mod.` prefixes, so any step, and a plain `Net`, can load it), the optimizer and
scheduler, and the number of finished epochs; step 07 adds the position in an epoch and every
rank's random state.
"""

from __future__ import annotations

import errno
import glob
import math
import os
import secrets
import shutil
import socket
from pathlib import Path

import torch

from .errors import UserError, first_line
from .flags import EPOCHS_LIMIT, STEPS_LIMIT, unreadable
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
    tmp, fd = create_temporary(path)
    try:
        with open(fd, "wb") as f:  # (the descriptor create_temporary opened)
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
    """`.<name>.<host>.<pid>.<random>.tmp` beside `path`: two writers (two runs, or two nodes on
    a shared filesystem) never write into the same temporary file, and the random part keeps
    anyone from planting a link under the name before we create it (see create_temporary)."""
    return path.with_name(f"{temporary_prefix(path)}{os.getpid()}.{secrets.token_hex(8)}.tmp")


def temporary_prefix(path: Path) -> str:
    return f".{path.name}.{socket.gethostname()}."


def create_temporary(path: Path) -> tuple[Path, int]:
    """A new temporary file for `path`, open for writing: (its name, its descriptor). O_EXCL and
    O_NOFOLLOW: the file is created here, never one that exists, and never through a symbolic
    link (one planted under the name would otherwise send the checkpoint wherever it points)."""
    tmp = temporary_name(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    return tmp, os.open(tmp, flags, 0o666)  # (the umask applies, as for open())


def remove_dead_temporaries(path: Path) -> None:
    """Remove the temporary files of `path` that processes of this machine, now dead, left
    (`<prefix><pid>.tmp` too, the name before the random part; a host name may hold dots)."""
    prefix = temporary_prefix(path)
    for tmp in path.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = tmp.name[len(prefix):].split(".")[0]
        if pid.isdigit() and not process_exists(int(pid)):
            discard(tmp)  # (a link is removed, never what it points to)


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
    if path.is_dir():
        raise UserError(f"checkpoint {path} is a folder, not a file: {folder_hint(path)}")
    problem = unreadable(path)  # missing, a FIFO, a device, not ours to read
    if problem:
        raise UserError(f"checkpoint {path} {problem}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except PermissionError as err:  # (os.access said yes, the open did not: ACLs, ...)
        raise UserError(f"checkpoint {path} cannot be read ({err.strerror})") from None
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
    check_values(checkpoint, path)
    weights = checkpoint["model"]
    if not all(torch.is_tensor(t) for t in weights.values()):
        raise UserError(f"checkpoint {path} is not one of this tutorial's: its model holds "
                        f"something other than tensors")
    if not all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point()):
        raise UserError(f"checkpoint {path} holds NaN or infinite weights; resume from an "
                        f"earlier one")
    return checkpoint


def folder_hint(path: Path) -> str:
    """What a folder given as a checkpoint file probably is, and what to give instead."""
    if (path / "checkpoint.pt").is_file():  # a run's --out-dir
        return f"did you mean {path / 'checkpoint.pt'}?"
    if (path / ".metadata").is_file():  # 09's checkpoint folder, or the link to one
        return (f"a distributed checkpoint of step 09, which steps 00-08 cannot read; write "
                f"one file from it with: python 09_distributed_checkpoint.py export --resume "
                f"{path}")
    return "give the checkpoint.pt file a run wrote"


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
    if rng is not None and not isinstance(rng, list):
        raise UserError(f"checkpoint {path} is not one of this tutorial's: its 'rng' is not a "
                        f"list of random states")
    for rank, state in enumerate(rng or []):
        problem = rng_problem(state)
        if problem:
            raise UserError(f"checkpoint {path} is damaged: the random state of rank {rank} is "
                            f"{problem}")


def rng_problem(state) -> str | None:
    """What is wrong with a saved random state ({"cpu": ..., "cuda": ...}), or None. A state
    torch would refuse, say one of the wrong size, is refused here, before any rank sets it: on a
    scratch generator, which checks it as torch.set_rng_state does."""
    if not (isinstance(state, dict) and torch.is_tensor(state.get("cpu"))):
        return f"a {type(state).__name__} without a CPU random state"
    try:
        torch.Generator().set_state(state["cpu"])
    except (RuntimeError, TypeError) as err:
        return f"not one torch can set ({first_line(err, 100)})"
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_initialized():  # only then is it set (rng_state)
        if not (torch.is_tensor(cuda) and cuda.dtype == torch.uint8
                and cuda.shape == torch.cuda.get_rng_state().shape):
            return "a CUDA random state of another size than this GPU's"
    return None


def whole(value, lowest: int, highest: int | None = None) -> bool:
    """A whole number (not a bool, not a float) in [lowest, highest]."""
    return (type(value) is int and value >= lowest
            and (highest is None or value <= highest))


def check_values(saved: dict, path: Path) -> None:
    """The numbers a resume continues from, checked against each other: a checkpoint that was
    edited by hand or damaged is one line naming the value, not a traceback or a run that
    silently trains nothing. `saved` holds "epoch" (finished epochs), "scheduler" (LRSchedule's
    state: the optimizer steps taken, "last_epoch", counted in "steps_per_epoch") and, from
    step 07 on, "position" (the steps of the next epoch already taken). Every step that resumes
    calls this: load() for one file, 09 for the values of a DCP folder.

    A checkpoint written after E epochs and S steps of the next holds last_epoch = E x steps
    per epoch + S, with 0 <= S < steps per epoch: one edited number breaks that."""
    check_position_and_rng(saved, path)  # their types, and each random state
    epoch, scheduler = saved.get("epoch"), saved.get("scheduler")
    if not whole(epoch, 0, EPOCHS_LIMIT):
        raise UserError(f"checkpoint {path} is damaged: its epoch is {epoch!r}, expected a "
                        f"whole number of finished epochs from 0 to {EPOCHS_LIMIT}")
    position = saved.get("position") or {}
    step = position.get("step", 0)
    if not (isinstance(scheduler, dict) and "steps_per_epoch" in scheduler):
        return  # not an LRSchedule's state: restore says it does not fit
    per_epoch, taken = scheduler["steps_per_epoch"], scheduler.get("last_epoch")
    if not whole(per_epoch, 1, STEPS_LIMIT):
        raise UserError(f"checkpoint {path} is damaged: its schedule counts {per_epoch!r} steps "
                        f"per epoch, expected a whole number from 1 to {STEPS_LIMIT}")
    if not whole(step, 0, per_epoch - 1):
        raise UserError(f"checkpoint {path} is damaged: its position is step {step!r} of an "
                        f"epoch of {per_epoch} steps, expected 0 to {per_epoch - 1}")
    if taken != epoch * per_epoch + step:
        raise UserError(f"checkpoint {path} is damaged: its schedule has taken {taken!r} steps, "
                        f"but {epoch} epoch(s) of {per_epoch} steps and {step} more make "
                        f"{epoch * per_epoch + step}")


def restore(path: Path, run, model, optimizer, scheduler, mid_epoch: bool = False) -> dict:
    """Load a checkpoint into the model, optimizer and scheduler; return it (its "epoch",
    the number of finished epochs, is where to continue). Steps 00-06 continue at an epoch's
    start; one written in the middle of an epoch (by 07 or 08) is refused unless the caller can
    continue there (mid_epoch=True): they would train the epoch's first steps again."""
    checkpoint = load(path)
    step = (checkpoint.get("position") or {}).get("step", 0)
    if step and not mid_epoch:
        raise UserError(f"checkpoint {path} was written at step {step} of epoch "
                        f"{checkpoint['epoch'] + 1}, in the middle of it: this step continues "
                        f"only from the end of an epoch, and would train those {step} steps "
                        f"again. Resume it with 07_fault_tolerance.py or 08_fsdp2.py, or use a "
                        f"checkpoint written at the end of an epoch")
    try:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])  # moves state to the params' device
        scheduler.load_state_dict(checkpoint["scheduler"])
    except (KeyError, RuntimeError, ValueError, TypeError) as err:
        raise UserError(f"checkpoint {path} does not fit this model/optimizer "
                        f"({first_line(err)})") from None
    log(run, f"resumed from {path} after epoch {checkpoint['epoch']}")
    return checkpoint


def check_room(folder: Path) -> None:
    """Write a small file in `folder` and remove it: a disk that is full already, a quota or a
    read-only filesystem is one line at the start (steps 10 and 11 write only at their end;
    00-09 find it opening TensorBoard's event file)."""
    probe = folder / ".write-check"
    try:
        write_atomically(probe, lambda f: f.write(bytes(4096)))
    except OSError as err:
        raise UserError(f"cannot write in --out-dir {folder}: {write_failure(err, probe)}"
                        ) from None
    discard(probe)
