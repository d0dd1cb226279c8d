"""Errors a user can act on: one line and a non-zero exit, never a traceback, never a hang.

Step 00 first needs it (every step ends with `common.run_main(main)`, which is this run_main).
The one line itself and what peers left in the group's store: peers.py; signals: watchdog.py.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import re
import signal
import sys
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.distributed.elastic.multiprocessing.errors import record as elastic_record

from . import around, startup
# The signal watchdog and the one-line reports live in their own modules; their names are
# imported here too, where the rest of the harness and the tests have always found them.
from .peers import (STORE_PREFIX, PeerFailure, failed_peers, launcher_rank,  # noqa: F401
                    launcher_world_size, leave_message, remember_store, report, this_launch)
from .watchdog import (GRACE_S, STOP_SIGNALS, Interrupted, exit_at_once, interrupt,  # noqa: F401
                       say_interrupted, say_peer_failure, signals_end_silently,
                       signals_end_the_process, stop_signals_end_now, stopped_by, watch_signals)

from common import UserError  # noqa: E402 -- one class: the plain run_main and this one catch it


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
    Whatever ended main() early, its DataLoader workers end with it (07's ignore SIGTERM), and
    the group is torn down after main()'s objects are gone (a gloo group that a DDP model still
    holds has been seen to abort the process when destroyed).
    """
    watch_signals()
    a_script = signal.getsignal(signal.SIGTERM) is startup.stopped_while_starting
    if a_script:  # a step's script (not a test that runs its main()):
        stop_signals_end_now()  # a stop signal is one line from here on too (07-09: a checkpoint)
    code, torn_down_cleanly = 0, True
    try:
        check_torch_variables()
        with around.around(main):  # the step's own checks, before and after (never in place)
            main()
    except BaseException as err:  # noqa: BLE001 -- sorted below; the rest is re-raised
        try:  # from here on, a Ctrl-C or SIGTERM ends it within GRACE_S
            signals_end_the_process()
        except (KeyboardInterrupt, Interrupted) as pending:  # a signal that came while main()
            try:  # waited in C (a gloo collective: no signal interrupts it), its handler run at
                signals_end_the_process()  # this first call (Python's next): it ended the run
            except (KeyboardInterrupt, Interrupted):  # (a second kind pending: the first counts)
                pass
            err = err if isinstance(err, (KeyboardInterrupt, Interrupted)) else pending
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
    if a_script:
        signals_end_silently(code)  # too late to stop anything: the run's own exit status
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
