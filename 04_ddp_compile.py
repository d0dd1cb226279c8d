"""Step 04: torch.compile on top of DDP.

`torch.compile` traces the model's Python into graphs and generates fused kernels (C++/OpenMP on
the CPU, Triton on the GPU): fewer trips through memory, less Python overhead per step. It
costs a one-off compile on the first step (seconds to a minute) and pays back over the run.

Which goes first, DDP or compile? We wrap with DDP, then compile the wrapped model. Dynamo then
sees DDP and its DDPOptimizer cuts the graph at DDP's bucket boundaries, so each bucket's
all-reduce still starts while the rest of the backward pass runs, exactly as in step 03.
(Compiling first and wrapping second also trains correctly, but the compiled backward hands DDP
all gradients at once at its end, so communication no longer overlaps computation.)
The checkpoint is still saved from `raw_model`: no `module.` and no `_orig_mod.` prefixes.

Run it:
    torchrun --standalone --nproc-per-node 2 04_ddp_compile.py           # compiled (default)
    torchrun --standalone --nproc-per-node 2 04_ddp_compile.py --no-compile

Look for: "first step" seconds (the compile) far above a normal step, then higher samples/s
than step 03. Compiled dropout draws different random masks than eager: losses differ from
step 03 slightly unless you pass --no-dropout.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from contextlib import nullcontext

from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, Subset

import common


def train_one_epoch(model, loader, optimizer, run, plan, meter, prof):
    """One pass over the training set; returns the mean training loss."""
    model.train()
    loss_sum = torch.zeros((), device=run.device)  # kept on the device: no host sync per step
    samples = 0
    for images, labels in loader:
        images = images.to(run.device, non_blocking=True)
        labels = labels.to(run.device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        micro_batches = list(zip(images.split(plan.micro_batch), labels.split(plan.micro_batch)))
        for i, (micro_images, micro_labels) in enumerate(micro_batches):
            # DDP all-reduces in every backward(); only the last micro-batch needs it.
            last = i == len(micro_batches) - 1
            with nullcontext() if last else model.no_sync():
                with run.autocast():
                    loss = F.cross_entropy(model(micro_images), micro_labels)
                # Each micro-batch adds its share of the batch mean, so the gradients summed
                # over the micro-batches equal those of the whole batch at once.
                (loss * len(micro_labels) / len(labels)).backward()
            loss_sum += loss.detach() * len(micro_labels)
        optimizer.step()
        samples += len(labels)
        meter.step(len(labels))
        prof.step()
    totals = torch.tensor([loss_sum.item(), samples], dtype=torch.float64, device=run.device)
    dist.all_reduce(totals)  # the mean over every rank's samples, not rank 0's alone
    return (totals[0] / totals[1]).item()


@torch.no_grad()
def evaluate(model, loader, run):
    """Loss and accuracy over the whole test set: each rank scores its shard, then the sums
    (loss, correct, count) are added up over all ranks."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=run.device)  # loss sum, correct, count
    for images, labels in loader:
        images = images.to(run.device, non_blocking=True)
        labels = labels.to(run.device, non_blocking=True)
        with run.autocast():
            logits = model(images)
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return {"loss": loss_sum / count, "accuracy": correct / count,
            "correct": int(correct), "samples": int(count)}


def main():
    parser = common.argument_parser(__doc__, __file__)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile the DDP model (default: on)")
    args = parser.parse_args()
    run = common.setup(args, distributed=True)
    plan = common.plan_batches(args.batch_size, run.world_size, args.max_device_batch)
    common.announce(run, args, plan, __file__)

    train_set, test_set = common.load_datasets(args, run, download=run.is_main)
    # Every rank shuffles with the same seed, then takes every world_size-th index from its
    # rank on: disjoint shares that together cover the set. When the set does not divide,
    # the sampler pads with repeats so all ranks run the same number of steps.
    train_sampler = DistributedSampler(train_set, num_replicas=run.world_size, rank=run.rank,
                                       shuffle=True, seed=args.seed)
    train_loader = common.make_loader(train_set, plan.per_rank, run, args,
                                      seed=args.seed + run.rank, sampler=train_sampler)
    # Evaluation must count every test sample exactly once, so no sampler padding here:
    # a strided shard per rank, of unequal sizes when the set does not divide.
    test_shard = Subset(test_set, range(run.rank, len(test_set), run.world_size))
    test_loader = common.make_loader(test_shard, 1000, run, args, seed=args.seed + run.rank)

    raw_model = common.build_model(args, seed=args.seed + run.rank).to(run.device)
    # DDP broadcasts rank 0's weights now and averages gradients in every backward().
    # device_ids: the one GPU this rank drives (None on the CPU).
    model = DDP(raw_model, device_ids=[run.device] if run.device.type == "cuda" else None)
    if args.compile:  # after DDP, so that all-reduce still overlaps backward (see the top)
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    start_epoch = 0
    if args.resume:
        start_epoch = common.resume(args.resume, run, raw_model, optimizer, scheduler,
                                    train_loader.generator)["epoch"]

    metrics, meter, test = common.Metrics(run, args.out_dir), common.Throughput(run), None
    with common.profiler(args, run) as prof:
        for epoch in range(start_epoch, args.epochs):
            train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            meter.start_epoch()
            train_loss = train_one_epoch(model, train_loader, optimizer, run, plan, meter, prof)
            samples_per_sec = meter.end_epoch()
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            test = evaluate(raw_model, test_loader, run)  # no DDP: eval shards differ in size
            metrics.epoch(epoch, train_loss, test, samples_per_sec, lr)

            rng_states = common.gather_rng_states(run, train_loader.generator)  # every rank's
            if run.is_main:  # all ranks hold the same weights: one writer is enough
                common.save_checkpoint(args.out_dir / "checkpoint.pt", raw_model, optimizer,
                                       scheduler, epoch + 1, rng_states)
            dist.barrier()  # no rank may read the checkpoint before it is complete
    if test is None:  # resumed a finished run: evaluate only
        test = evaluate(raw_model, test_loader, run)
    metrics.summary(__file__, args, plan, test, meter)


if __name__ == "__main__":
    common.run_main(main)
