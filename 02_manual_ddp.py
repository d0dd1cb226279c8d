"""Step 02: data parallelism by hand. Step 00 plus what DDP does for you, written out.

N processes (ranks) each hold a full copy of the model and train on a different 1/N of every
batch. They stay identical because:
  1. the weights start equal: rank 0's are broadcast to all (each rank builds its model from
     a different seed here on purpose, so you can see the broadcast matter);
  2. after backward(), the gradients are all-reduced and divided by N, so every rank applies
     the same averaged gradient: the one a single process would get for the whole batch.
A DistributedSampler hands each rank a disjoint share of the training set, reshuffled per
epoch; evaluation splits the test set the same way and sums the counts over all ranks.

Run it:
    torchrun --standalone --nproc-per-node 2 02_manual_ddp.py           # 2 CPU processes or GPUs
    CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc-per-node 2 02_manual_ddp.py

Look for: the same accuracy as step 00 for the same --batch-size (it is the GLOBAL batch), and
"world_size=2 batch=256 (= 2 ranks x 128 ...)" in the first line.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, Subset

import common


def average_gradients(model, world_size):
    """Sum every rank's gradients, then divide: all ranks end with the same mean gradient."""
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad /= world_size


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
        for micro_images, micro_labels in micro_batches:
            with run.autocast():
                loss = F.cross_entropy(model(micro_images), micro_labels)
            # Each micro-batch adds its share of the batch mean, so the gradients summed over
            # the micro-batches equal those of the whole batch at once.
            (loss * len(micro_labels) / len(labels)).backward()
            loss_sum += loss.detach() * len(micro_labels)
        average_gradients(model, run.world_size)  # once per step, after all micro-batches
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
    args = common.argument_parser(__doc__, __file__).parse_args()
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

    model = common.build_model(args, seed=args.seed + run.rank).to(run.device)  # differs per rank
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)  # ... until rank 0's weights are copied to every rank
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    start_epoch = 0
    if args.resume:
        start_epoch = common.resume(args.resume, run, model, optimizer, scheduler,
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
            test = evaluate(model, test_loader, run)
            metrics.epoch(epoch, train_loss, test, samples_per_sec, lr)

            rng_states = common.gather_rng_states(run, train_loader.generator)  # every rank's
            if run.is_main:  # all ranks hold the same weights: one writer is enough
                common.save_checkpoint(args.out_dir / "checkpoint.pt", model, optimizer,
                                       scheduler, epoch + 1, rng_states)
            dist.barrier()  # no rank may read the checkpoint before it is complete
    if test is None:  # resumed a finished run: evaluate only
        test = evaluate(model, test_loader, run)
    metrics.summary(__file__, args, plan, test, meter)


if __name__ == "__main__":
    common.run_main(main)
