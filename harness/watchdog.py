"""The signal watchdog: a Ctrl-C or a stop signal is never lost, and ends a run in one line.

errors.run_main starts it (watch_signals) before a step's main(); steps 07-09 turn the stop
signals into a checkpoint and a stop (07's StopRequest, common.StopRequest), steps 11 and 09's
export end at once (stop_signals_end_now).
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import time

from . import peers
from .peers import failed_peers, launcher_rank, leave_message, report

# The signals a launcher sends to end a job: SLURM sends SIGTERM before it preempts a job or at
# the time limit (and USR1/USR2 with --signal), torchrun forwards SIGTERM, SIGINT, SIGHUP and
# SIGQUIT by default, any of them with --signals-to-handle. Steps 07-09 turn all but SIGINT into
# a checkpoint and a stop (07's StopRequest, common.StopRequest); SIGINT ends a run at once.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


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
    if peers._watch_store is None or "deadline" in _ending:
        return
    failed = "; ".join(failed_peers(peers._watch_store))
    if failed:
        name = next(signal.Signals(s).name for s in STOP_SIGNALS if s in received)
        _end_within(GRACE_S, 3, name, failed=failed)


def stop_signals_end_now() -> None:
    """For what has no checkpoint to save on a stop signal (step 11, 09's export): SIGTERM and
    the other STOP_SIGNALS end the process as Ctrl-C does, one line and exit 128 + the
    signal's number, within GRACE_S even when the main thread is blocked in C (the watchdog).
    Their default action ended the process silently. (Steps 07-09 checkpoint instead:
    07's StopRequest, common.StopRequest.) From the main thread."""
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


def signals_end_silently(code: int) -> None:
    """After main() and the group's teardown (a step run as a script): Ctrl-C and the stop
    signals end the process without a word (at its next bytecode), with the run's own exit
    status: they came too late to stop anything. Python's exit still runs its atexit callbacks
    (torch's weakref.finalize among them), and a handler that raised there printed "Exception
    ignored in atexit callback" and a traceback: CI saw it once, when torchrun's SIGTERM (sent
    to every rank because a peer failed) reached a rank that had finished."""
    for signum in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(signum, lambda signum, frame: exit_at_once(code))


def _for_the_watchdog(signum, frame) -> None:
    """Does nothing: being a Python handler makes Python's C-level handler write the signal to
    the watchdog's socket (SIG_DFL and SIG_IGN do not), and the watchdog acts on it."""
