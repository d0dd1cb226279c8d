"""Profiling a DDP step: a few scheduled steps per rank, one trace each, readable in TensorBoard
(torch-tb-profiler), Perfetto (ui.perfetto.dev) or chrome://tracing."""

from __future__ import annotations


def profiler(args, run):
    """`torch.profiler` over a few training steps when --profile is given, else a no-op.

    Step 1 is skipped (one-off start-up costs) and step 2 warms the profiler up; steps 3-5
    are recorded. Call `.step()` after every optimizer step.
    """
    if not args.profile:
        return _NoProfiler()
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU]
    if run.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                   on_trace_ready=tensorboard_trace_handler(str(args.out_dir / "profile"),
                                                            worker_name=f"rank{run.rank}"))


class _NoProfiler:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self):
        pass
