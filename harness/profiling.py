"""Profiling a DDP step: a few scheduled steps per rank, one trace each, readable in TensorBoard
(torch-tb-profiler), Perfetto (ui.perfetto.dev) or chrome://tracing, and a step-time breakdown
that rank 0 prints at the end and each rank saves as <out-dir>/profile/summary_rank<R>.json."""

from __future__ import annotations

import json
import math
import os
import time
import warnings

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from .checkpoint import discard, free_space, write_atomically, write_failure
from .errors import UserError

# Names that mark communication: gloo's/NCCL's own spans, the c10d ops that start them, and on
# a GPU the NCCL kernels themselves (ncclKernel_* or ncclDevKernel_*, depending on the version).
COMM_MARKERS = ("gloo:", "nccl:", "c10d::", "record_param_comms", "ncclKernel", "ncclDevKernel")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def profiler(args, run):
    """`torch.profiler` over a few training steps when --profile is given, else a no-op.

    Step 1 is skipped (one-off start-up costs) and step 2 warms the profiler up; steps 3-5
    are recorded. Call `.step()` after every optimizer step.
    """
    if not args.profile:
        return _NoProfiler()
    activities = [ProfilerActivity.CPU]
    if run.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    else:
        # Kineto probes for GPUs even when asked for CPU activity only, and a CUDA build of
        # torch then logs "gpuGetDeviceCount failed" on every rank; on the CPU nothing it logs
        # applies to us. (6 is above its highest level; it is read when profiling starts.)
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    # One cycle (repeat=1) leaves nothing to accumulate, yet torch 2.11 was seen to warn
    # that "Profiler clears events at the end of each cycle" on a GPU.
    warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
    if (args.out_dir / "profile").is_symlink():  # as common.Progress: its target is not ours
        raise UserError(f"{args.out_dir / 'profile'} is a symbolic link: not writing into it")
    return StepProfiler(run, args.out_dir / "profile", activities=activities,
                        schedule=schedule(wait=1, warmup=1, active=3, repeat=1))


class StepProfiler(profile):
    """A `torch.profiler.profile` that saves one trace per rank and, when the profiled block
    ends normally, prints every rank's step breakdown from rank 0."""

    def __init__(self, run, trace_dir, **kwargs):
        super().__init__(on_trace_ready=self._save, **kwargs)
        self.run, self.trace_dir, self.breakdown = run, trace_dir, None

    def _save(self, prof):
        # The name tensorboard_trace_handler would give: the TensorBoard plugin reads
        # <worker>.<time_ns>.pt.trace.json and shows <worker> as the worker's name.
        path = self.trace_dir / f"rank{self.run.rank}.{time.time_ns()}.pt.trace.json"
        # torch's exporter writes <path>.tmp, then renames it; when that write fails (a full
        # disk) it says nothing (on the CPU, KINETO_LOG_LEVEL silences it) and leaves the
        # part it wrote, which would keep the disk full.
        partial = path.with_name(f"{path.name}.tmp")
        try:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
            if not path.is_file():
                raise UserError(f"could not write the profiler's trace {path}: the profiler "
                                f"wrote no file{free_space(path)}")
            self.breakdown = step_breakdown(json.loads(path.read_text())["traceEvents"])
            if self.breakdown:
                self.breakdown.update(rank=self.run.rank, trace=path.name)
                text = json.dumps(self.breakdown, indent=2) + "\n"
                write_atomically(self.trace_dir / f"summary_rank{self.run.rank}.json",
                                 lambda f: f.write(text.encode()))
        except OSError as err:
            raise UserError(f"could not write the profiler's trace {path}: "
                            f"{write_failure(err, path)}") from None
        finally:
            discard(partial)

    def __exit__(self, exc_type, *rest):
        result = super().__exit__(exc_type, *rest)
        if exc_type is None:  # after an error, other ranks may never reach the gather
            report(self.run, self.breakdown, self.trace_dir)
        return result


def step_breakdown(events: list[dict]) -> dict | None:
    """Mean time per ProfilerStep (ms) split into compute + exposed comm + data + other,
    which add up to the step, and beside them the communication hidden behind compute.

    Each step is partitioned in this order: compute (the training thread's ops, or on a GPU
    the kernels it launched: see _gpu_breakdown), then communication where no compute runs
    (exposed), then data loading (the DataLoader's __next__) where neither runs; the rest is
    other (Python, waiting). Gloo's
    worker threads and NCCL's kernels communicate alongside compute: that part is overlapped.
    """
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    # The host's step spans (with CUDA, each also appears on the GPU's timeline)
    steps = [e for e in spans if e["name"].startswith("ProfilerStep#")
             and e.get("cat") != "gpu_user_annotation"]
    if not steps:
        return None
    on_gpu = any(e.get("cat") in DEVICE_CATEGORIES for e in spans)
    trainer = [e for e in spans if (e["pid"], e["tid"]) == (steps[0]["pid"], steps[0]["tid"])]
    data = _union(_interval(e) for e in trainer
                  if "DataLoader" in e["name"] and "__next__" in e["name"])
    if on_gpu:
        return _gpu_breakdown(spans, steps, data)
    else:  # the loader's own ops are data loading, and a c10d call on the training thread
        # blocks it: communication, not compute, even where it runs ops of its own
        comm = _union(_interval(e) for e in spans if _is_comm(e))
        ops = _union(_interval(e) for e in trainer if e.get("cat") == "cpu_op")
        blocking = _union(_interval(e) for e in trainer if _is_comm(e))
        compute = _subtract(_subtract(ops, data), blocking)
    per_step = [_split_step(step, compute, comm, data) for step in steps]
    means = {key: sum(s[key] for s in per_step) / len(steps) for key in per_step[0]}
    return {"steps": len(steps), "timeline": "gpu" if on_gpu else "cpu", **means}


def _gpu_breakdown(spans: list, steps: list, data: list) -> dict | None:
    """The GPU's steps: the host runs ahead of the GPU, so a kernel often runs after the host
    step that launched it has ended, inside the next host step's window. Each kernel (memcpy,
    memset) therefore belongs to the step whose host window holds the CUDA runtime or driver
    call that launched it, matched by the correlation id both carry (args["correlation"] on the
    device event and on its cuda_runtime/cuda_driver event: torch 2.15's trace writers, Kineto's
    and torch/profiler/_cuspy/trace.py, both write it). A step's device window runs from its
    first kernel to the next step's first kernel (the last step: to its last kernel's end)."""
    launches = {e["args"]["correlation"]: e["ts"] for e in spans
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and e.get("args", {}).get("correlation")}
    owned = [[] for _ in steps]
    for event in spans:
        launched = launches.get(event.get("args", {}).get("correlation"))
        if event.get("cat") not in DEVICE_CATEGORIES or launched is None:
            continue
        for number, step in enumerate(steps):
            if step["ts"] <= launched <= step["ts"] + step["dur"]:
                owned[number].append(event)
    owned = [kernels for kernels in owned if kernels]
    if not owned:
        return None
    starts = [min(e["ts"] for e in kernels) for kernels in owned]
    ends = [*starts[1:], max(e["ts"] + e["dur"] for e in owned[-1])]
    everything = _union(_interval(e) for kernels in owned for e in kernels)
    per_step = []
    for kernels, start, end in zip(owned, starts, ends):
        compute = _union(_interval(e) for e in kernels if not _is_comm(e))
        comm = _union(_interval(e) for e in kernels if _is_comm(e))
        # data: the host in the DataLoader while the GPU runs nothing at all
        per_step.append(_split_step({"ts": start, "dur": end - start}, compute, comm,
                                    _subtract(data, everything)))
    means = {key: sum(s[key] for s in per_step) / len(per_step) for key in per_step[0]}
    return {"steps": len(per_step), "timeline": "gpu", **means}


def _is_comm(event: dict) -> bool:
    return any(marker in event["name"] for marker in COMM_MARKERS)


def _split_step(step: dict, compute: list, comm: list, data: list) -> dict:
    """One step's parts in ms: compute, then exposed comm, then data, then other."""
    window = [_interval(step)]
    busy, comm = _intersect(compute, window), _intersect(comm, window)
    exposed = _subtract(comm, busy)
    loading = _subtract(_subtract(_intersect(data, window), busy), exposed)
    ms = {"step_ms": step["dur"], "compute_ms": _length(busy),
          "exposed_comm_ms": _length(exposed), "data_ms": _length(loading)}
    ms["other_ms"] = ms["step_ms"] - ms["compute_ms"] - ms["exposed_comm_ms"] - ms["data_ms"]
    ms.update(overlapped_comm_ms=_length(_intersect(comm, busy)), comm_ms=_length(comm))
    return {key: us / 1000 for key, us in ms.items()}  # trace times are microseconds


def report(run, breakdown: dict | None, trace_dir) -> None:
    """Rank 0 prints one line per rank: the parts of its mean step time."""
    rows = [breakdown]
    if dist.is_initialized() and dist.get_world_size() > 1:
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, breakdown)
    if run.rank != 0 or not any(rows):
        return
    steps = next(row["steps"] for row in rows if row)
    print(f"profile: ms per step, mean of {steps} profiled steps (traces and summary_rank*.json "
          f"in {trace_dir})\n"
          f"rank    step =  compute + exposed comm +   data +  other | overlapped comm",
          flush=True)
    for rank, row in enumerate(rows):
        if row:
            print(f"{rank:>4} {row['step_ms']:7.1f} = {row['compute_ms']:8.1f} + "
                  f"{row['exposed_comm_ms']:12.1f} + {row['data_ms']:6.1f} + "
                  f"{row['other_ms']:6.1f} | {row['overlapped_comm_ms']:15.1f}", flush=True)


# Interval arithmetic on sorted, disjoint [start, end] lists.
def _interval(event: dict) -> list[float]:
    return [event["ts"], event["ts"] + event["dur"]]


def _union(intervals) -> list[list[float]]:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _intersect(a: list, b: list) -> list[list[float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append([start, end])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: list, b: list) -> list[list[float]]:
    edges = [-math.inf, *(t for interval in b for t in interval), math.inf]
    return _intersect(a, [edges[k:k + 2] for k in range(0, len(edges), 2)])  # a ∩ not-b


def _length(intervals: list) -> float:
    return sum(end - start for start, end in intervals)


class _NoProfiler:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self):
        pass
