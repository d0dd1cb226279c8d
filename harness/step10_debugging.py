"""Step 10 in the repository: every rank's state after a failed collective, turned into one
diagnosis line, and the Flight Recorder's files for torch's analyser.

A failed collective raises only on the ranks that were in it (gloo; NCCL with
TORCH_NCCL_BLOCKING_WAIT=1, which step 10 sets), and nothing at all happens on a rank that is
elsewhere. So every rank runs a small thread here that waits for a request in the store (the
key/value server every process group already has) and then publishes its state: its Flight
Recorder's last collectives, its step count and the line its main thread is on. A rank that
leaves early publishes its last state on the way out. step10_diagnosis.py reads the states.

take_in(step) replaces these of the step's own functions (the step's plain ones print what
torch's tools say on each failed rank, and run copied out):
- setup: checks --out-dir has room first (the records go there: a full disk is one line before
  any work), and names the backend that carries DDP's collectives (nccl2 or legacy nccl);
- sized_for: the built-in synthetic digits unless --data is given (no download, no wait for
  the network: the same samples on every machine, as the tests and docs/debugging.md show);
- watch: starts the thread above (it also says where a rank waits, through py-spy);
- all_test_losses: the same, then leaves this rank's last state for ranks still waiting;
- report_failure: every rank's state, each tool's finding, the files, the diagnosis line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import check_room
from .errors import report
from .step10_diagnosis import (absent_ranks, analyser_command, as_it_waited, describe,
                               detail_fingerprint, diagnose, flight_record, last_collectives,
                               pending_collective, serving_backend, short, write_fr_dumps)

if not hasattr(dist.distributed_c10d, "_get_default_store"):  # nothing to ask the ranks through
    report(f"10_debugging.py needs torch.distributed.distributed_c10d._get_default_store(), "
           f"which this torch ({torch.__version__}) does not have")
    sys.exit(2)

REQUEST, REPORTER, REPORTED = "debug10/request", "debug10/reporter", "debug10/reported"
POLL_SECONDS = 0.2
EXIT_HANG = 3  # the exit code of a run whose collective failed (as in errors.py and step 10)


def store():
    """The process group's key/value store (torchrun's agent hosts it: it outlives the ranks)."""
    return dist.distributed_c10d._get_default_store()


def where(frames, script: str) -> str:
    """'file:line in function' of the innermost frame inside `script`: the line a rank is on."""
    ours = [f for f in frames if Path(f.filename).name == Path(script).name
            and f.name != "wait_until_done"]  # (the GPU wait: the step calling it is the line)
    if not ours:
        return "outside " + Path(script).name
    f = ours[-1]
    return f"{Path(f.filename).name}:{f.lineno} in {f.name}"


def main_thread_stack() -> traceback.StackSummary:
    return traceback.extract_stack(sys._current_frames()[threading.main_thread().ident])


def main_thread_line(script: str) -> str:
    """Where the main thread is right now (what `py-spy dump` shows, for Python frames)."""
    return where(main_thread_stack(), script)


def waiting_in_torch(stack) -> bool:
    """The main thread is inside a collective or a backward (where DDP waits for its
    all-reduces) or waits for its GPU (wait_until_done), not in our own code."""
    return bool(stack) and (stack[-1].name == "wait_until_done" or any(
        part in stack[-1].filename for part in ("torch/distributed", "torch/autograd")))


# ---------------------------------------------------------------- publishing and collecting
def publish(rank: int, state: dict) -> None:
    store().set(f"debug10/state/{rank}", json.dumps(state))


def collect(world_size: int, wait_seconds: float) -> dict[int, dict]:
    """Every rank's published state that arrives within `wait_seconds` (a crashed rank's never
    does). JSON, not pickle: nothing read from outside this process can run code."""
    states, deadline = {}, time.monotonic() + wait_seconds
    while len(states) < world_size and time.monotonic() < deadline:
        for rank in range(world_size):
            key = f"debug10/state/{rank}"
            if rank not in states and store().check([key]):
                states[rank] = json.loads(store().get(key))
        time.sleep(POLL_SECONDS)
    return states


def elect_reporter() -> bool:
    """True on the first rank to fail: that one prints the diagnosis, once for everybody."""
    return store().add(REPORTER, 1) == 1


def wait_for_report(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not store().check([REPORTED]):
        time.sleep(POLL_SECONDS)


class Watcher(threading.Thread):
    """Publishes this rank's state when another rank asks (or, through stop(), on the way out),
    and says once where the main thread is when it has waited in torch for `notice_after` s.

    `state()` is called in this thread; it must only read (the main thread may be stuck)."""

    def __init__(self, rank: int, state, script: str, notice_after: float):
        super().__init__(name="debug10-watcher", daemon=True)
        self.rank, self.state, self.script = rank, state, script
        self.notice_after, self.stopping = notice_after, threading.Event()
        self.stuck = None  # the state taken once the main thread had waited notice_after s

    def run(self):
        line, since, taken, noticed = None, time.monotonic(), False, False
        while not self.stopping.wait(POLL_SECONDS):
            if store().check([REQUEST]):
                publish(self.rank, as_it_waited(self.stuck, self.state()))
                return
            stack = main_thread_stack()
            if where(stack, self.script) != line or not waiting_in_torch(stack):
                line, since, taken = where(stack, self.script), time.monotonic(), False
            elif not taken and time.monotonic() - since > self.notice_after:
                taken, self.stuck = True, self.state()  # its record while it waits
                if not noticed:  # a hang in progress: the outside view, once
                    noticed = True
                    print(f"[py-spy] rank {self.rank} (pid {os.getpid()}) has waited "
                          f"{self.notice_after:g} s at {line}; py-spy dump --pid "
                          f"{os.getpid()}: {py_spy(os.getpid(), self.script)}", flush=True)

    def stop(self, publish_last_state: bool = True):
        """End the thread; leave this rank's last state in the store for any rank still
        waiting (a rank that finished early is gone by the time the others fail)."""
        self.stopping.set()
        self.join()
        if publish_last_state:
            publish(self.rank, self.state())


# ---------------------------------------------------------------- the optional outside view
def py_spy(pid: int, script: str) -> str:
    """The line `py-spy dump --pid` finds the process on, or why there is none. py-spy reads
    another process's memory with ptrace: root or the same user, and in containers the
    SYS_PTRACE capability (docker run --cap-add SYS_PTRACE)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return "not installed (pip install py-spy; then py-spy dump --pid PID)"
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                             timeout=20)
    except subprocess.TimeoutExpired:
        return "py-spy dump did not answer within 20 s"
    if out.returncode != 0:
        return f"py-spy dump failed: {(out.stderr or out.stdout).strip().splitlines()[-1:]}"
    name = Path(script).name
    lines = [line.strip() for line in out.stdout.splitlines() if f"({name}:" in line]
    return lines[0] if lines else f"no frame in {name} (the process is not in it)"


# ---------------------------------------------------------------- the step's twins
def rank_state(run, progress, script: str, err=None) -> dict:
    """What this rank tells the others: its steps, its Flight Recorder record, its line."""
    record = flight_record()
    message = str(err) if err is not None else ""
    return {"rank": run.rank, "pid": os.getpid(), "host": run.hostname,
            "steps": progress["steps"], "record": record,
            "last": last_collectives(record), "pending": pending_collective(record),
            "where": (where(traceback.extract_tb(err.__traceback__), script)
                      if err is not None else main_thread_line(script)),
            "error": message.strip().splitlines()[0] if message.strip() else None,
            "detail": detail_fingerprint(message), "absent": absent_ranks(message)}


def report_failure(err, run, args, progress, watcher: Watcher, script: str) -> None:
    """A collective raised: say what each tool found, then one diagnosis line; never returns
    (a gloo group whose collective failed cannot be destroyed cleanly: leave at once)."""
    watcher.stop(publish_last_state=False)
    if store().check([REPORTED]):  # the diagnosis is out and its reporter gone:
        os._exit(EXIT_HANG)  # this rank's error ("closed by peer") is that, not news
    state = as_it_waited(watcher.stuck, rank_state(run, progress, script, err))
    # Which tool spoke: DETAIL's checks (on `checked`), or the backend itself (gloo, nccl).
    from_detail = (state["detail"] or state["absent"]
                   or "monitoredBarrier" in (state["error"] or ""))
    tool = "TORCH_DISTRIBUTED_DEBUG=DETAIL" if from_detail else run.backend
    print(f"[{tool}] rank {run.rank}: {short(state['error'])}", flush=True)
    publish(run.rank, state)
    store().set(REQUEST, "1")  # the other ranks' watchers publish theirs now
    if not elect_reporter():  # the first rank to fail reports for everyone
        wait_for_report(seconds=10)
        os._exit(EXIT_HANG)
    states = collect(run.world_size, wait_seconds=5)
    for rank, s in sorted(states.items()):
        groups = "; ".join(f"{name} {describe(c)}{'' if c['done'] else ' NOT completed'}"
                           for name, c in s["last"].items())
        print(f"[Flight Recorder] rank {rank} ({s['steps']} steps, at {s['where']}): last "
              f"collectives: {groups or 'none'}", flush=True)
    folder = args.out_dir / "flight_recorder"
    unwritten = write_fr_dumps(folder, {r: s["record"] for r, s in states.items()})
    print(f"[Flight Recorder] records not written: {unwritten}" if unwritten else
          f"[Flight Recorder] records written: {analyser_command(folder)}", flush=True)
    for rank, s in sorted(states.items()):
        if s["host"] == run.hostname and s["error"] is None:  # still stuck, on this machine
            print(f"[py-spy] rank {rank} (pid {s['pid']}): {py_spy(s['pid'], script)}",
                  flush=True)
    print(f"diagnosis: {diagnose(states, run.world_size)}", flush=True)
    store().set(REPORTED, "1")
    os._exit(EXIT_HANG)


def take_in(step: dict) -> None:
    """Replace step 10's plain functions by the ones above (this module's docstring says why)."""
    script, plain = step["__file__"], dict(step)
    watchers = []  # this rank's one watcher, once watch() has started it

    def setup(args):
        check_room(args.out_dir)  # where the records go: a full disk is one line now
        run, checked = plain["setup"](args)
        run.backend = serving_backend()  # "nccl2" or "nccl" (legacy) under NCCL
        return run, checked

    def sized_for(args, n):
        args.data = args.data or "synthetic"
        plain["sized_for"](args, n)

    def watch(run, progress, args):
        watchers.append(Watcher(run.rank, lambda: rank_state(run, progress, script), script,
                                notice_after=args.timeout / 2))
        watchers[0].start()

    def all_test_losses(losses, run, checked, args):
        everyone = plain["all_test_losses"](losses, run, checked, args)
        watchers[0].stop()  # its last state stays, for a rank that may still fail
        return everyone

    def report_failure_(err, run, args, progress):
        report_failure(err, run, args, progress, watchers[0], script)

    step.update(setup=setup, sized_for=sized_for, watch=watch, all_test_losses=all_test_losses,
                report_failure=report_failure_)
