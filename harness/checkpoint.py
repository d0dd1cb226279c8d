"""Checkpoints: written atomically, loaded to the CPU with weights_only=True, checked.

Step 00 first needs it. A checkpoint holds the plain model's weights (no `module.` or
`_orig_mod.` prefixes, so any step, and a plain `Net`, can load it), the optimizer and
scheduler, and the number of finished epochs; step 07 adds the position in an epoch and every
rank's random state. Reading one back, checked: checkpoint_reading.py.
"""

from __future__ import annotations

import errno
import glob
import os
import secrets
import shutil
import socket
import stat
from pathlib import Path

import torch

from .errors import UserError, first_line
# Reading and checking a checkpoint lives in checkpoint_reading.py; its names are imported here
# too, where the steps, the rest of the harness and the tests have always found them.
from .checkpoint_reading import (REQUIRED, check_position_and_rng, check_values,  # noqa: F401
                                 folder_hint, load, restore, rng_problem, whole)


def save(path: Path, model, optimizer, scheduler, epoch: int, **extra) -> None:
    """Write `path` atomically: a temporary file, fsync, then a rename over the old one.

    A crash or a full disk mid-write leaves the previous checkpoint as it was: the rename is
    atomic on POSIX, and a failed write removes its temporary file. (A full disk inside
    torch.save raises a RuntimeError "[enforce fail at inline_container.cc...]", not an
    OSError.) A temporary file left by a process killed mid-save (SIGKILL runs no cleanup) is
    removed by the next save on that machine.
    """
    # (A model and optimizer, or state dicts already made of them.)
    state = {"model": model if isinstance(model, dict) else model.state_dict(),
             "optimizer": optimizer if isinstance(optimizer, dict) else optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "epoch": epoch, **extra}
    refuse_non_finite(state, path)
    try:
        write_atomically(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as err:
        raise UserError(f"could not write checkpoint {path}: {write_failure(err, path)}; the "
                        f"previous checkpoint is unchanged") from None


def refuse_non_finite(state, path: Path) -> None:
    """A state whose "model" holds NaN or infinite weights is not written over `path`: a run
    that diverged between two loss checks never replaces a good checkpoint."""
    model = state.get("model") if isinstance(state, dict) else None
    if isinstance(model, dict) and not all(torch.isfinite(t).all() for t in model.values()
                                           if torch.is_tensor(t) and t.is_floating_point()):
        raise UserError(f"the weights became NaN or infinite; not saving them over {path}. "
                        f"Try a lower --lr")


def checked_save_torch(save_torch):
    """common.save_torch, checked as save() is (refuse_non_finite): 08b and 08 write the state
    they gather to rank 0 with it."""
    def save(path: Path, state) -> None:
        refuse_non_finite(state, path)
        save_torch(path, state)
    return save


def write_atomically(path: Path, write) -> None:
    """`write(f)` fills a temporary file beside `path` (a binary file of this process), which
    is then fsynced and renamed over `path`: `path` is whole or as it was, never cut short.

    On any failure the temporary file goes (where the filesystem still lets it: see discard)
    and the error is raised as it came; a temporary file that a killed process left (SIGKILL
    runs no cleanup) is removed by the next write of `path` on that machine. The harness's own
    atomic writes (checkpoints, summary.json, step 06's HDF5 file, the profiler's summaries) go
    through here; what a step writes itself goes through common.save_atomically.
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


def foreign(path: Path) -> str | None:
    """What a run never makes at `path` and must not write through, in a line (None: nothing,
    a plain file of one name, or a symbolic link, which O_NOFOLLOW refuses where it is opened).
    O_NOFOLLOW stops no hard link (a second name of someone's file), and opening a FIFO waits
    for a writer."""
    found = os.lstat(path) if os.path.lexists(path) else None
    if found is None or stat.S_ISLNK(found.st_mode) or (stat.S_ISREG(found.st_mode)
                                                         and found.st_nlink == 1):
        return None
    kind = "a hard link (a second name of another file)" if stat.S_ISREG(found.st_mode) else \
        "not a plain file (a FIFO, a device)"
    return f"{path} is {kind}; not writing through it. Remove it (a run makes it a plain file)"


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


def check_room(folder: Path) -> None:
    """Write a small file in `folder` and remove it: a disk that is full already, a quota or a
    read-only filesystem is one line at the start (steps 10 and 11 write only at their end;
    00-09 find it opening TensorBoard's event file)."""
    probe = temporary_name(folder / ".write-check")  # a new name: no file of anyone's is replaced
    try:
        write_atomically(probe, lambda f: f.write(bytes(4096)))
    except OSError as err:
        raise UserError(f"cannot write in --out-dir {folder}: {write_failure(err, probe)}"
                        ) from None
    discard(probe)
