"""What step 10 needs to ask every rank "where are you?" once a collective has failed.

Step 10 first needs it. With NCCL, the watchdog thread notices a timed-out collective and every
rank dumps its Flight Recorder (TORCH_NCCL_DUMP_ON_TIMEOUT, signalled through the store). gloo
on torch 2.14 has no such watchdog: a failed collective raises on the ranks that were in it, and
nothing at all happens on a rank that is elsewhere. So every rank runs a small thread here that
waits for a request in the store (the key/value server every process group already has) and
then publishes its state: its Flight Recorder's last collective, its step count and the line its
main thread is on. A rank that leaves early publishes its last state on the way out.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace  # the Flight Recorder's own dump

REQUEST, REPORTER, REPORTED = "debug10/request", "debug10/reporter", "debug10/reported"
POLL_SECONDS = 0.2
# DETAIL's op names, as the Flight Recorder spells them
DETAIL_OPS = {"ALLREDUCE": "all_reduce", "BARRIER": "barrier", "BROADCAST": "broadcast",
              "ALLGATHER": "all_gather", "REDUCE_SCATTER": "reduce_scatter"}


def store():
    """The process group's key/value store (torchrun's agent hosts it: it outlives the ranks)."""
    return dist.distributed_c10d._get_default_store()


# ---------------------------------------------------------------- what one rank knows
def flight_record() -> dict:
    """This rank's Flight Recorder buffer, as the pickled dict `_dump_fr_trace` returns.
    Without stack traces: symbolising them costs seconds on the first dump."""
    return pickle.loads(_dump_fr_trace(includeStackTraces=False))


# pg_id in the record: the default group (DDP's) is created first, step 10's `checked` group
# second; DETAIL's helper group for `checked`, when there is one, comes after and is left out.
GROUPS = {0: "DDP's group", 1: "checked group"}


def collective(entry: dict) -> dict:
    return {"seq": entry["collective_seq_id"], "op": entry["profiling_name"].split(":")[-1],
            "shapes": entry["input_sizes"], "dtypes": entry["input_dtypes"],
            "done": entry["retired"]}


def last_collectives(record: dict) -> dict[str, dict]:
    """The newest entry of each group, by the group's name."""
    newest = {}
    for e in record.get("entries", []):
        if e["pg_id"] in GROUPS:
            name = GROUPS[e["pg_id"]]
            if name not in newest or e["collective_seq_id"] > newest[name]["seq"]:
                newest[name] = collective(e)
    return newest


def pending_collective(record: dict) -> dict | None:
    """The collective this rank entered and never completed (retired False), if any."""
    waiting = [collective(e) for e in record.get("entries", [])
               if e["pg_id"] in GROUPS and not e["retired"]]
    return waiting[-1] if waiting else None


def where(frames, script: str) -> str:
    """'file:line in function' of the innermost frame inside `script`: the line a rank is on."""
    ours = [f for f in frames if Path(f.filename).name == Path(script).name]
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
    all-reduces), not in our own code."""
    return bool(stack) and any(part in stack[-1].filename
                               for part in ("torch/distributed", "torch/autograd"))


def detail_fingerprint(message: str) -> dict | None:
    """This rank's own collective, as TORCH_DISTRIBUTED_DEBUG=DETAIL's mismatch error states it
    ("Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=5, OpType=ALLREDUCE,
    TensorShape=[51], TensorDtypes=Float, ...)"). Only the first fingerprint is the rank's own;
    the other rank's, quoted after "but", was seen garbled here for barriers."""
    m = re.search(r"is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+),? ?"
                  r"OpType=(\w+)(?:, TensorShape=\[([^\]]*)\])?(?:, TensorDtypes=(\w+))?", message)
    if not m:
        return None
    shape = [int(s) for s in m[3].split(",") if s.strip()] if m[3] is not None else []
    # DETAIL counts the collectives before this one; the Flight Recorder numbers from 1.
    return {"seq": int(m[1]) + 1, "op": DETAIL_OPS.get(m[2], m[2].lower()), "shapes": [shape],
            "dtypes": [m[4] or ""], "done": False}


def short(message: str | None, limit: int = 400) -> str:
    """An error's first line without DETAIL's long TensorOptions(...) and gloo's source path."""
    text = re.sub(r", TensorDeviceTypes=TensorOptions\(.*?memory_format=(\([^)]*\)|[^)]*)\)", "",
                  message or "")
    text = re.sub(r"^\[[^\]]*\.cc:\d+\] ", "", text)
    return text if len(text) <= limit else text[:limit] + " ..."


def absent_ranks(message: str) -> list[int]:
    """Ranks named by a monitored barrier that timed out ("Ranks 1 failed to pass
    monitoredBarrier in 10000 ms"); DETAIL runs one before every collective."""
    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
    return [int(r) for r in m[1].split(",")] if m else []


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

    def run(self):
        line, since, noticed = None, time.monotonic(), False
        while not self.stopping.wait(POLL_SECONDS):
            if store().check([REQUEST]):
                publish(self.rank, self.state())
                return
            stack = main_thread_stack()
            if where(stack, self.script) != line or not waiting_in_torch(stack):
                line, since = where(stack, self.script), time.monotonic()
            elif not noticed and time.monotonic() - since > self.notice_after:
                noticed = True  # a hang in progress: the outside view, once
                print(f"[py-spy] rank {self.rank} (pid {os.getpid()}) has waited "
                      f"{self.notice_after:g} s at {line}; py-spy dump --pid {os.getpid()}: "
                      f"{py_spy(os.getpid(), self.script)}", flush=True)

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


# ---------------------------------------------------------------- files for fr_trace
def write_fr_dumps(folder: Path, records: dict[int, dict]) -> None:
    """One file per rank, as torch's analyser wants them: `python -m
    torch.distributed.flight_recorder.fr_trace FOLDER`. Two changes make gloo's dumps (torch
    2.14) readable to it: pg_config lists the default group under the key '' while its entries
    name it '0' (fr_trace stops with KeyError ('0', 1)), and every other group's entries are
    named '' too, so they are left out: the files hold DDP's group only."""
    folder.mkdir(parents=True, exist_ok=True)
    for rank, record in records.items():
        entries = [e for e in record["entries"] if e["pg_id"] == 0]
        names = {e["process_group"][0] for e in entries} or {"0"}
        config = {names.pop(): {**record["pg_config"].get("", {}), "desc": "default_pg"}}
        tmp = folder / f".rank{rank}.tmp"
        tmp.write_bytes(pickle.dumps({**record, "entries": entries, "pg_config": config}))
        os.replace(tmp, folder / f"rank{rank}")


# ---------------------------------------------------------------- the diagnosis line
def describe(c) -> str:
    """'#5 all_reduce of [51] Float' for a collective from the Flight Recorder or DETAIL."""
    shapes = ", ".join(str(list(s)) for s in c["shapes"]) or "no tensor"
    return f"#{c['seq']} {c['op']} of {shapes} {'/'.join(d for d in c['dtypes'] if d)}".rstrip()


def pending(state):
    """The collective a rank was in when it failed: its own DETAIL fingerprint, else the
    Flight Recorder's entry that never completed; None if it was in none."""
    return state["detail"] or state["pending"]


def who_is_behind(states: dict):
    """(ranks behind, a rank ahead), or None when no rank is behind. Behind means fewer
    training steps; at equal steps, absent from a collective (DETAIL's monitored barrier names
    it), or fewer collectives on DDP's group (the Flight Recorder's counts)."""
    steps = {r: s["steps"] for r, s in states.items()}
    absent = {r for s in states.values() for r in s["absent"]}
    seen = {r: s["last"].get("DDP's group", {"seq": 0})["seq"] for r, s in states.items()}
    for counts in (steps, None, seen):
        if counts is None and absent:
            return sorted(absent), min(set(states) - absent)
        if counts is not None and len(set(counts.values())) > 1:
            return ([r for r in counts if counts[r] == min(counts.values())],
                    max(counts, key=counts.get))
    return None


def missed_collective(states: dict, behind: int, ahead: int) -> str:
    """The collective the rank ahead waits in: its own record of it, else (when gloo did
    not mark it pending) the ones on DDP's group that only the rank ahead holds."""
    missed = pending(states[ahead])
    newest = states[ahead]["last"].get("DDP's group")
    first = states[behind]["last"].get("DDP's group", {"seq": 0})["seq"] + 1
    if missed is None and newest and newest["seq"] >= first:
        numbers = f"#{first}" if first == newest["seq"] else f"#{first}-{newest['seq']}"
        return f"{numbers} {describe(newest).split(' ', 1)[1]} on DDP's group"
    return describe(missed) if missed else "(none recorded)"


def diagnose(states: dict, world_size: int) -> str:
    """One line: the rank that is behind and the collective it missed, or the shapes that
    differ, or (failing both) where each rank is."""
    gone = [r for r in range(world_size) if r not in states]
    if gone:
        return (f"rank {', '.join(map(str, gone))} died without a word (gloo aborts a process "
                f"whose collective received more data than it expected): see its output above")
    found = who_is_behind(states)
    if found:
        behind, ahead = found
        steps = (f" ({states[behind[0]]['steps']} training steps, rank {ahead} took "
                 f"{states[ahead]['steps']})" if states[behind[0]]["steps"] !=
                 states[ahead]["steps"] else "")
        return (f"rank {', '.join(map(str, behind))} is behind{steps}: it missed collective "
                f"{missed_collective(states, behind[0], ahead)}, which rank {ahead} waits in "
                f"at {states[ahead]['where']}; rank {behind[0]} is at "
                f"{states[behind[0]]['where']}")
    ops = {r: pending(s) for r, s in states.items()}
    if all(ops.values()) and len({o["op"] for o in ops.values()}) == 1:
        return (f"collective #{ops[0]['seq']} ({ops[0]['op']}) got tensors of different "
                f"shapes: " + "; ".join(f"rank {r} {describe(o).split(' of ')[1]} at "
                                        f"{states[r]['where']}" for r, o in ops.items()))
    return "ranks disagree: " + "; ".join(f"rank {r} in {describe(o) if o else 'no collective'}"
                                          f" at {states[r]['where']}" for r, o in ops.items())
