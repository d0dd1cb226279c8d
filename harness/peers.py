"""Who this rank is, the one line it says, and what its peers said before they failed.

errors.py and watchdog.py end a run with one line per failure: report() prints it once per
machine (or on every rank, for a rank's own state), and a rank that fails leaves its line in the
group's store, where a rank that then loses it reads who failed and why (failed_peers).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
import socket
import sys
import tempfile
import time


class PeerFailure(Exception):
    """Another rank failed or never came: one line, exit 3, printed by the rank that waited."""


# The process group's key-value store, once this rank joined (ranks.join_group): a rank that
# fails leaves its message there, and a rank that then loses it can say who failed and why.
# The signal watchdog reads it through a connection of its own (a clone): the main thread may
# be blocked in a wait on the first one, and its timeout is the main thread's to set.
_group_store = None
_watch_store = None
STORE_PREFIX = "ddp-tutorial"


def remember_store(store) -> None:
    global _group_store, _watch_store
    _group_store = store
    try:
        _watch_store = store.clone()
        _watch_store.set_timeout(datetime.timedelta(seconds=2))
    except Exception:  # noqa: BLE001 -- no second connection: the watchdog does without
        _watch_store = None


def leave_message(message: str) -> None:
    """Leave this rank's error in the group's store, for the ranks that will wait for it."""
    if _group_store is None:
        return
    try:
        _group_store.set(f"{STORE_PREFIX}/failed/{launcher_rank()}",
                         f"{message} (on {socket.gethostname()})")
    except Exception:  # noqa: BLE001 -- the store died with its host: nothing to leave
        pass


def failed_peers(store=None) -> list[str]:
    """`rank R: <its error>` for each other rank that left one in the store (see leave_message).
    From the main thread (the group's store, given 5 s), or the watchdog (its own, 2 s)."""
    mine = store is None
    store = _group_store if mine else store
    if store is None:
        return []
    found = []
    try:
        if mine:
            store.set_timeout(datetime.timedelta(seconds=5))
        for rank in range(launcher_world_size()):
            key = f"{STORE_PREFIX}/failed/{rank}"
            if rank != launcher_rank() and store.check([key]):
                found.append(f"rank {rank}: {store.get(key).decode()}")
    except Exception:  # noqa: BLE001 -- the store's host (rank 0 or the agent) is gone
        pass
    return found


def launcher_rank() -> int:
    """This process's rank as its launcher set it (0 under plain python, or when it is not a
    number: flags.check_launcher_variables reports that, through report(), which calls this)."""
    return _launcher_number(("RANK", "SLURM_PROCID"), 0)


def launcher_world_size() -> int:
    return _launcher_number(("WORLD_SIZE", "SLURM_STEP_NUM_TASKS"), 1)


def _launcher_number(names: tuple, default: int) -> int:
    text = next((os.environ[name] for name in names if name in os.environ), str(default))
    try:
        return int(text)
    except ValueError:
        return default


def report(message: str, every_rank: bool = False) -> None:
    """Print `error: <message>` on stderr, from whichever rank met it.

    In a world of one, just the line. With several ranks, each rank prints its own error with its
    rank and host: a path missing on node 1 only is then explained on node 1. The same message
    from several ranks of one launch is printed once per machine (the first rank to claim it, by
    creating a marker file in the machine's temporary folder): N ranks meeting the same bad flag
    print one line, not N. A line about this rank's own state (every_rank) is printed by each.
    """
    if launcher_world_size() > 1:
        if not every_rank and not _first_to_say(message):
            return
        message = f"{message} (rank {launcher_rank()} on {socket.gethostname()})"
    print(f"error: {message}", file=sys.stderr, flush=True)


def _first_to_say(message: str) -> bool:
    """True for the first process of this launch on this machine to report `message`."""
    key = hashlib.sha1(f"{this_launch()}|{message}".encode()).hexdigest()[:20]
    try:
        folder = _private_marker_folder()
    except OSError:
        return True  # no private folder (another user's, or a link): rather twice than never
    try:
        for old in os.scandir(folder):  # markers of launches long gone (only names we make)
            try:
                if (_MARKER_NAME.fullmatch(old.name) and old.is_file(follow_symlinks=False)
                        and old.stat(follow_symlinks=False).st_mtime < time.time() - 86400):
                    os.unlink(old.name, dir_fd=folder)
            except FileNotFoundError:
                pass  # another rank of this launch, clearing them too, was first
        os.close(os.open(key, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600,
                         dir_fd=folder))
    except FileExistsError:
        return False
    except OSError:
        pass  # no marker possible: rather twice than never
    finally:
        os.close(folder)
    return True


_MARKER_NAME = re.compile(r"[0-9a-f]{20}")


def _private_marker_folder() -> int:
    """A descriptor of this user's marker folder in the temporary folder, made private (0700).
    The temporary folder is everyone's: another user could plant a link there, to make our
    launches write and delete in a folder of their choosing. So the folder is opened without
    following a link, and refused (OSError) unless it is a folder we own that only we can
    write; its name holds our user id, so that two users' launches each have their own."""
    path = os.path.join(tempfile.gettempdir(), f"ddp-tutorial-errors-{os.geteuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)  # a link: ELOOP
    info = os.fstat(folder)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(folder)
        raise PermissionError(f"{path} is not private to this user")
    return folder


def this_launch() -> str:
    """What tells this launch from every other on this machine, the same for all its ranks.

    The launcher's variables alone do not: a static `torchrun --nproc-per-node N` (no
    --standalone) sets TORCHELASTIC_RUN_ID=none, and a fixed --master-port or --rdzv-id repeats,
    so running the same failing command twice would print nothing the second time. A task of
    an srun step has SLURM's job and step numbers (both nodes of a step then share the line on
    a machine that runs two); anywhere else the process that started this rank (torchrun's
    agent, mp.spawn's parent) and when it started tell the launch apart.
    """
    env = os.environ
    launch = "|".join(env.get(name, "") for name in (
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID", "SLURM_STEP_ID",
        "SLURM_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT"))
    if "SLURM_STEP_ID" in env:
        return launch
    parent = os.getppid()
    try:  # the parent's start time (field 22): a pid alone may be reused
        with open(f"/proc/{parent}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "?"  # no /proc (macOS): the pid, unique while the launcher runs
    return f"{launch}|{parent}@{started}"
