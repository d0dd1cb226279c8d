"""The Markdown table bench/run.py writes: one line per configuration, grouped by row.

Medians and min-max ranges over the repeats; a ratio between two configurations only where
their ranges do not overlap (otherwise it says the difference is not resolved here), and for
some rows the numbers that explain the speed (MFU, tensor bytes per rank, save times, peaks).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics

UNITS = {"busbw": "GB/s bus bandwidth", "wall": "s per run",
         "exposed": "% of a step in exposed communication",
         "peak_memory_mib": "peak MiB per rank"}  # any other metric: samples/s


def spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def compare(base, other, higher_is_better: bool = True) -> str:
    """other/base as a ratio of medians, or "not resolved" when the ranges overlap."""
    b_med, b_lo, b_hi = spread(base.values)
    o_med, o_lo, o_hi = spread(other.values)
    ratio = o_med / b_med
    if o_lo <= b_hi and b_lo <= o_hi:
        return f"{ratio:.2f}x (ranges overlap: not resolved on this machine)"
    return f"{ratio:.2f}x"


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (f"{cpu}, {os.cpu_count()} cores; GPU: {gpu}; torch {torch.__version__}; "
            f"Python {platform.python_version()}; {datetime.date.today()}")


def comparison(row: str, i: int, config, group: list, med: float) -> str:
    """The last column for the i-th configuration of its row; group[0] is the row's baseline."""
    extras = config.extras
    text = f"{compare(group[0], config)} vs {group[0].name}" if i > 0 else ""
    if row == "scaling" and i == 1:
        efficiency = med / (2 * spread(group[0].values)[0])
        text = f"scaling efficiency {efficiency:.2f} (samples/s(2) / 2 x samples/s(1))"
    if row == "scaling":  # how far from the hardware: achieved / peak FLOP/s
        mfu = 100 * statistics.median(extras["mfu"])
        text = "; ".join(filter(None, [text, f"MFU {mfu:.1f} %"]))
    if row == "exposed":
        text = ""  # two fractions, each read on its own
    if row == "fsdp2" and i == 1:  # tensor bytes: weights + gradients + momentum
        held, total = extras["params_per_rank"][0][0], extras["params_total"][0]
        text += (f"; per rank {3 * 4 * held / 2**20:.1f} MiB of weights, gradients "
                 f"and momentum vs {3 * 4 * total / 2**20:.1f} MiB under DDP")
    if row == "dcp" and "blocking" in extras:
        text += (f"; a save blocks training {statistics.median(extras['blocking']):.2f} s, then "
                 f"writes {statistics.median(extras['background']):.2f} s "
                 f"in the background (medians over every save)")
    if row == "memory":  # tensor bytes: weights + gradients + momentum, and the peaks
        held = extras["params_per_rank"][0]
        built = [round(m) for m in extras["memory_after_build_mib"][-1]]
        peak = [round(m) for m in extras["peak_memory_mib"][-1]]
        text = (f"weights+gradients+momentum {3 * 4 * held[0] / 2**20:.0f} MiB per "
                f"rank; process peak per rank once built {built}, at most {peak}")
    if row == "zero":  # the optimizer state each rank keeps, and the largest process's peak
        state = (extras["optimizer_state_bytes"][-1]  # 03 reports none: all of it, 03b says
                 or group[-1].extras["optimizer_state_bytes_unsharded"][-1]) / 2**20
        rss = statistics.median(extras["max_rss_mib"])
        text += ("; " if text else "") + (f"optimizer state per rank {state:.1f} MiB; "
                                          f"peak resident memory of a rank {rss:,.0f} MiB")
    if row == "restart" and i == 1:
        lost = med - spread(group[0].values)[0]
        text = f"{lost:.1f} s lost to the kill (restart + redone steps)"
    return text


def report(chosen: list, opts) -> str:
    lines = [f"Machine: {machine()}", "",
             f"{opts.repeats} repeats, configurations interleaved; median (min-max). "
             f"Synthetic digits, {opts.samples} training samples, one epoch per run, "
             f"{opts.per_rank_batch} samples per rank per step, 1 thread per rank.", "",
             "| row | configuration | metric | median (min-max) | first step s | comparison |",
             "| --- | --- | --- | --- | --- | --- |"]
    by_row: dict[str, list] = {}
    for config in chosen:
        by_row.setdefault(config.row, []).append(config)
    for row, group in by_row.items():
        for i, config in enumerate(group):
            med, lo, hi = spread(config.values)
            first = config.extras.get("first_step_seconds")
            first_text = f"{statistics.median(first):.1f}" if first and None not in first else ""
            unit = UNITS.get(config.metric, "samples/s")
            lines.append(f"| {row} | {config.name} | {unit} | {med:,.1f} ({lo:,.1f}-{hi:,.1f}) "
                         f"| {first_text} | {comparison(row, i, config, group, med)} |")
    return "\n".join(lines) + "\n"
