"""What DataLoader workers cost for data already in memory (steps 00-05, 07-09).

    python bench/memory_loader.py            # 60,000 synthetic digits, batch 256, 3 epochs

Each configuration draws 3 epochs of batches (no model) through harness/data.py's make_loader,
timing each epoch from the loader's first request to its last batch, so worker start-up counts
where it happens; configurations interleaved, 5 repeats, median and range of samples/s. The
Digits dataset fetches a whole batch with one indexing op (__getitems__), so the main process
alone is far ahead of training; workers add a fork per epoch (unless persistent) and a
shared-memory hand-over per batch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import common  # noqa: E402
from harness import data  # noqa: E402
from common import synthetic_digits  # noqa: E402

CONFIGS = {"0 workers": (0, False), "2 workers, re-forked each epoch": (2, False),
           "2 persistent workers": (2, True)}


def epoch_rates(loader, epochs: int) -> list[float]:
    rates = []
    for _ in range(epochs):
        started, samples = time.perf_counter(), 0
        for _, labels in loader:
            samples += len(labels)
        rates.append(samples / (time.perf_counter() - started))
    return rates


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=60_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    run = common.Run(torch.device("cpu"))
    memory = data.Digits(*synthetic_digits(opts.samples, seed=1))
    rates = {name: [] for name in CONFIGS}
    for _ in range(opts.repeats):
        for name, (workers, persistent) in CONFIGS.items():
            extra = {"persistent_workers": True} if persistent else {}
            loader = data.make_loader(memory, opts.batch_size, run,
                                      SimpleNamespace(num_workers=workers), shuffle=True,
                                      **extra)
            rates[name] += epoch_rates(loader, opts.epochs)
            del loader
    print(f"torch {torch.__version__}, {opts.samples:,} samples, batch {opts.batch_size}, "
          f"{opts.epochs} epochs x {opts.repeats} repeats, samples/s per epoch:")
    for name, values in rates.items():
        print(f"  {name:<32} {statistics.median(values):>10,.0f} "
              f"({min(values):,.0f}-{max(values):,.0f})")


if __name__ == "__main__":
    main()
