"""The whole tutorial in one command: every step in order, briefly, then one table.

    python tour.py                    # about 2 minutes on a 2-core laptop CPU
    python tour.py --samples 10000    # more data per step (better accuracy, longer)

Each step runs the way you would run it yourself (plain python, or torchrun with 2 processes:
2 CPU processes, or 2 GPUs when there are; on one GPU a world of one, but 11, which compares
ranks, on 2 CPU processes; 12 always on 2 CPU processes) for one short epoch, and you see its
own output as it goes. The table at the end comes from the steps' runs/tour/<step>/summary.json:
what each step adds, its world size, test accuracy and samples/s, and the diff to read next.
04 compiles (once, 15-25 s on a CPU); the others run eagerly and with `--deterministic`, so that
steps that compute the same thing print the same accuracy on GPUs too, as on the CPU. Any step
that fails stops the tour with its exit code, except a step that refuses this torch as too old
(its versions.require_torch line): the table then says which torch it needs.
"""

from __future__ import annotations

import harness.startup  # noqa: F401 -- first: a Ctrl-C while torch loads is one line
import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import common
from harness import versions
from harness.flags import SAMPLES_LIMIT  # the steps' own bound on --train-samples

REPO = Path(__file__).resolve().parent
NO_SUMMARY = {"01_torch_dist_allreduce.py", "10_debugging.py", "11_your_model.py",
              "12_what_to_reduce.py"}  # no summary.json
# They compare N ranks with one process: N >= 2.
TWO_RANKS_AT_LEAST = {"11_your_model.py", "12_what_to_reduce.py"}
# Steps with flags of their own (none of the training flags the tour gives the others); 12 also
# computes on CPU processes on any machine, and takes no --device.
OWN_FLAGS = {"01_torch_dist_allreduce.py", "12_what_to_reduce.py"}
# file, runs on 2 processes?, the idea it adds, what to read next, extra arguments
STEPS = [
    ("00_single_gpu.py", False, "baseline: train and evaluate on one device",
     "read 00_single_gpu.py whole", []),
    ("01_torch_dist_allreduce.py", True, "side trip: collectives; a ring all-reduce by hand",
     "read 01_torch_dist_allreduce.py whole", []),
    ("02_manual_ddp.py", True, "data parallel by hand: sampler, broadcast, all-reduce",
     "diff -u 00_single_gpu.py 02_manual_ddp.py", []),
    ("02b_overlap_by_hand.py", True, "overlap by hand: bucketed all-reduce in backward",
     "diff -u 02_manual_ddp.py 02b_overlap_by_hand.py", []),
    ("03_ddp_wrapper.py", True, "the DDP wrapper: buckets that overlap backward",
     "diff -u 02_manual_ddp.py 03_ddp_wrapper.py", []),
    ("03b_sharded_optimizer.py", True, "side trip: ZeRO by hand: 1/N of the optimizer",
     "diff -u 03_ddp_wrapper.py 03b_sharded_optimizer.py", []),
    ("04_ddp_compile.py", True, "torch.compile on top of DDP",
     "diff -u 03_ddp_wrapper.py 04_ddp_compile.py", ["--compile"]),
    ("05_multinode.py", True, "many nodes: global, local and node rank",
     "diff -u 04_ddp_compile.py 05_multinode.py", ["--no-compile"]),
    ("06_streaming_h5.py", True, "side trip: stream the data from HDF5",
     "diff -u 05_multinode.py 06_streaming_h5.py", ["--no-compile"]),
    ("07a_exact_resume.py", True, "resume exactly, from the middle of an epoch",
     "diff -u 05_multinode.py 07a_exact_resume.py", ["--no-compile", "--checkpoint-every", "5"]),
    ("07b_restarts.py", True, "restarts: continue from this run's checkpoint",
     "diff -u 07a_exact_resume.py 07b_restarts.py", ["--no-compile", "--checkpoint-every", "5"]),
    ("07_fault_tolerance.py", True, "preemption: agree on a step, save, requeue",
     "diff -u 07b_restarts.py 07_fault_tolerance.py", ["--no-compile", "--checkpoint-every", "5"]),
    ("08a_meta_device.py", True, "the meta device: rank 0's weights, broadcast",
     "diff -u 07_fault_tolerance.py 08a_meta_device.py",
     ["--no-compile", "--checkpoint-every", "5"]),
    ("08b_fsdp2_shard.py", True, "FSDP2: shard weights, gradients, optimizer state",
     "diff -u 08a_meta_device.py 08b_fsdp2_shard.py",
     ["--checkpoint-every", "5"]),
    ("08_fsdp2.py", True, "FSDP2 at scale: HSDP, bf16, memory measured",
     "diff -u 08b_fsdp2_shard.py 08_fsdp2.py",
     ["--checkpoint-every", "5"]),
    ("09_distributed_checkpoint.py", True, "DCP: every rank writes its own shards",
     "diff -u 08b_fsdp2_shard.py 09_distributed_checkpoint.py",
     ["--checkpoint-every", "5"]),
    ("10_debugging.py", True, "side trip: planted hangs and the tools that find them",
     "read 10_debugging.py whole; then --bug skip", ["--fix"]),
    ("11_your_model.py", True, "side trip: six mistakes of your own model, fixed",
     "read 11_your_model.py whole; then --bug unused", ["--fix", "--steps", "2"]),
    ("12_what_to_reduce.py", True, "side trip: what to reduce when shares are unequal",
     "read 12_what_to_reduce.py whole; then --bug tokens", ["--fix"]),
]


def absolute(text: str) -> Path:
    """A path given relative to where the tour started, as the steps (run in REPO) must get it."""
    return Path(text).resolve()


def step_id(script: str) -> str:
    """The step's id: "02b" for 02b_overlap_by_hand.py."""
    return script.split("_")[0]


def placement(script: str, processes: int) -> tuple[int, list]:
    """The processes a distributed step gets and the flags that place it: the tour's own, but
    2 CPU processes for a step that needs two ranks where there is one GPU (NCCL refuses two
    ranks on one GPU; 12 is on the CPU anyway)."""
    if script in TWO_RANKS_AT_LEAST and processes < 2:
        return 2, [] if script in OWN_FLAGS else ["--device", "cpu"]
    return processes, []


def command(script: str, distributed: bool, processes: int, extra: list) -> list:
    launcher = [sys.executable]
    if distributed:
        launcher += ["-m", "torch.distributed.run", "--standalone",
                     f"--nproc-per-node={processes}"]
    return [*launcher, script, *extra]


# What stops the tour: a job's end (SIGTERM, SIGHUP), Ctrl-C or an IDE's stop button (SIGINT).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
running = {}  # the step's process while it runs, and the signal that stopped the tour


def run_step(script: str, cmd: list) -> int:
    """Run one step to its end; its exit code. The step runs in a session of its own, so that
    a terminal's Ctrl-C reaches the tour alone, which passes it on (once, as to any signal
    that stops the tour: see stop)."""
    running.clear()
    running["starting"] = True  # from here a signal is kept for the step (see stop)
    process = running["process"] = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    if "signal" in running:  # it came while the step was being started
        process.send_signal(running["signal"])
    code = process.wait()
    del running["starting"]
    if "signal" in running:  # the tour was stopped, and so was the step
        print(f"tour: stopped by {signal.Signals(running['signal']).name} during {script}, "
              f"which ended too (exit code {code})", file=sys.stderr, flush=True)
        sys.exit(128 + running["signal"])
    return code


def stop(signum, frame) -> None:
    """A signal to the tour goes to the step it runs, which ends as it ends on that signal
    (torchrun passes it to its ranks), with its own line; run_step then ends the tour. (The
    tour used to end at once and leave the step's ranks running.) Between steps it ends the
    tour at once."""
    running.setdefault("signal", signum)
    process = running.get("process")
    if process is not None and process.returncode is None:
        process.send_signal(signum)  # (a second one too: the steps take it as "now")
        return
    if running.get("starting"):  # the step is being started, or has just ended: run_step acts
        return
    print(f"tour: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    sys.exit(128 + signum)


def main():
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2048,
                        help="training samples per step (default 2048)")
    parser.add_argument("--test-samples", type=int, default=1000,
                        help="test samples per step (default 1000)")
    # Absolute paths: the steps run in the repository's folder, wherever the tour started.
    parser.add_argument("--out-dir", type=absolute, default=REPO / "runs" / "tour")
    parser.add_argument("--data", default="auto", choices=["auto", "mnist", "synthetic"])
    parser.add_argument("--data-dir", type=absolute, default=REPO / "data")
    args = parser.parse_args()
    if not 256 <= args.samples <= SAMPLES_LIMIT:
        parser.error(f"--samples must be from 256 (a few steps of 2 ranks x 64) to "
                     f"{SAMPLES_LIMIT}")
    if not 1 <= args.test_samples <= SAMPLES_LIMIT:
        parser.error(f"--test-samples must be from 1 to {SAMPLES_LIMIT}")
    # Two processes per distributed step: two CPU processes, or two GPUs (one if that is all).
    processes = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2
    shared = ["--data", args.data, "--data-dir", str(args.data_dir), "--epochs", "1",
              "--train-samples", str(args.samples), "--test-samples", str(args.test_samples),
              "--batch-size", "128", "--deterministic"]
    rows, started = [], time.monotonic()
    for script, distributed, idea, next_read, extra in STEPS:
        out = args.out_dir / Path(script).stem
        step_args = list(extra)
        if script not in OWN_FLAGS:
            step_args += [*shared, "--out-dir", str(out)]
        if script == "06_streaming_h5.py":
            step_args += ["--h5", str(out / "digits.h5")]  # prepared from the same samples
        step_processes, where = placement(script, processes)
        cmd = command(script, distributed, step_processes, [*step_args, *where])
        shown = ["torchrun", *cmd[3:]] if distributed else ["python", *cmd[1:]]
        print(f"\n=== {step_id(script)}: {idea}\n$ {' '.join(shown)}", flush=True)
        if where:
            print(f"(one GPU here: {script} needs two ranks, so it runs on 2 CPU processes)",
                  flush=True)
        code = run_step(script, cmd)
        needed = versions.torch_needed_by(REPO / script)  # its require_torch("X.Y", ...) line
        if code and needed and versions.torch_older_than(needed):
            rows.append((script, idea, next_read, f"needs torch {needed}", step_processes))
            continue
        if code:
            sys.exit(f"tour: {script} failed with exit code {code}; its output is above")
        summary = out / "summary.json"
        if script not in NO_SUMMARY and not summary.is_file():
            sys.exit(f"tour: {script} ended without writing {summary}; its output is above")
        rows.append((script, idea, next_read, json.loads(summary.read_text())
                     if summary.exists() else None, step_processes))
    print_table(rows, time.monotonic() - started)


def print_table(rows, seconds: float) -> None:
    print(f"\n=== the tour, {seconds:.0f} s: what each step added, and what it measured\n")
    print(f"{'step':<5}{'the idea it adds':<52}{'world':>5}{'test acc':>10}{'samples/s':>11}"
          f"   read next")
    for script, idea, next_read, summary, processes in rows:
        if summary is None:  # no summary.json (01, 10-12): its world is the processes started
            world, accuracy, rate = str(processes), "-", "-"
        elif isinstance(summary, str):  # this torch is too old for the step: it said which
            print(f"{step_id(script):<5}{idea:<52}{summary:>26}   (skipped)")
            continue
        else:
            world = str(summary["world_size"])
            accuracy = f"{100 * summary['test_accuracy']:.1f}%"
            rate = f"{summary['samples_per_sec']:,.0f}" if summary["samples_per_sec"] else "n/a"
        print(f"{step_id(script):<5}{idea:<52}{world:>5}{accuracy:>10}{rate:>11}   {next_read}")
    print("\nA few thousand samples per step: accuracies are low and samples/s only indicative"
          " (two processes share this machine's cores; see docs/benchmarks.md).")


if __name__ == "__main__":
    main()
