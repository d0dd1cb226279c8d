"""Measure what each step buys, side by side, and write a Markdown table.

    python bench/run.py                      # every row, 5 repeats, CPU (about 30 min on 2 cores)
    python bench/run.py --rows scaling,overhead --repeats 3
    python bench/run.py --device cuda        # the same rows on GPUs

Every configuration is a short real run of a step (its own processes, its own summary.json).
Within one repeat all configurations of all chosen rows run one after another, and the order
rotates from repeat to repeat, so slow drift of a shared machine hits every configuration alike.
A row reports medians and the min-max range over the repeats; where two configurations' ranges
overlap, it says the difference is not resolved on this machine instead of printing a ratio as
fact. This is a benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]  # harness/; bench/report.py, however started
from harness.flags import SAMPLES_LIMIT, Parser, integer, writable_file  # noqa: E402
from report import machine, report  # noqa: E402,F401  (machine: for lr_scaling.py)


@dataclass
class Config:
    """One way of running a step; `metric` reads the number we compare from a finished run."""

    row: str
    name: str
    script: str
    args: list
    nproc: int | None = None  # None: plain python
    metric: str = "samples_per_sec"
    env: dict = field(default_factory=dict)
    values: list = field(default_factory=list)
    extras: dict = field(default_factory=dict)  # other summary fields, e.g. first_step_seconds
    launcher_args: list = field(default_factory=list)
    probe: bool = False  # run under tests/rank_probe.py (PROBE_KILL: kill a rank mid-run)


def configs(opts) -> list[Config]:
    data = ["--data", "synthetic", "--train-samples", str(opts.samples), "--test-samples", "500",
            "--epochs", "1", "--device", opts.device]
    one_thread = {"OMP_NUM_THREADS": "1"}
    fresh_store = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # for --max-restarts
    per_rank = opts.per_rank_batch
    h5 = str(Path(opts.work) / "bench.h5")
    one = [*data, "--batch-size", per_rank]  # one rank's batch
    two = [*data, "--batch-size", 2 * per_rank]  # two ranks' global batch, per_rank each
    every = ["--checkpoint-every", str(opts.checkpoint_every)]
    killed_at = opts.checkpoint_every * 3 // 2
    rows = {
        "scaling": [  # same per-rank batch, one thread per rank: ideal 2 ranks = 2x samples/s
            Config("scaling", "03, 1 rank", "03_ddp_wrapper.py", one, nproc=1, env=one_thread),
            Config("scaling", "03, 2 ranks", "03_ddp_wrapper.py", two, nproc=2, env=one_thread),
        ],
        "overhead": [  # world size 1: what the DDP wrapper costs when there is nobody to talk to
            Config("overhead", "00 (no DDP)", "00_single_gpu.py", one, env=one_thread),
            Config("overhead", "03 (DDP, world of 1)", "03_ddp_wrapper.py", one, env=one_thread),
        ],
        "wrapper": [  # a model with 8x the parameters, so that gradient sync matters
            Config("wrapper", name, script, [*two, "--width", "8"], nproc=2, env=one_thread)
            for name, script in [("02 (sync after backward)", "02_manual_ddp.py"),
                                 ("02b (bucketed, overlapped, by hand)", "02b_overlap_by_hand.py"),
                                 ("03 (bucketed, overlapped)", "03_ddp_wrapper.py")]
        ],
        "compile": [
            Config("compile", f"04 {flag}", "04_ddp_compile.py", [*two, flag], nproc=2,
                   env=one_thread)
            for flag in ("--no-compile", "--compile")
        ],
        "streaming": [  # equal worker counts: one DataLoader worker per rank
            Config("streaming", "05 in memory", "05_multinode.py",
                   [*two, "--no-compile", "--num-workers", "1"], nproc=2, env=one_thread),
            Config("streaming", "06 HDF5", "06_streaming_h5.py",
                   [*two, "--no-compile", "--num-workers", "1", "--h5", h5], nproc=2,
                   env=one_thread),
        ],
        "checkpoints": [
            Config("checkpoints", "05", "05_multinode.py", [*two, "--no-compile"], nproc=2,
                   env=one_thread),
            Config("checkpoints", f"07, checkpoint every {opts.checkpoint_every} steps",
                   "07_fault_tolerance.py", [*two, "--no-compile", *every], nproc=2,
                   env=one_thread),
        ],
        "restart": [  # wall time of a whole run: the difference is what one killed rank costs
            Config("restart", "07, uninterrupted", "07_fault_tolerance.py",
                   [*two, "--no-compile", *every], nproc=2, metric="wall",
                   env={**one_thread, **fresh_store}),
            Config("restart", f"07, rank 1 killed at step {killed_at}", "07_fault_tolerance.py",
                   [*two, "--no-compile", *every], nproc=2, metric="wall",
                   env={**one_thread, **fresh_store, "PROBE_KILL": f"1:{killed_at}"},
                   launcher_args=["--max-restarts", "1"], probe=True),
        ],
        "fsdp2": [  # the same training, replicated (DDP) or sharded (FSDP2); no checkpoints
            Config("fsdp2", "07 (DDP)", "07_fault_tolerance.py",
                   [*two, "--no-compile", "--checkpoint-every", "0", "--width", "8"], nproc=2,
                   env=one_thread),
            Config("fsdp2", "08 (FSDP2)", "08_fsdp2.py",
                   [*two, "--checkpoint-every", "0", "--width", "8"], nproc=2, env=one_thread),
            Config("fsdp2", "08 (FSDP2, --no-reshard-after-forward)", "08_fsdp2.py",
                   [*two, "--checkpoint-every", "0", "--width", "8", "--no-reshard-after-forward"],
                   nproc=2, env=one_thread),
        ],
        "dcp": [  # checkpoints of a sharded model: gathered to rank 0's one file, or DCP's
            Config("dcp", f"08, one file every {opts.checkpoint_every} steps", "08_fsdp2.py",
                   [*two, "--width", "8", *every], nproc=2, env=one_thread),
            Config("dcp", f"09, DCP in the background every {opts.checkpoint_every} steps",
                   "09_distributed_checkpoint.py", [*two, "--width", "8", *every], nproc=2,
                   env=one_thread),
        ],
        "memory": [  # peak memory per rank (MiB, the largest rank's) of a 64x wider model;
            # 08's rank 0 also gathers the whole state for its checkpoint at the epoch's end
            *(Config("memory", f"{step[:2]} --width 64, {n} rank{'s' * (n > 1)}", step,
                     [*data, "--train-samples", str(96 * n), "--batch-size", str(16 * n),
                      "--width", "64", "--checkpoint-every", "0"], nproc=n,
                     metric="peak_memory_mib", env=one_thread)
              for step, n in [("08_fsdp2.py", 1), ("08_fsdp2.py", 2), ("08_fsdp2.py", 3),
                              ("09_distributed_checkpoint.py", 2),
                              ("09_distributed_checkpoint.py", 3)]),
        ],
        "minimal": [  # 03 against the plainest DDP loop: what the tutorial's machinery costs
            Config("minimal", "minimal DDP loop (bench/minimal_ddp.py)", "bench/minimal_ddp.py",
                   ["--train-samples", str(opts.samples), "--test-samples", "500", "--epochs",
                    "1", "--batch-size", 2 * per_rank], nproc=2, env=one_thread),
            Config("minimal", "03", "03_ddp_wrapper.py", two, nproc=2, env=one_thread),
        ],
        "exposed": [  # the profiler's breakdown: communication that no compute hides
            Config("exposed", "03, 1 rank, --profile", "03_ddp_wrapper.py", [*one, "--profile"],
                   nproc=1, metric="exposed", env=one_thread),
            Config("exposed", "03, 2 ranks, --profile", "03_ddp_wrapper.py",
                   [*two, "--profile"], nproc=2, metric="exposed", env=one_thread),
        ],
        "zero": [  # 03's optimizer state whole on every rank, or 1/N of it (03b, ZeRO by hand)
            Config("zero", name, script, [*two, "--width", "16", *flags], nproc=2,
                   env=one_thread)
            for name, script, flags in [
                ("03 (DDP, whole optimizer state)", "03_ddp_wrapper.py", []),
                ("03b ZeRO-1 by hand", "03b_sharded_optimizer.py", ["--zero-stage", "1"]),
                ("03b ZeRO-2 by hand", "03b_sharded_optimizer.py", ["--zero-stage", "2"]),
                ("03b torch's ZeroRedundancyOptimizer", "03b_sharded_optimizer.py",
                 ["--zero", "torch"])]
        ],
        "allreduce": [
            Config("allreduce", "01 --bench, 2 ranks, largest message",
                   "01_torch_dist_allreduce.py", ["--bench", "--max-mb", "16"], nproc=2,
                   metric="busbw", env=one_thread),
        ],
    }
    chosen = []
    for row in opts.rows.split(","):
        for config in rows[row]:
            if (REPO / config.script).exists():
                chosen.append(config)
            else:
                print(f"skipping {config.name}: {config.script} does not exist yet", flush=True)
    return chosen


# Runs a command and prints the peak resident memory of its largest process (a rank's): Linux
# counts every descendant that was waited for in RUSAGE_CHILDREN's ru_maxrss (in KiB).
LARGEST_PROCESS = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
                   "print(f'largest process: {resource.getrusage(resource.RUSAGE_CHILDREN)"
                   ".ru_maxrss} KiB', file=sys.stderr); sys.exit(code)")


def run_once(config: Config, out_dir: Path) -> float:
    """Run the configuration once; return its metric."""
    script = ["tests/rank_probe.py", config.script] if config.probe else [config.script]
    if config.nproc is None:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={config.nproc}", *config.launcher_args, *script]
    cmd += [str(a) for a in config.args]
    env = {**os.environ, **config.env}
    if config.metric != "busbw":
        cmd += ["--out-dir", str(out_dir)]
        shutil.rmtree(out_dir, ignore_errors=True)  # a fresh run each time, never a resume
        (out_dir / "probe").mkdir(parents=True)
        env["PROBE_DIR"] = str(out_dir / "probe")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", LARGEST_PROCESS, *cmd], cwd=REPO, env=env,
                          text=True, capture_output=True)
    wall = time.perf_counter() - started
    rss = re.findall(r"^largest process: (\d+) KiB$", proc.stderr, re.M)
    config.extras.setdefault("max_rss_mib", []).append(int(rss[-1]) / 1024 if rss else None)
    if proc.returncode != 0:
        raise SystemExit(f"{config.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    if config.metric == "busbw":  # the last row of 01's table: bytes, size, time, algbw, busbw
        rows = re.findall(r"^\s*\d+\s+\d+ [KM]iB\s+[\d.]+\s+[\d.]+\s+([\d.]+)",
                          proc.stdout, re.M)
        return float(rows[-1])
    if config.metric == "wall":
        return wall
    if config.metric == "exposed":  # percent of rank 0's mean profiled step
        breakdown = json.loads((out_dir / "profile" / "summary_rank0.json").read_text())
        return 100 * breakdown["exposed_comm_ms"] / breakdown["step_ms"]
    summary = json.loads((out_dir / "summary.json").read_text())
    for key in ("first_step_seconds", "train_seconds", "params_per_rank", "params_total",
                "mfu", "memory_after_build_mib", "peak_memory_mib", "optimizer_state_bytes",
                "optimizer_state_bytes_unsharded"):
        config.extras.setdefault(key, []).append(summary.get(key))
    # 09's "checkpoint NAME: B s blocking training, then W s in the background", per save
    for blocking, background in re.findall(r"([\d.]+) s blocking training, then ([\d.]+) s",
                                           proc.stdout):
        config.extras.setdefault("blocking", []).append(float(blocking))
        config.extras.setdefault("background", []).append(float(background))
    value = summary[config.metric]
    return max(value) if isinstance(value, list) else value  # per rank: the largest


def interleaved(configs: list, repeats: int):
    """(repeat, configuration) in the order a benchmark runs them: every configuration once per
    repeat, the order rotated each repeat, so that none always runs first (or after another)."""
    for repeat in range(repeats):
        shift = repeat % len(configs)
        for config in configs[shift:] + configs[:shift]:
            yield repeat, config


ROWS = ("scaling", "overhead", "minimal", "exposed", "wrapper", "compile", "streaming",
        "checkpoints", "restart", "fsdp2", "dcp", "memory", "zero", "allreduce")


def row_list(text: str) -> str:
    """--rows: names from ROWS, separated by commas."""
    unknown = [row for row in text.split(",") if row not in ROWS]
    if unknown:
        raise argparse.ArgumentTypeError(f"no row {', '.join(map(repr, unknown))}; the rows are "
                                         f"{','.join(ROWS)}")
    return text


def main():
    # One-line errors (harness/flags.py), checked before the first of many runs.
    parser = Parser(prog="bench/run.py", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=row_list, default=",".join(ROWS))
    parser.add_argument("--repeats", type=integer(1, 1000, "--repeats"), default=5)
    parser.add_argument("--samples", type=integer(1, SAMPLES_LIMIT, "--samples"), default=3000)
    parser.add_argument("--per-rank-batch", type=integer(1, 4096, "--per-rank-batch"),
                        default=64)
    parser.add_argument("--checkpoint-every", type=integer(1, 10_000, "--checkpoint-every"),
                        default=10)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=writable_file, default=REPO / "bench" / "results-cpu.md")
    opts = parser.parse_args()
    if opts.samples < 4 * opts.per_rank_batch:  # samples/s are timed from a run's second step
        parser.error(f"--samples {opts.samples} is less than 2 steps of the 2-rank batch: it "
                     f"must be at least 4 x --per-rank-batch = {4 * opts.per_rank_batch}")
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as work:
        opts.work = work
        chosen = configs(opts)
        if any("--h5" in config.args for config in chosen):  # write the file before timing
            subprocess.run([sys.executable, "06_streaming_h5.py", "prepare", "--data", "synthetic",
                            "--train-samples", str(opts.samples), "--test-samples", "500",
                            "--h5", str(Path(work) / "bench.h5"), "--out-dir",
                            str(Path(work) / "prepare")], cwd=REPO, check=True)
        for repeat, config in interleaved(chosen, opts.repeats):
            value = run_once(config, Path(work) / f"{config.row}-{config.name}".replace(" ", "_"))
            config.values.append(value)
            print(f"repeat {repeat + 1}/{opts.repeats}  {config.row:<11} {config.name:<40} "
                  f"{value:,.1f}", flush=True)
    table = report(chosen, opts)
    opts.out.write_text(table)
    print("\n" + table)


if __name__ == "__main__":
    main()
