"""The plainest DDP loop a user would write, as a yardstick for step 03's overhead.

    torchrun --standalone --nproc-per-node 2 bench/minimal_ddp.py --train-samples 3000 \
        --batch-size 128 --out-dir /tmp/minimal

The same CNN, the same in-memory digits and DataLoader, DDP, SGD with momentum, a step
learning-rate schedule, an evaluation over every rank's test shard and a torch.save by rank 0
after each epoch, and nothing else: no flag checks, no progress lines, no NaN check, no atomic
and fsynced checkpoint, no TensorBoard. `bench/run.py --rows minimal` runs it beside 03 and
reports 03's samples/s as a fraction of this loop's, measured the same way (steady state: each
epoch's first step, which pays one-off costs, is not timed). Not a lesson, and not tested.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's root

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, Subset  # noqa: E402

from harness.data import Digits  # noqa: E402
from harness.model import Net  # noqa: E402
from common import synthetic_digits  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-samples", type=int, default=3000)
    parser.add_argument("--test-samples", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=128)  # global
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--width", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    train = Digits(*synthetic_digits(args.train_samples, seed=1))  # what --data synthetic uses
    test = Digits(*synthetic_digits(args.test_samples, seed=2))
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size // world, sampler=sampler)
    test_loader = DataLoader(Subset(test, range(rank, len(test), world)), batch_size=1000)

    torch.manual_seed(0)
    model = DDP(Net(width=args.width).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)

    samples, seconds = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (images, labels) in enumerate(loader):
            if step == 1:  # steady state from here, as metrics.Progress times it
                if cuda:
                    torch.cuda.synchronize()
                started = time.perf_counter()
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            if step >= 1:
                samples += len(labels) * world
        if cuda:
            torch.cuda.synchronize()
        seconds += time.perf_counter() - started
        scheduler.step()
        model.eval()
        sums = torch.zeros(2, device=device)
        with torch.no_grad():
            for images, labels in test_loader:
                images, labels = images.to(device), labels.to(device)
                sums += torch.stack([(model.module(images).argmax(1) == labels).sum(),
                                     torch.tensor(len(labels), device=device)])
        dist.all_reduce(sums)
        if rank == 0:
            torch.save(model.module.state_dict(), args.out_dir / "checkpoint.pt")
        dist.barrier()

    if rank == 0:
        summary = {"samples_per_sec": samples / seconds, "world_size": world,
                   "test_accuracy": (sums[0] / sums[1]).item()}
        (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
