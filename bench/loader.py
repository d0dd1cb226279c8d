"""Loader throughput alone: step 06's HDF5 stream against the in-memory dataset of steps 00-05.

    python bench/loader.py                  # 60,000 synthetic digits, batch 256, workers 0 and 2

One epoch of batches is drawn from each loader (no model), configurations interleaved, five
repeats; the table gives the median and the min-max range of samples/s. Training reads far
fewer samples per second than either loader delivers, so this shows headroom, not speed-up.
"""

from __future__ import annotations

import runpy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import common  # noqa: E402
from harness import data, step06_digits_h5 as digits_h5  # noqa: E402
from harness.flags import SAMPLES_LIMIT, Parser, integer  # noqa: E402
from common import synthetic_digits  # noqa: E402

def epoch_rate(loader) -> float:
    started, samples = time.perf_counter(), 0
    for images, labels in loader:
        samples += len(labels)
    return samples / (time.perf_counter() - started)


def main():
    # One-line errors (harness/flags.py), checked before the data is drawn.
    parser = Parser(prog="bench/loader.py", description=__doc__)
    parser.add_argument("--samples", type=integer(1, SAMPLES_LIMIT, "--samples"), default=60_000)
    parser.add_argument("--batch-size", type=integer(1, SAMPLES_LIMIT, "--batch-size"),
                        default=256)
    parser.add_argument("--repeats", type=integer(1, 1000, "--repeats"), default=5)
    opts = parser.parse_args()
    if opts.batch_size > opts.samples:
        parser.error(f"--batch-size {opts.batch_size} is larger than --samples {opts.samples}: "
                     f"not one batch")

    step06 = SimpleNamespace(**runpy.run_path(str(REPO / "06_streaming_h5.py"), run_name="bench"))
    run = common.Run(torch.device("cpu"))  # one process on the CPU: what each rank loads
    memory = data.Digits(*synthetic_digits(opts.samples, seed=1))
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "digits.h5"
        digits_h5.write(path, memory, data.Digits(*synthetic_digits(100, seed=2)), chunk=1024,
                        compression=None)
        stream = step06.StreamingDigits(path, opts.samples, 1024, opts.batch_size, 0, 1, seed=0)
        loaders = {}
        for workers in (0, 2):
            args = SimpleNamespace(num_workers=workers)
            loaders[f"in memory, {workers} workers"] = data.make_loader(
                memory, opts.batch_size, run, args, shuffle=True)
            loaders[f"HDF5 stream, {workers} workers"] = data.make_loader(stream, None, run, args)
        rates = {name: [] for name in loaders}
        for repeat in range(opts.repeats):
            for name, loader in loaders.items():
                rates[name].append(epoch_rate(loader))
        print(f"| loader ({opts.samples} samples, batch {opts.batch_size}) | samples/s median "
              f"(min-max) |\n| --- | --- |")
        for name, values in rates.items():
            print(f"| {name} | {statistics.median(values):,.0f} "
                  f"({min(values):,.0f}-{max(values):,.0f}) |")

if __name__ == "__main__":
    main()
