"""Step 10 in the repository: every rank's state after a failed collective, turned into one
diagnosis line, and the Flight Recorder's files for torch's analyser, around 10's main().

10_debugging.py runs unchanged here (and copied out, without this module): around(script),
entered by errors.run_main, replaces none of its functions. For the time of main() it replaces
common.parser (then a full --out-dir is one line before any work: the records go there) and
common.leave_at_once (where a rank whose collective failed ends, after its own lines), and
registers torch's global forward pre-hook (each forward of the DDP model in training is a step).
At the first step it starts a thread on each rank that waits for a request in the store (the
key/value server every process group has) and then publishes the rank's state: its Flight
Recorder's last collectives, its steps and the line its main thread is on; it also says, once,
where a rank waits (py-spy). A failed collective raises only on the ranks that were in it, so
the first rank to fail asks the others, waits for theirs, and prints each tool's finding, the
files and the diagnosis line. A rank whose main() returned leaves its last state on the way out.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import common

from .checkpoint import check_room
from .errors import UserError
from .step10_diagnosis import (absent_ranks, analyser_command, as_it_waited, describe,
                               detail_fingerprint, diagnose, flight_record, last_collectives,
                               pending_collective, serving_backend, short, write_fr_dumps)
from .watchdog import exit_at_once

REQUEST, REPORTER, REPORTED = "debug10/request", "debug10/reporter", "debug10/reported"
LEFT = "debug10/left/"  # + a rank: it has seen the report and ends (see report_failure)
POLL_SECONDS = 0.2
EXIT_HANG = 3  # the exit code of a run whose collective failed (as in errors.py and step 10)
FINAL_STATES_SECONDS = 5  # how long the reporter waits for every rank's own failure


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


def waiting_in_torch(stack) -> bool:
    """The main thread is inside a collective or a backward (where DDP waits for its
    all-reduces) or waits for its GPU (wait_until_done), not in our own code."""
    return bool(stack) and (stack[-1].name == "wait_until_done" or any(
        part in stack[-1].filename for part in ("torch/distributed", "torch/autograd")))


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


class Watcher(threading.Thread):
    """Publishes this rank's state when another rank asks, then ends the process once the
    report is out (its main thread may still wait in a collective: ended now, it prints
    nothing after the diagnosis); says once where the main thread is when it has waited in
    torch for `notice_after` s. It only reads (the main thread may be stuck)."""

    def __init__(self, me: ThisRank, notice_after: float):
        super().__init__(name="debug10-watcher", daemon=True)
        self.me, self.notice_after, self.stopping = me, notice_after, threading.Event()
        self.stuck = None  # the state taken once the main thread had waited notice_after s

    def run(self):
        me, script = self.me, self.me.script
        line, since, taken, noticed, answered = None, time.monotonic(), False, False, False
        while not self.stopping.wait(POLL_SECONDS):
            if answered:  # its state is out: the process ends with the report
                if me.store.check([REPORTED]):
                    me.leave(EXIT_HANG)
                continue
            if me.store.check([REQUEST]):
                me.publish(as_it_waited(self.stuck, me.state()))
                answered = True
                continue
            stack = main_thread_stack()
            if where(stack, script) != line or not waiting_in_torch(stack):
                line, since, taken = where(stack, script), time.monotonic(), False
            elif not taken and time.monotonic() - since > self.notice_after:
                taken, self.stuck = True, me.state()  # its record while it waits
                if not noticed:  # a hang in progress: the outside view, once
                    noticed = True
                    print(f"[py-spy] rank {me.rank} (pid {os.getpid()}) has waited "
                          f"{self.notice_after:g} s at {line}; py-spy dump --pid "
                          f"{os.getpid()}: {py_spy(os.getpid(), script)}", flush=True)

    def stop(self):
        self.stopping.set()
        self.join(timeout=5)  # (a store that stopped answering must not hold the exit)


class ThisRank:
    """What around() sees of this rank in one run of 10: its flags (common.parser), its steps
    (torch's forward pre-hook) and its group's store, kept (it outlives the group: torchrun's
    agent hosts it). Nothing here replaces a function of the step."""

    def __init__(self, script: Path):
        self.script, self.args, self.steps, self.plain = str(script), None, 0, {}
        self.store = self.rank = self.world_size = self.backend = self.watcher = None
        self.host = socket.gethostname()

    @contextlib.contextmanager
    def installed(self):
        """common's two functions replaced, torch's forward pre-hook registered; all undone on
        the way out."""
        self.plain = {name: getattr(common, name) for name in ("parser", "leave_at_once")
                      if hasattr(common, name)}  # (a common.py without leave_at_once: no report)
        for name in self.plain:
            setattr(common, name, getattr(self, name))
        handle = register_module_forward_pre_hook(self.before_forward)
        try:
            yield
        finally:
            handle.remove()
            for name, function in self.plain.items():
                setattr(common, name, function)
            if self.watcher is not None:
                self.watcher.stop()

    # ------------------------------------------------------------ common's functions, checked
    def parser(self, *args, **kwargs):
        parser = self.plain["parser"](*args, **kwargs)
        parse = parser.parse_args

        def parse_args(*args, **kwargs):  # then the --out-dir: a full disk is one line now
            self.args = parse(*args, **kwargs)
            check_room(self.args.out_dir)
            return self.args

        parser.parse_args = parse_args
        return parser

    def leave_at_once(self, code: int) -> None:
        """The step's own lines are out; a failed collective (the error the step is handling)
        gets every rank's state and the diagnosis first."""
        err = sys.exc_info()[1]
        if isinstance(err, RuntimeError) and self.watcher is not None:
            self.report_failure(err, code)
        self.plain["leave_at_once"](code)

    # ------------------------------------------------------------ torch's global hook
    def before_forward(self, module, inputs) -> None:
        if not (isinstance(module, DDP) and module.training):
            return
        self.steps += 1  # (as the step counts: a step begun)
        if self.watcher is None:  # the first step: the group is up, the model built
            self.store = dist.distributed_c10d._get_default_store()
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.backend = serving_backend()  # "gloo", "nccl2" or "nccl" (legacy)
            timeout = self.args.timeout if self.args is not None else 10
            self.watcher = Watcher(self, notice_after=timeout / 2)
            self.watcher.start()

    # ------------------------------------------------------------ the states
    def state(self, err=None, final=False) -> dict:
        """What this rank tells the others: its steps, its Flight Recorder record, its line;
        `final` once it will change no more (failed, or main() returned)."""
        record = flight_record(self.backend)
        message = str(err) if err is not None else ""
        line = (where(traceback.extract_tb(err.__traceback__), self.script) if err is not None
                else where(main_thread_stack(), self.script))
        return {"rank": self.rank, "pid": os.getpid(), "host": self.host, "steps": self.steps,
                "record": record, "last": last_collectives(record),
                "pending": pending_collective(record), "where": line, "final": final,
                "error": message.strip().splitlines()[0] if message.strip() else None,
                "detail": detail_fingerprint(message), "absent": absent_ranks(message)}

    def publish(self, state: dict) -> None:
        self.store.set(f"debug10/state/{self.rank}", json.dumps(state))

    def collect(self) -> dict[int, dict]:
        """Every rank's state: each one's final state (its own failure, after its own lines)
        where it comes within FINAL_STATES_SECONDS, else what its watcher published; a crashed
        rank's never comes. JSON, not pickle: nothing read from outside can run code."""
        states, deadline = {}, time.monotonic() + FINAL_STATES_SECONDS
        while True:
            for rank in range(self.world_size):
                key = f"debug10/state/{rank}"
                if not (rank in states and states[rank]["final"]) and self.store.check([key]):
                    states[rank] = json.loads(self.store.get(key))
            if (len(states) == self.world_size and all(s["final"] for s in states.values())
                    or time.monotonic() > deadline):
                return states
            time.sleep(POLL_SECONDS)

    def leave(self, code: int) -> None:
        """End now, once the report is out; the reporter waits for the ranks it found waiting."""
        self.store.set(f"{LEFT}{self.rank}", "1")
        exit_at_once(code)

    def finished(self) -> None:
        """main() returned: this rank's last state stays in the store for any rank still
        waiting (a rank that finished early is gone by the time the others fail)."""
        if self.watcher is not None:
            self.watcher.stop()
            self.publish({**self.state(final=True),
                          "where": f"the end of {Path(self.script).name} (main() returned)"})

    # ------------------------------------------------------------ after a failed collective
    def report_failure(self, err: RuntimeError, code: int) -> None:
        """Say which tool spoke, then (the first rank to fail) every rank's state, the files
        and the diagnosis line; never returns (see the step's report_failure)."""
        self.watcher.stop()
        if self.store.check([REPORTED]):  # the diagnosis is out (this rank's error, if its
            self.leave(code)  # reporter is gone, "closed by peer", is that: not news)
        state = as_it_waited(self.watcher.stuck, self.state(err, final=True))
        # Which tool spoke: DETAIL's checks (on `checked`), or the backend itself (gloo, nccl).
        from_detail = (state["detail"] or state["absent"]
                       or "monitoredBarrier" in (state["error"] or ""))
        tool = "TORCH_DISTRIBUTED_DEBUG=DETAIL" if from_detail else self.backend
        print(f"[{tool}] rank {self.rank}: {short(state['error'])}", flush=True)
        self.publish(state)
        self.store.set(REQUEST, "1")  # the other ranks' watchers publish theirs now
        if self.store.add(REPORTER, 1) != 1:  # the first rank to fail reports for everyone
            deadline = time.monotonic() + FINAL_STATES_SECONDS + 25  # (py-spy: 20 s at most)
            while time.monotonic() < deadline and not self.store.check([REPORTED]):
                time.sleep(POLL_SECONDS)
            self.leave(code)
        states = self.collect()
        self.print_report(states)
        self.store.set(REPORTED, "1")
        # Ranks still waiting (their watcher answered) end now; leaving before them would
        # break their collective, and they would print their own lines after the diagnosis.
        waiting = [f"{LEFT}{rank}" for rank, s in states.items() if not s["final"]]
        deadline = time.monotonic() + 2
        while waiting and not self.store.check(waiting) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS / 4)
        exit_at_once(code)

    def print_report(self, states: dict[int, dict]) -> None:
        for rank, s in sorted(states.items()):
            groups = "; ".join(f"{name} {describe(c)}{'' if c['done'] else ' NOT completed'}"
                               for name, c in s["last"].items())
            print(f"[Flight Recorder] rank {rank} ({s['steps']} steps, at {s['where']}): last "
                  f"collectives: {groups or 'none'}", flush=True)
        out_dir = self.args.out_dir if self.args is not None else Path("runs/10_debugging")
        folder = out_dir / "flight_recorder"
        unwritten = write_fr_dumps(folder, {r: s["record"] for r, s in states.items()})
        print(f"[Flight Recorder] records not written: {unwritten}" if unwritten else
              f"[Flight Recorder] records written: {analyser_command(folder)}", flush=True)
        for rank, s in sorted(states.items()):
            if s["host"] == self.host and not s["final"]:  # still stuck, on this machine
                print(f"[py-spy] rank {rank} (pid {s['pid']}): {py_spy(s['pid'], self.script)}",
                      flush=True)
        print(f"diagnosis: {diagnose(states, self.world_size)}", flush=True)


@contextlib.contextmanager
def around(script):
    """Step 10's checks around its main() (this module's docstring says what and why)."""
    if not hasattr(dist.distributed_c10d, "_get_default_store"):  # nothing to ask ranks through
        raise UserError(f"10_debugging.py needs torch.distributed.distributed_c10d."
                        f"_get_default_store(), which this torch ({torch.__version__}) has not")
    this = ThisRank(script)
    with this.installed():
        yield
        this.finished()
