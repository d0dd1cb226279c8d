"""Draw one training step of every rank, as the profiler recorded it: forward, backward, optimizer
and communication, one run above the other. It shows where the all-reduce runs: after backward
in step 02, inside it in steps 02b (by hand) and 03 (DDP).

    torchrun --standalone --nproc-per-node 2 02_manual_ddp.py --profile
    torchrun --standalone --nproc-per-node 2 02b_overlap_by_hand.py --profile
    torchrun --standalone --nproc-per-node 2 03_ddp_wrapper.py --profile
    python bench/timeline.py runs/02_manual_ddp runs/02b_overlap_by_hand runs/03_ddp_wrapper

It reads the traces that --profile writes (<run>/profile/rank<R>.<time>.pt.trace.json) and draws,
of the recorded steps, the one whose slowest rank was fastest: the step least disturbed by
anything else on the machine, the same step on every rank. On a GPU the kernels on the device
are drawn too. The same traces open in Perfetto (ui.perfetto.dev) for the full detail.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's root
from harness.profiling import COMM_MARKERS, DEVICE_CATEGORIES  # noqa: E402

PHASES = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868",
          "communication": "#c44e52", "device compute": "#8172b3",
          "device communication": "#937860"}


def load_events(trace: Path) -> list[dict]:
    """The complete events ("X") of a trace; a file that is not a trace is named in the error."""
    try:
        return [e for e in json.loads(trace.read_text())["traceEvents"]
                if e.get("ph") == "X" and "dur" in e]
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # empty, cut short, other
        raise ValueError(f"{trace} is not a profiler trace ({type(err).__name__}: "
                         f"{str(err)[:80] or 'empty'})") from None


def host_steps(events: list[dict]) -> list[dict]:
    """The recorded training steps, in order (the host's spans, not the GPU's copies)."""
    return sorted((e for e in events if e["name"].startswith("ProfilerStep#")
                   and e.get("cat") != "gpu_user_annotation"), key=lambda e: e["ts"])


def step_phases(events: list[dict], index: int | None = None) -> dict[str, list]:
    """The spans of recorded step `index` (default: the middle one), in ms from its start:
    {"step": [(0, length)], "forward": [...], "backward": [...], "optimizer": [...],
    "communication": [...]} and, on a GPU, "device compute" and "device communication".

    Backward is the autograd engine's work; forward runs from the end of data loading to the
    start of backward; communication is every span of gloo's or NCCL's own (on their threads,
    or on the GPU) and of the c10d calls that start them.
    """
    steps = host_steps(events)
    if not steps:
        raise ValueError("no ProfilerStep in this trace: was it written by --profile?")
    step = steps[len(steps) // 2 if index is None else index]
    start, end = step["ts"], step["ts"] + step["dur"]
    inside = [e for e in events if start <= e["ts"] < end]
    trainer = [e for e in inside if (e["pid"], e["tid"]) == (step["pid"], step["tid"])]

    def spans(selected):
        return sorted(((e["ts"] - start) / 1000, (e["ts"] + e["dur"] - start) / 1000)
                      for e in selected)

    backward = spans(e for e in trainer if e["name"].startswith("autograd::engine::"))
    loading = spans(e for e in trainer if "DataLoader" in e["name"])
    forward_start = max((b for _, b in loading), default=0.0)
    phases = {
        "step": [(0.0, step["dur"] / 1000)],
        "forward": [(forward_start, backward[0][0])] if backward else [],
        "backward": [(backward[0][0], max(b for _, b in backward))] if backward else [],
        "optimizer": spans(e for e in trainer if e["name"].startswith("Optimizer.step#")),
        "communication": spans(e for e in inside if e.get("cat") not in DEVICE_CATEGORIES
                               and any(m in e["name"] for m in COMM_MARKERS)),
    }
    device = [e for e in inside if e.get("cat") in DEVICE_CATEGORIES]
    if device:
        is_comm = [any(m in e["name"] for m in COMM_MARKERS) for e in device]
        phases["device compute"] = spans(e for e, c in zip(device, is_comm) if not c)
        phases["device communication"] = spans(e for e, c in zip(device, is_comm) if c)
    return phases


def rank_traces(run_dir: Path) -> list[Path]:
    """The newest trace of each rank in <run_dir>/profile, in rank order."""
    newest = {}
    for trace in sorted((run_dir / "profile").glob("rank*.pt.trace.json")):
        newest[int(trace.name.split(".")[0][4:])] = trace
    if not newest:
        raise FileNotFoundError(f"no traces in {run_dir / 'profile'}: run the step with "
                                f"--profile first")
    return [newest[rank] for rank in sorted(newest)]


def least_disturbed(traces: list[Path]) -> list[dict]:
    """Every rank's phases of the same step: the one whose slowest rank was fastest."""
    ranks = [load_events(trace) for trace in traces]
    durations = [[s["dur"] for s in host_steps(events)] for events in ranks]
    recorded = min(len(d) for d in durations)
    if recorded == 0:
        empty = traces[min(range(len(traces)), key=lambda r: len(durations[r]))]
        raise ValueError(f"no ProfilerStep in {empty}: was it written by --profile?")
    best = min(range(recorded), key=lambda i: max(d[i] for d in durations))
    return [step_phases(events, best) for events in ranks]


def draw(runs: list[tuple[str, list[dict]]], path: Path, title: str) -> None:
    """One panel per run, one row per rank (two on a GPU: host and device)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    longest = max(p["step"][0][1] for _, ranks in runs for p in ranks)
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.1 + 1.2 * sum(
        len(r) for _, r in runs) / len(runs)), sharex=True, squeeze=False)
    for ax, (label, ranks) in zip(axes[:, 0], runs):
        rows = []
        for rank, phases in enumerate(ranks):
            rows.append((f"rank {rank}", ["forward", "backward", "optimizer"], 0.35))
            rows.append((f"rank {rank} comm", ["communication"], 0.35))
            if "device compute" in phases:
                rows.append((f"rank {rank} GPU", ["device compute", "device communication"],
                             0.35))
        for y, (name, kinds, height) in enumerate(rows):
            phases = ranks[int(name.split()[1])]
            for kind in kinds:
                bars = [(a, max(b - a, longest / 2000)) for a, b in phases.get(kind, [])]
                ax.broken_barh(bars, (y - height, 2 * height), color=PHASES[kind])
        ax.set_yticks(range(len(rows)), [name for name, *_ in rows])
        ax.invert_yaxis()
        ax.set_title(label, loc="left", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms from the start of the step")
    axes[-1, 0].set_xlim(0, longest * 1.01)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in PHASES.items()
                        if any(p.get(k) for _, r in runs for p in r)],
               loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (--out-dir of a step)")
    parser.add_argument("-o", "--output", type=Path, default=Path("overlap.png"))
    parser.add_argument("--title", default="One training step per rank, from the profiler's "
                        "traces")
    args = parser.parse_args()
    try:
        runs = [(run.name, least_disturbed(rank_traces(run))) for run in args.runs]
    except (OSError, ValueError, KeyError) as err:
        sys.exit(f"error: {err}")
    draw(runs, args.output, args.title)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
