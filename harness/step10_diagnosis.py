"""Step 10's hang diagnosis: what a rank's Flight Recorder record and its error say, and the
one line made from every rank's state (harness/step10_debugging.py collects the states).

Every private torch API step 10's harness uses is reached here, and each is looked up
(attribute and argument, never the version number), with a fallback where it is absent:
  torch._C._distributed_c10d._dump_fr_trace    the Flight Recorder of gloo and of hooked backends
                                               (absent in torch 2.6.0: no record; its `backend=`
                                               argument, absent in 2.14.1, present in 2.15.0, is
                                               passed only for nccl2, new in 2.15 as well)
  torch._C._distributed_c10d._dump_nccl_trace  legacy ProcessGroupNCCL's own recorder (CUDA
                                               builds only; absent: no record)
  ProcessGroup._get_backend(device).name()     which backend serves a group ("gloo", "nccl2",
                                               or "nccl" for the legacy one); else get_backend()
(and distributed_c10d._get_default_store(), in step10_debugging.py).
"""

from __future__ import annotations

import errno
import functools
import importlib.util
import inspect
import pickle
import re
from pathlib import Path

import torch
import torch._C._distributed_c10d as c10d_ext
import torch.distributed as dist

from .checkpoint import write_atomically, write_failure

_dump_fr_trace = getattr(c10d_ext, "_dump_fr_trace", None)  # the Flight Recorder's own dump
# DETAIL's op names, as the Flight Recorder spells them
DETAIL_OPS = {"ALLREDUCE": "all_reduce", "BARRIER": "barrier", "BROADCAST": "broadcast",
              "ALLGATHER": "all_gather", "REDUCE_SCATTER": "reduce_scatter"}


def takes(function, keyword: str) -> bool:
    """Whether `function` accepts `keyword`. torch's C++ functions (pybind11) have no
    inspect.signature; the first line of their docstring is their signature."""
    try:
        return keyword in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return f"{keyword}:" in (function.__doc__ or "").split("\n", 1)[0]


# ---------------------------------------------------------------- what one rank knows
def serving_backend(group=None) -> str:
    """The name of the backend that carries `group`'s collectives (the default group: DDP's):
    "gloo"; "nccl2" (what the name `nccl` builds in torch 2.15: distributed_c10d.py,
    _register_builtin_nccl_backend); or "nccl", the legacy ProcessGroupNCCL (with
    TORCH_DIST_USE_NCCL2=0, or the name "nccl-legacy")."""
    group = group or dist.group.WORLD
    if not (hasattr(group, "_get_backend") and getattr(group, "_device_types", None)):
        return dist.get_backend(group)  # the public name: "nccl" for either NCCL backend
    return group._get_backend(group._device_types[0]).name()


def dump_for(backend: str):
    """The function that returns `backend`'s Flight Recorder buffer as a pickle. Each backend
    records into its own buffer (torch 2.15, FlightRecorder.hpp, getFlightRecorder):
    - gloo records natively, into the buffer `_dump_fr_trace()` reads by default;
    - nccl2 records nothing itself: distributed_c10d.py (_maybe_attach_flight_recorder)
      attaches a FlightRecorderHook to each of its groups, which records into a buffer keyed
      by the backend's name, "nccl2" (hooks/FlightRecorderHook.hpp); `_dump_fr_trace()` alone
      would read gloo's, where DDP's NCCL collectives never are;
    - legacy ProcessGroupNCCL records natively into a buffer of its own (of CUDA events),
      which only `_dump_nccl_trace()` reads.
    Without stack traces: symbolising them costs seconds on the first dump."""
    legacy = getattr(c10d_ext, "_dump_nccl_trace", None)  # only in CUDA builds
    if (backend == "nccl" and legacy is None) or _dump_fr_trace is None:
        return lambda: pickle.dumps({})  # no Flight Recorder for it in this torch: no record
    if backend == "nccl":
        return functools.partial(legacy, includeStackTraces=False)
    if backend == "gloo" or not takes(_dump_fr_trace, "backend"):  # one buffer only (2.14.1)
        return functools.partial(_dump_fr_trace, includeStackTraces=False)
    return functools.partial(_dump_fr_trace, includeStackTraces=False, backend=backend)


def flight_record(backend: str | None = None) -> dict:
    """This rank's Flight Recorder buffer for the backend that carries DDP's collectives
    (`backend`, named while the group was up: the buffer outlives the group)."""
    return pickle.loads(dump_for(backend or serving_backend())())


def group_names(record: dict) -> dict[int, str]:
    """{pg_id: name} for the two groups step 10 reads in a record. DDP's group is the one whose
    entries are named ('0', 'default_pg'), or else pg_id 0; step 10's `checked` group is the next
    pg_id. (gloo names a DETAIL-wrapped group's entries ('', ''), and DETAIL's helper group,
    created after `checked`, records into gloo's buffer too: the pg_ids tell them apart.)"""
    ids = sorted({e["pg_id"] for e in record.get("entries", [])})
    default = next((e["pg_id"] for e in record.get("entries", [])
                    if tuple(e["process_group"]) == ("0", "default_pg")), 0)
    others = [i for i in ids if i != default]
    return {default: "DDP's group", **({others[0]: "checked group"} if others else {})}


def collective(entry: dict) -> dict:
    return {"seq": entry["collective_seq_id"], "op": entry["profiling_name"].split(":")[-1],
            "shapes": entry["input_sizes"], "dtypes": entry["input_dtypes"],
            "done": entry["retired"]}


def last_collectives(record: dict) -> dict[str, dict]:
    """The newest entry of each group, by the group's name."""
    newest, names = {}, group_names(record)
    for e in record.get("entries", []):
        if e["pg_id"] in names:
            name = names[e["pg_id"]]
            if name not in newest or e["collective_seq_id"] > newest[name]["seq"]:
                newest[name] = collective(e)
    return newest


def pending_collective(record: dict) -> dict | None:
    """The collectives this rank entered and never completed (retired False) on the group of
    the newest of them, as one with its group's name: DDP queues one all-reduce per bucket,
    so a rank waits in several at once ("#15-16"). None if it waits in none."""
    names = group_names(record)
    waiting = [e for e in record.get("entries", []) if e["pg_id"] in names and not e["retired"]]
    if not waiting:
        return None
    group = waiting[-1]["pg_id"]
    first = next(e for e in waiting if e["pg_id"] == group)["collective_seq_id"]
    newest = collective(waiting[-1])
    seq = newest["seq"] if first == newest["seq"] else f"{first}-{newest['seq']}"
    return {**newest, "seq": seq, "group": names[group]}


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


def as_it_waited(stuck: dict | None, now: dict) -> dict:
    """`now`, with the Flight Recorder view of `stuck` when both are the same wait (same step,
    same line). Why: gloo marks a collective completed once it has failed (measured, torch
    2.15), so a record read after this rank's own timeout shows it in no collective, and one
    read before shows it waiting. Which comes first, the report or this rank's timeout, is a
    race; the record of the wait itself reads the same either way."""
    if stuck is None or (stuck["steps"], stuck["where"]) != (now["steps"], now["where"]):
        return now
    return {**now, **{key: stuck[key] for key in ("record", "last", "pending")}}


# ---------------------------------------------------------------- files for fr_trace
def analyser_command(folder: Path) -> str:
    """How to read the files with torch's analyser, where this torch has it (2.8 has not)."""
    if importlib.util.find_spec("torch.distributed.flight_recorder") is None:
        return (f"{folder} (torch {torch.__version__} has no analyser: "
                f"torch.distributed.flight_recorder.fr_trace is in newer torch)")
    return f"python -m torch.distributed.flight_recorder.fr_trace {folder}"


def write_fr_dumps(folder: Path, records: dict[int, dict]) -> str | None:
    """One file per rank, as torch's analyser wants them: `python -m
    torch.distributed.flight_recorder.fr_trace FOLDER`. The files hold DDP's group only, its
    entries under one name that pg_config also lists: gloo's dumps (torch 2.14.1 and 2.15.0)
    list the default group in pg_config under the key '' while its entries name it '0'
    (fr_trace stops with KeyError ('0', 1)), and name every DETAIL-wrapped group's entries ''
    (our `checked` group, and DETAIL's helper group), so those are left out.
    Returns why they could not be written (a full disk), or None: the diagnosis comes next."""
    try:
        if folder.is_symlink():  # its target is not this run's to fill
            raise OSError(errno.EEXIST, "a symbolic link: not writing through it")
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"{folder}: {err.strerror}"
    for rank, record in records.items():
        ddp = next(i for i, name in group_names(record).items() if name == "DDP's group")
        entries = [e for e in record.get("entries", []) if e["pg_id"] == ddp]
        names = {e["process_group"][0] for e in entries} or {"0"}
        name = names.pop()
        config = record.get("pg_config", {})
        config = {name: {**config.get(name, config.get("", {})), "desc": "default_pg"}}
        dump = pickle.dumps({**record, "entries": entries, "pg_config": config})
        try:
            write_atomically(folder / f"rank{rank}", lambda f: f.write(dump))
        except OSError as err:
            return f"{folder / f'rank{rank}'}: {write_failure(err, folder / f'rank{rank}')}"
    return None


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
    it), or fewer collectives on DDP's group (the Flight Recorder's counts). Ranks in order,
    the rank ahead the lowest of those with the most: the line is the same in every run."""
    ranks = sorted(states)
    steps = {r: states[r]["steps"] for r in ranks}
    absent = {r for s in states.values() for r in s["absent"]}
    seen = {r: states[r]["last"].get("DDP's group", {"seq": 0})["seq"] for r in ranks}
    for counts in (steps, None, seen):
        if counts is None and absent and set(states) - absent:
            return sorted(absent), min(set(states) - absent)
        if counts is not None and len(set(counts.values())) > 1:
            return ([r for r in ranks if counts[r] == min(counts.values())],
                    max(ranks, key=counts.get))
    return None


def missed_collective(states: dict, behind: int, ahead: int) -> str:
    """The collective the rank ahead waits in: its own record of it, else (when its record
    was read after gloo had marked it completed) the ones on DDP's group that only the rank
    ahead holds."""
    missed = pending(states[ahead])
    newest = states[ahead]["last"].get("DDP's group")
    first = states[behind]["last"].get("DDP's group", {"seq": 0})["seq"] + 1
    if missed is None and newest and newest["seq"] >= first:
        numbers = f"#{first}" if first == newest["seq"] else f"#{first}-{newest['seq']}"
        return f"{numbers} {describe(newest).split(' ', 1)[1]} on DDP's group"
    if missed is None:
        return "(none recorded)"
    return describe(missed) + (f" on {missed['group']}" if "group" in missed else "")


def odd_one_out(ops: dict) -> str:
    """' (rank R differs)' when every rank but R holds one shape (3 ranks or more)."""
    shapes = {r: str(o["shapes"]) for r, o in ops.items()}
    for r, shape in shapes.items():
        rest = {s for q, s in shapes.items() if q != r}
        if len(shapes) > 2 and len(rest) == 1 and shape not in rest:
            return f" (rank {r} differs)"
    return ""


def diagnose(states: dict, world_size: int) -> str:
    """One line: the rank that is behind and the collective it missed, or the shapes that
    differ, or (failing both) where each rank is."""
    gone = [r for r in range(world_size) if r not in states]
    if gone:
        return (f"rank {', '.join(map(str, gone))} died without a word (gloo aborts a process "
                f"whose collective received more data than it expected, NCCL's watchdog one "
                f"whose collective timed out): see its output above")
    found = who_is_behind(states)
    if found:
        behind, ahead = found
        steps = (f" ({states[behind[0]]['steps']} training steps, rank {ahead} took "
                 f"{states[ahead]['steps']})" if states[behind[0]]["steps"] !=
                 states[ahead]["steps"] else "")
        who = (f"rank {behind[0]} is behind{steps}: it" if len(behind) == 1 else
               f"ranks {', '.join(map(str, behind))} are behind{steps}: they")
        return (f"{who} missed collective "
                f"{missed_collective(states, behind[0], ahead)}, which rank {ahead} waits in "
                f"at {states[ahead]['where']}; rank {behind[0]} is at "
                f"{states[behind[0]]['where']}")
    ops = {r: pending(s) for r, s in states.items()}
    if all(ops.values()) and len({o["op"] for o in ops.values()}) == 1:
        first = ops[min(ops)]
        return (f"collective #{first['seq']} ({first['op']}) got tensors of different shapes"
                f"{odd_one_out(ops)}: " + "; ".join(f"rank {r} {describe(o).split(' of ')[1]} "
                                                   f"at {states[r]['where']}"
                                                   for r, o in sorted(ops.items())))
    return "ranks disagree: " + "; ".join(f"rank {r} in {describe(o) if o else 'no collective'}"
                                          f" at {states[r]['where']}" for r, o in ops.items())
