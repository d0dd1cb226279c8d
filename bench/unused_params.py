"""What DDP's find_unused_parameters=True costs per step, against False and static_graph=True.

    torchrun --standalone --nproc-per-node 2 bench/unused_params.py            # ~1 min on 2 cores
    torchrun --standalone --nproc-per-node 2 bench/unused_params.py --rounds 300 --out FILE

With find_unused_parameters=True, DDP walks the autograd graph from the forward's outputs after
every forward, to mark unreachable parameters ready (11_your_model.py, --bug unused). Here every
parameter is used, so False (DDP's default), True (the walk) and static_graph=True (the used set
recorded once) compute the same and only the bookkeeping differs. Two models: the tutorial's CNN
(8 parameter tensors) and a deep narrow MLP (128 tensors, little compute each), on random data,
three copies taking turns in a rotating order every round; the forward is also timed in CPU
seconds of its thread (where the walk runs), which other processes' load barely changes.
A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's root

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from harness.model import Net  # noqa: E402

SETTINGS = {"find_unused_parameters=False": {},
            "find_unused_parameters=True": {"find_unused_parameters": True},
            "static_graph=True": {"static_graph": True}}


def deep_mlp() -> nn.Module:
    layers = [nn.Flatten(), nn.Linear(28 * 28, 64), nn.ReLU()]
    for _ in range(62):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(64, 10))


def timed_step(model, optimizer, images, labels) -> tuple[float, float]:
    """Seconds for one training step (wall clock), and the CPU seconds this thread spent in its
    forward, at whose end DDP walks the graph (CPU time: what other processes do on a shared
    machine does not count, as long as this thread is not running)."""
    optimizer.zero_grad(set_to_none=True)
    start, cpu = time.perf_counter(), time.thread_time()
    loss = F.cross_entropy(model(images), labels)
    forward = time.thread_time() - cpu
    loss.backward()  # DDP's all-reduce: the ranks leave every step together
    optimizer.step()
    return time.perf_counter() - start, forward


def quartiles(values: list[float]) -> str:
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return f"{q2:+.3f} ({q1:+.3f} to {q3:+.3f})"


def measure(name: str, build, opts) -> list[str]:
    torch.manual_seed(0)
    base = build()
    wrapped = {}
    for setting, kwargs in SETTINGS.items():
        model = DDP(build(), **kwargs)
        model.module.load_state_dict(base.state_dict())
        wrapped[setting] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    generator = torch.Generator().manual_seed(dist.get_rank())
    images = torch.randn(opts.batch, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (opts.batch,), generator=generator)
    for model, optimizer in wrapped.values():  # warm-up: bucket rebuilding, static graph's record
        for _ in range(opts.warmup):
            timed_step(model, optimizer, images, labels)
    times = {setting: [] for setting in SETTINGS}  # (step, forward) per round, in ms
    order = list(SETTINGS)
    for round_ in range(opts.rounds):
        shift = round_ % len(order)
        for setting in order[shift:] + order[:shift]:
            step, forward = timed_step(*wrapped[setting], images, labels)
            times[setting].append((1000 * step, 1000 * forward))
    tensors = sum(1 for _ in base.parameters())
    rows = []
    for setting, measured in times.items():
        steps, forwards = zip(*measured)
        paired = ["", ""]
        if setting != "find_unused_parameters=False":
            baseline = times["find_unused_parameters=False"]
            paired = [quartiles([m[i] - b[i] for m, b in zip(measured, baseline)])
                      for i in (0, 1)]
        rows.append(f"| {name} ({tensors} parameter tensors) | {setting} | "
                    f"{statistics.median(steps):.2f} | {statistics.median(forwards):.3f} | "
                    f"{paired[0]} | {paired[1]} |")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=150,
                        help="rounds of one timed step per setting")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    opts = parser.parse_args()
    dist.init_process_group("gloo")
    rows = measure("MNIST CNN", Net, opts) + measure("deep MLP", deep_mlp, opts)
    if dist.get_rank() == 0:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), "unknown CPU")
        table = "\n".join([
            f"Machine: {cpu}, {os.cpu_count()} cores; torch {torch.__version__}; gloo, "
            f"{dist.get_world_size()} ranks x {torch.get_num_threads()} thread(s); "
            f"{datetime.date.today()}", "",
            f"{opts.rounds} rounds, each one step of every setting (the order rotating); "
            f"{opts.batch} samples per rank per step; rank 0's wall ms per step and CPU ms per "
            f"forward, median over the rounds; "
            f"against find_unused_parameters=False: the difference within each round, "
            f"median (quartiles).", "",
            "| model | DDP setting | ms per step | CPU ms per forward | step vs False, ms | "
            "forward vs False, CPU ms |", "| --- | --- | --- | --- | --- | --- |",
            *rows]) + "\n"
        print(table)
        if opts.out:
            opts.out.write_text(table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
