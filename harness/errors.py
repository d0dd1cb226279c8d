"""Errors a user can act on: one line and a non-zero exit, never a traceback, never a hang.

Step 00 first needs it (every step ends with `common.run_main(main)`, which is this run_main).
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import multiprocessing
import os
import re
import select
import signal
import socket
import sys
import tempfile
import threading
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.distributed.elastic.multiprocessing.errors import record as elastic_record

from . import twins

# The signals a launcher sends to end a job: SLURM sends SIGTERM before it preempts a job or at
# the time limit (and USR1/USR2 with --signal), torchrun forwards SIGTERM, SIGINT, SIGHUP and
# SIGQUIT by default, any of them with --signals-to-handle. Step 07 turns all but SIGINT into a
# checkpoint and a stop (step07_fault_tolerance.StopRequest); SIGINT (Ctrl-C) ends a run at once.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


from common import UserError  # noqa: E402 -- one class: the plain run_main and this one catch it


class Interrupted(BaseException):
    """A signal that ends the process now, without a checkpoint (like KeyboardInterrupt, not an
    Exception: no `except Exception` on the way may swallow it). Raise it through interrupt().
    Both values are its args, which pickle rebuilds it from: DCP sends an exception raised on
    one rank to every rank."""

    def __init__(self, signum: int, why: str):
        super().__init__(signum, why)
        self.signum, self.why = signum, why

    def __str__(self) -> str:
        return self.why


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
            if (_MARKER_NAME.fullmatch(old.name) and old.is_file(follow_symlinks=False)
                    and old.stat(follow_symlinks=False).st_mtime < time.time() - 86400):
                os.unlink(old.name, dir_fd=folder)
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


# ---------------------------------------------------------------- a signal is never lost
# Python runs a signal's handler in the main thread, between two bytecodes. A main thread
# blocked in C runs none: a rank waiting in a gloo collective for a peer that stalled took a
# Ctrl-C only when the collective timed out (--timeout, 600 s by default). And an interrupt
# raised inside code that catches every exception can be lost (DCP catches even
# KeyboardInterrupt, to send it to every rank). But the C-level handler notes every signal at
# once, in a file descriptor (signal.set_wakeup_fd): a watchdog thread reads it, and ends the
# process when the main thread has not, GRACE_S after a Ctrl-C or after a handler's decision
# to end now (interrupt()). Either way: one line, exit 128 + the signal's number. A stop signal
# after a peer failed ends the rank the same way, exit 3 (see _end_if_a_peer_failed).
GRACE_S = 3.0
_ending: dict = {}  # deadline, code, why, failed, reported: how this process ends
_ending_lock = threading.RLock()  # (re-entrant: a signal's handler can run while its thread holds it)
_ending_anyway = False  # main() failed: a signal now only makes sure that the end comes
_wakeup = None


def interrupt(signum: int, why: str) -> Interrupted:
    """An Interrupted to raise (from a signal handler): the process ends within GRACE_S."""
    _end_within(GRACE_S, 128 + signum, why)
    return Interrupted(signum, why)


def _end_within(seconds: float, code: int, why: str, failed: str = "") -> None:
    with _ending_lock:
        if "deadline" not in _ending:  # the first reason to end is the one reported
            _ending.update(deadline=time.monotonic() + seconds, code=code, why=why, failed=failed)


def watch_signals() -> None:
    """Start the watchdog (run_main does, from the main thread, before main()), once per
    process: a test runs several steps' main() in one."""
    global _wakeup
    if _wakeup is not None:
        return
    reader, writer = _wakeup = socket.socketpair()  # (kept: a collected socket closes its fd)
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    if hasattr(os, "register_at_fork"):  # (POSIX)
        os.register_at_fork(after_in_child=_not_in_children)
    threading.Thread(target=_watch, args=(reader,), name="signal watchdog", daemon=True).start()


def _not_in_children() -> None:
    """A forked child (a DataLoader worker) would note its own signals in the parent's watchdog."""
    try:
        signal.set_wakeup_fd(-1)
        for signum in STOP_SIGNALS:  # and a stop signal ends it as before, by its default
            if signal.getsignal(signum) is _stop_now:
                signal.signal(signum, signal.SIG_DFL)
    except ValueError:  # forked from another thread: its signals are not Python's to handle
        pass


def _watch(reader: socket.socket) -> None:
    while True:
        deadline = _ending.get("deadline")
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if select.select([reader], [], [], timeout)[0]:
            received = reader.recv(64)  # a byte per signal, its number
            if not received:  # the writing end is closed: nothing will ever come (and select
                return  # would return at once, for ever: a thread that spins)
            stops = [signum for signum in STOP_SIGNALS if signum in received]
            if signal.SIGINT in received:
                _end_within(GRACE_S, 128 + signal.SIGINT, "interrupted (SIGINT)")
            elif stops and _ending_anyway:
                _end_within(GRACE_S, 128 + stops[0],
                            f"{signal.Signals(stops[0]).name} while ending after an error")
            elif stops:
                _end_if_a_peer_failed(received)
                if signal.getsignal(stops[0]) is _stop_now:  # (see stop_signals_end_now)
                    _end_within(GRACE_S, 128 + stops[0], stopped_by(stops[0]))
        elif deadline is not None:  # the main thread did not end the process in time
            not_by_itself = f"this rank did not stop by itself within {GRACE_S:g} s"
            if _ending["failed"]:
                say_peer_failure(f"the group cannot go on because {_ending['failed']}; asked to "
                                 f"stop ({_ending['why']}), {not_by_itself} (blocked in a "
                                 f"collective that cannot complete, or in I/O)")
            else:
                say_interrupted(_ending["why"], f"; {not_by_itself} (blocked in a collective "
                                                f"by a stalled peer, or in I/O)")
            children = multiprocessing.active_children()
            for child in children:
                child.kill()
            for child in children:
                child.join(timeout=1)
            exit_at_once(_ending["code"])


def _end_if_a_peer_failed(received: bytes) -> None:
    """A stop signal is taken at the main thread's next vote (StopRequest in step 07), after the
    collective it may be waiting in. When a peer already failed, that collective can never
    complete, and gloo does not always raise when the peer's connections close: a rank stopped
    (SIGSTOP) in DDP's backward and resumed after its peer died waited in
    Reducer::finalize_backward, on the all-reduce's future (no timeout), its connection to the
    peer already closed, until torchrun's SIGKILL 30 s after its SIGTERM. So a stop signal
    after a peer left its error in the store (torchrun sends one to every rank when a rank
    ends) ends this rank within GRACE_S: one line, exit 3, as a lost peer does."""
    if _watch_store is None or "deadline" in _ending:
        return
    failed = "; ".join(failed_peers(_watch_store))
    if failed:
        name = next(signal.Signals(s).name for s in STOP_SIGNALS if s in received)
        _end_within(GRACE_S, 3, name, failed=failed)


def stop_signals_end_now() -> None:
    """For what has no checkpoint to save on a stop signal (step 11, 09's export): SIGTERM and
    the other STOP_SIGNALS end the process as Ctrl-C does, one line and exit 128 + the
    signal's number, within GRACE_S even when the main thread is blocked in C (the watchdog).
    Their default action ended the process silently. (Steps 07-09 checkpoint instead:
    step07_fault_tolerance.StopRequest.) From the main thread."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _stop_now)


def _stop_now(signum, frame) -> None:
    raise interrupt(signum, stopped_by(signum))


def stopped_by(signum: int) -> str:
    return f"{signal.Signals(signum).name} received"


def say_interrupted(why: str, detail: str = "") -> None:
    """The one line an interrupt ends with, said once (by the main thread or the watchdog).
    The watchdog's detail (this rank was stuck) is this rank's own: every rank that was stuck
    says it. (Once per machine, a rank stuck behind a stalled peer said nothing whenever another
    rank had said the same words: rank 1 of the stalled-peer test, on a busy machine.)"""
    if _first_last_words():
        leave_message(why)
        report(f"{why}: stopped at once, without a checkpoint (the last one saved is kept)"
               f"{detail}", every_rank=bool(detail))


def say_peer_failure(explanation: str) -> None:
    """The one line a rank that lost a peer ends with, said once (main thread or watchdog)."""
    if _first_last_words():
        print(f"error: rank {launcher_rank()}: {explanation}", file=sys.stderr, flush=True)


def _first_last_words() -> bool:
    """True the first time only: a process ends with one line, whichever thread says it."""
    with _ending_lock:
        first = not _ending.get("reported")
        _ending["reported"] = True
    return first


def exit_at_once(code: int) -> None:
    """End the process now, skipping Python's finalization: freeing torch's objects took 5-12 s
    per rank after a Ctrl-C on the 2-core test machine, while a peer waiting in a collective
    waited for this rank's sockets to close. (Nothing is lost: checkpoints are written
    atomically, and TensorBoard's writer is flushed after every epoch.)"""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_main(main) -> None:
    """Run a step's `main()`, turning the failures a user can act on into one line each.

    - UserError: exit 2, printed by every rank that met it (see report()), also for an error
      raised inside one rank's DataLoader worker.
    - Ctrl-C (SIGINT, KeyboardInterrupt) or another signal that ends the process now
      (Interrupted): one line, exit 128 + the signal's number (130 for SIGINT), as a shell reports
      a process a signal killed. The process then ends at once (exit_at_once), and a watchdog
      thread ends it if the main thread cannot (blocked in C: see watch_signals).
    - A collective that failed because a peer died or stalled (gloo raises; see
      explain_collective_failure): exit 3, printed by the rank that noticed.
    - Anything else is a bug: its traceback, exit 1.
    Whatever ended main() early, this process's own children (DataLoader workers) end with it:
    step 07's workers ignore SIGTERM, and Python's exit would wait for them forever.
    If main() failed before its own `dist.destroy_process_group()`, the group is torn down
    here, after its objects are gone: destroying a gloo group that a DDP model still holds
    has been seen to abort the process.
    """
    watch_signals()
    code, torn_down_cleanly = 0, True
    try:
        check_torch_variables()
        twins.take_in(main)  # in the repository: the checked twins of the step's own functions
        main()
    except BaseException as err:  # noqa: BLE001 -- sorted below; the rest is re-raised
        signals_end_the_process()  # from here on, a Ctrl-C or SIGTERM ends it within GRACE_S
        end_child_processes()
        err = signal_behind(err)
        code = exit_code(err)
        if isinstance(err, (KeyboardInterrupt, Interrupted)):
            exit_at_once(code)
        # Bad input or a deliberate exit (argparse's, step 07's stop): the group is intact.
        torn_down_cleanly = code == 2 or isinstance(err, SystemExit)
        if code is None:
            raise
    finally:
        try:
            gc.collect()
            if dist.is_initialized() and torn_down_cleanly:  # a broken group cannot be torn down
                dist.destroy_process_group()
        except (KeyboardInterrupt, Interrupted) as err:  # a signal during the teardown:
            signals_end_the_process()  # main() is done, but the run ends as the signal says
            exit_at_once(exit_code(err))
    if code:
        sys.exit(code)


def signal_behind(err: BaseException) -> BaseException:
    """The Ctrl-C or Interrupted that `err` was raised while handling, else `err` itself.

    A signal can land inside torch.save's write to a Python file. Its exception then unwinds
    through torch's zip writer, and torch.save's cleanup (`write_end_of_file`) fails on the
    half-written record with a RuntimeError "unexpected pos" (torch 2.15), which our save turns
    into "could not write checkpoint". What ended the run was the signal, not the disk."""
    cause, visited = err, set()
    while cause is not None and id(cause) not in visited:
        if isinstance(cause, (KeyboardInterrupt, Interrupted)):
            return cause
        visited.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return err


def check_torch_variables() -> None:
    """Refuse a Flight Recorder size that torch cannot read, before any work. torch 2.15 reads
    it in C++ when the first process group is made (FlightRecorder.hpp, getCvarInt): an empty
    or non-numeric value, or one past 2^31-1, ends the process there with SIGABRT and no
    message; "1.5" becomes 1 in C++ and a traceback in Python (distributed_c10d.py,
    _maybe_attach_flight_recorder). A negative value turns the recorder off without a word."""
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):  # the second: old name
        value = os.environ.get(name)
        if value is not None and not (value.isascii() and value.isdigit() and
                                      int(value) < 2**31):
            raise UserError(f"{name}={value!r}: the Flight Recorder keeps that many collectives "
                            f"per rank; give a whole number from 0 (off) to 2147483647, or unset "
                            f"it (torch's default: 2000)")


# A collective failed because a peer was stopped by a signal (its line in the store). torchrun
# and SLURM send a stop signal to every rank at once, and this rank's own may not have come yet
# when the peer's end broke the collective: the run ends as the peer's does, with the peer's
# line (said once per machine) and exit code, not with a second line about a lost peer (seen
# in 1 of 4 clean-clone runs of test_sigterm_to_11_under_torchrun_is_said_by_the_step).
_STOPPED_PEER = re.compile(r"because rank \d+: (SIG[A-Z0-9]+) received")


def exit_code(err: BaseException) -> int | None:
    """Print one line for a failure we can explain and return its exit code; None otherwise."""
    if isinstance(err, SystemExit):  # argparse's (it printed its line), step 07's stop, ...
        return None
    if isinstance(err, UserError):
        message = str(err)
        if "DataLoader worker" in message:  # re-raised with the worker's traceback
            message = message.rsplit("UserError: ", 1)[-1].strip()
        leave_message(message)
        report(message)
        return 2
    if isinstance(err, (KeyboardInterrupt, Interrupted)):
        signum = getattr(err, "signum", signal.SIGINT)
        why = str(err) if isinstance(err, Interrupted) else "interrupted (SIGINT)"
        say_interrupted(why)
        return 128 + signum
    explanation = str(err) if isinstance(err, PeerFailure) else None
    if isinstance(err, RuntimeError):
        explanation = explain_collective_failure(err)
    stopped = _STOPPED_PEER.search(explanation or "")
    if stopped:  # a peer was stopped by a signal: see _STOPPED_PEER
        signum = signal.Signals[stopped.group(1)]
        say_interrupted(stopped_by(signum))
        return 128 + signum
    if explanation is not None:
        say_peer_failure(explanation)
        return 3
    leave_message(f"{type(err).__name__}: {first_line(err)}")  # a bug: its traceback follows
    return None


def signals_end_the_process() -> None:
    """From the error handling on, Ctrl-C and the stop signals raise nothing in the main thread,
    which goes on to print this rank's line: the watchdog ends the process GRACE_S after such a
    signal if the main thread has not by then. (A raise would replace the error being
    reported; their default action ended the rank before its line: torchrun's SIGTERM, sent to
    every rank once one failed, came first for about 30 % of the ranks that lost a stalled
    peer.)"""
    global _ending_anyway
    _ending_anyway = True
    for signum in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(signum, _for_the_watchdog)


def _for_the_watchdog(signum, frame) -> None:
    """Does nothing: being a Python handler makes Python's C-level handler write the signal to
    the watchdog's socket (SIG_DFL and SIG_IGN do not), and the watchdog acts on it."""


def end_child_processes() -> None:
    """Kill the DataLoader workers this process still has (SIGKILL: step 07's ignore SIGTERM).
    They hold nothing worth keeping; left alive, Python's exit joins them forever."""
    children = multiprocessing.active_children()
    if not children:
        return
    # The DataLoader's SIGCHLD handler would report their end as a crash.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=10)


def first_line(err: BaseException, limit: int = 160) -> str:
    """The first line of an exception's message, or its type when the message is empty
    (torch.load of an empty file raises an EOFError without one)."""
    lines = str(err).strip().splitlines()
    return lines[0][:limit] if lines else type(err).__name__


def explain_collective_failure(err: RuntimeError) -> str | None:
    """One line for a gloo collective that failed because of a peer, else None.

    gloo raises a RuntimeError with a transport-level message ("Connection reset by peer",
    "Timed out waiting 600000ms ..."); the user needs to know it means a peer-side problem.
    (NCCL does not raise here: its watchdog thread notices the timeout, logs "Watchdog caught
    collective operation timeout" and ends the process.)
    """
    message = str(err)
    detail = first_line(err).split("] ", 1)[-1]  # drop gloo's "[/path/to/file.cc:123]"
    failed = "; ".join(failed_peers())
    if "timed out" in message.lower() or "timeout" in message.lower():
        if failed:
            return f"a collective timed out because {failed}"
        return (f"a collective timed out ({detail}): another rank stalled or died without "
                f"closing its connections; check the other ranks' output, or raise --timeout "
                f"if some ranks legitimately take longer (e.g. a slow first step)")
    if any(marker in message for marker in ("Connection reset", "Connection closed",
                                            "Connection refused", "Broken pipe")):
        if failed:
            return f"lost contact with a peer during a collective because {failed}"
        return (f"lost contact with a peer during a collective ({detail}): another rank "
                f"crashed or was killed; its own output says why")
    return None


# ---------------------------------------------------------------- torchrun's failure summary
class _OneLineErrorFile(ErrorHandler):
    """What @record writes to the error file torchrun names: for an error we explain in one line
    (bad input, a lost peer), that line; for anything else (a bug), the traceback as usual."""

    def record_exception(self, e: BaseException) -> None:
        explained = isinstance(e, (UserError, PeerFailure)) or (
            isinstance(e, RuntimeError) and _PEER_MARKERS.search(str(e)))
        path = self._get_error_file_path()
        if not explained or not path:
            return super().record_exception(e)
        line = f"{type(e).__name__}: {first_line(e, limit=300)}"
        with open(path, "w") as file:
            json.dump({"message": {"message": line, "extraInfo": {
                "py_callstack": line, "timestamp": str(int(time.time()))}}}, file)


_PEER_MARKERS = re.compile(r"timed out|timeout|Connection (reset|closed|refused)|Broken pipe",
                           re.IGNORECASE)


def record(main):
    """torch's elastic `record` decorator (every step's main() wears it): a rank's error goes to
    the file torchrun names, so torchrun's failure summary shows it instead of `error_file:
    <N/A>`; an error we explain shows as its one line there too, never as a traceback."""
    return elastic_record(main, error_handler=_OneLineErrorFile())
