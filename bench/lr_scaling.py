"""Strong and weak scaling, and the learning rate: loss curves at equal samples seen.

    python bench/lr_scaling.py                 # 8 configurations x 3 seeds, ~10 min on 2 cores
    python bench/lr_scaling.py --repeats 5 --samples 8192 --epochs 4

Every configuration trains step 03 on the same data for the same epochs (the same samples seen
at each epoch's end); what differs is how many ranks share a step, and the steps' size and pace:

  fixed global batch (--batch-size B) on 1 and 2 ranks: strong scaling, the same computation;
  --batch-per-rank B on 2 and 4 ranks: weak scaling, a global 2B and 4B (1/2 and 1/4 of the
    steps); the same --lr, --lr-scaling linear (2, 4) and sqrt (4) after warm-up, linear without.

Dropout is off (each rank's own masks would blur the fixed-batch comparison). The repeats are
seeds: how far a curve moves between seeds is what a difference has to beat. Configurations
are interleaved, rotating per repeat (as in run.py). A benchmark: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import REPO, interleaved, machine  # noqa: E402
from harness.flags import SAMPLES_LIMIT, Parser, integer, writable_file  # noqa: E402


def configs(opts) -> list[tuple[str, int, list]]:
    """(name, ranks, flags) of every configuration."""
    b = opts.per_rank_batch
    fixed = [(f"fixed global batch {b}, {n} rank{'s' * (n > 1)}", n, ["--batch-size", b])
             for n in (1, 2)]
    weak = [(f"--batch-per-rank {b}, {n} ranks (global {n * b}), {scaling}", n,
             ["--batch-per-rank", b, *extra])
            for scaling, extra, worlds in [
                ("same --lr", [], (2, 4)),
                ("linear + warm-up", ["--lr-scaling", "linear"], (2, 4)),
                ("sqrt + warm-up", ["--lr-scaling", "sqrt"], (4,)),
                ("linear, no warm-up", ["--lr-scaling", "linear", "--warmup-steps", "0"], (4,))]
            for n in worlds]
    return fixed + weak


def run_once(ranks: int, flags: list, seed: int, opts, out_dir: Path) -> dict:
    """One run; its per-epoch train loss, test accuracy and learning rate."""
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", "03_ddp_wrapper.py", "--data", "synthetic",
           "--train-samples", opts.samples, "--test-samples", opts.test_samples,
           "--epochs", opts.epochs, "--no-dropout", "--quiet", "--device", "cpu",
           "--seed", seed, *flags, "--out-dir", out_dir]
    proc = subprocess.run([str(a) for a in cmd], cwd=REPO, text=True, capture_output=True,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-3000:]}")
    accuracy = [float(a) for a in re.findall(r"test accuracy ([\d.]+)%", proc.stdout)]
    summary = json.loads((out_dir / "summary.json").read_text())
    return {"loss": summary["train_losses"], "accuracy": accuracy, "lrs": summary["lrs"],
            "global_batch": summary["global_batch_size"]}


def cell(values: list[float], digits: int) -> str:
    med, lo, hi = statistics.median(values), min(values), max(values)
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def report(results: dict, opts) -> str:
    epochs = range(opts.epochs)
    lines = [f"Machine: {machine()}", "",
             f"Step 03, synthetic digits, {opts.samples} training samples per epoch, "
             f"{opts.test_samples} test samples, {opts.epochs} epochs, --lr 0.05 (SGD, momentum "
             f"0.9, x0.7 per epoch), dropout off, 1 thread per rank; {opts.repeats} seeds "
             f"(0-{opts.repeats - 1}), configurations interleaved; median (min-max) over the "
             f"seeds. Every column has seen the same samples: epoch e = e x {opts.samples}.", ""]
    for metric, title, digits in [("loss", "train loss (mean over the epoch)", 4),
                                  ("accuracy", "test accuracy % (after the epoch)", 1)]:
        lines += [f"**{title}**", "",
                  "| configuration | steps/epoch | lr per epoch | "
                  + " | ".join(f"epoch {e + 1}" for e in epochs) + " |",
                  "| --- | --- | --- | " + " | ".join("---" for _ in epochs) + " |"]
        for name, runs in results.items():
            steps = -(-opts.samples // runs[0]["global_batch"])
            lrs = ", ".join(f"{lr:.3g}" for lr in runs[0]["lrs"])
            lines.append(f"| {name} | {steps} | {lrs} | " + " | ".join(
                cell([run[metric][e] for run in runs], digits) for e in epochs) + " |")
        lines.append("")
    return "\n".join(lines)


def main():
    # One-line errors (harness/flags.py), checked before the first of many runs.
    parser = Parser(prog="bench/lr_scaling.py", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=integer(1, 1000, "--repeats"), default=3,
                        help="seeds 0 .. repeats-1")
    parser.add_argument("--samples", type=integer(1, SAMPLES_LIMIT, "--samples"), default=2048)
    parser.add_argument("--test-samples", type=integer(1, SAMPLES_LIMIT, "--test-samples"),
                        default=1000)
    parser.add_argument("--epochs", type=integer(1, 100, "--epochs"), default=3)
    parser.add_argument("--per-rank-batch", type=integer(1, 4096, "--per-rank-batch"),
                        default=32)
    parser.add_argument("--out", type=writable_file,
                        default=REPO / "bench" / "results-lr-scaling.md")
    opts = parser.parse_args()
    if opts.samples < 4 * opts.per_rank_batch:  # the largest configuration: 4 ranks x B
        parser.error(f"--samples {opts.samples} does not fill one step of 4 ranks: it must be "
                     f"at least 4 x --per-rank-batch = {4 * opts.per_rank_batch}")
    chosen = configs(opts)
    results = {name: [] for name, _, _ in chosen}
    with tempfile.TemporaryDirectory(prefix="ddp-bench-lr-") as work:
        for seed, (name, ranks, flags) in interleaved(chosen, opts.repeats):  # seed = repeat
            run = run_once(ranks, flags, seed, opts, Path(work) / "run")
            results[name].append(run)
            print(f"seed {seed}  {name:<70} loss {run['loss'][-1]:.4f}  "
                  f"accuracy {run['accuracy'][-1]:.1f}%", flush=True)
    table = report(results, opts)
    opts.out.write_text(table)
    print("\n" + table)


if __name__ == "__main__":
    main()
