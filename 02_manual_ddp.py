"""Step 02: data parallelism by hand. Step 00 plus what DDP does for you, written out.

N processes (ranks) each hold a full copy of the model and train on their own share of every
batch, dealt by a DistributedSampler. They stay identical because rank 0's weights are broadcast
at the start (each rank builds its model from another seed here, so the broadcast visibly
matters) and, after backward(), every gradient is all-reduced and divided by N. Training losses
and test counts are summed over all ranks; rank 0 alone prints and saves.

Run it:
    torchrun --standalone --nproc-per-node 2 02_manual_ddp.py   # 2 CPU processes, or 2 GPUs

Look for: "world_size=2 batch=256 (= 2 ranks x 128 ...)" in the first line (--batch-size is the
GLOBAL batch), then about the accuracy of step 00.

Read also: common.py, what every step shares (the flags, the digits, the CNN, Progress, Metrics).
"""

# The repository's checks and one-line errors (harness/__init__.py); a copied step runs without.
try: import harness  # noqa: E701, F401
except ModuleNotFoundError: pass  # noqa: E701
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, Subset

import common


def setup(args):
    """Join the process group: every rank calls this, and it returns once all have."""
    # torchrun starts one copy of this script per process and tells each who it is.
    # Plain `python` sets nothing: a world of one, which meets itself on this machine.
    rank = int(os.environ.get("RANK", 0))  # 0 .. world_size-1
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # which process on this machine
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # processes on this machine
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # where the group's store is hosted
    os.environ.setdefault("MASTER_PORT", "0")  # (0: any free port; plain python only)
    device = common.choose_device(args.device, local_rank, local_ranks)  # cuda:<local_rank>/CPU
    common.set_deterministic(args.deterministic)  # GPUs too: the same seed, the same bits
    backend = "nccl" if device.type == "cuda" else "gloo"  # NCCL between GPUs, gloo on CPUs
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this rank's GPU, before NCCL starts on it
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)
    return common.Run(device, rank, local_rank, world_size, amp=args.amp, backend=backend)


def average_gradients(model, world_size):
    """Sum every rank's gradients, then divide: all ranks end with the same mean gradient."""
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad /= world_size


def train_one_epoch(model, loader, optimizer, scheduler, run, plan, progress):
    """One pass over the training set; returns the mean training loss."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)  # on the device: no sync
    samples = 0
    for images, labels in loader:
        images = images.to(run.device, non_blocking=True)
        labels = labels.to(run.device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        # A batch larger than --max-device-batch runs as several micro-batches. Each adds
        # its share of the batch mean, so the gradients summed over the micro-batches equal
        # those of the whole batch at once.
        micro_batches = list(zip(images.split(plan.micro_batch), labels.split(plan.micro_batch)))
        for micro_images, micro_labels in micro_batches:
            with run.autocast():
                loss = F.cross_entropy(model(micro_images), micro_labels)
            (loss * len(micro_labels) / len(labels)).backward()
            loss_sum += loss.detach() * len(micro_labels)
        average_gradients(model, run.world_size)  # once per step, after all micro-batches
        optimizer.step()
        scheduler.step()  # the next step's learning rate (common.lr_schedule)
        samples += len(labels)
        progress.step(loss_sum, len(labels), samples)
    totals = torch.tensor([loss_sum.item(), samples], dtype=torch.float64, device=run.device)
    dist.all_reduce(totals)  # the mean over every rank's samples, not rank 0's alone
    return (totals[0] / totals[1]).item()


def evaluate(model, loader, run):
    """Loss and accuracy over the whole test set: each rank sums over its shard (loss,
    correct answers, samples), then the sums are added up over all ranks."""
    sums = common.test_sums(model, loader, run)
    dist.all_reduce(sums)
    return common.test_results(sums)


@common.record  # torch's elastic @record: torchrun's failure summary names the error
def main():
    args = common.parser(__doc__, __file__).parse_args()  # every flag is checked here
    run = setup(args)
    train_set, test_set = common.load_datasets(args, run, download=run.is_main)
    plan = common.plan_batches(args, run.world_size, len(train_set))
    common.announce(run, args, plan, __file__)
    # Every rank shuffles with the same seed, then takes every world_size-th index from its
    # rank on: disjoint shares that together cover the set. When the set does not divide,
    # the sampler pads with repeats so all ranks run the same number of steps.
    train_sampler = DistributedSampler(train_set, num_replicas=run.world_size, rank=run.rank,
                                       shuffle=True, seed=args.seed)
    train_loader = common.make_loader(train_set, plan.per_rank, run, args, sampler=train_sampler)
    # Evaluation must count every test sample exactly once, so no sampler padding here:
    # a strided shard per rank, of unequal sizes when the set does not divide.
    test_shard = Subset(test_set, range(run.rank, len(test_set), run.world_size))
    test_loader = common.make_loader(test_shard, 1000, run, args)

    model = common.build_model(args, seed=args.seed + run.rank).to(run.device)  # differs per rank
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)  # ... until rank 0's weights are copied to every rank
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = common.lr_schedule(optimizer, args, plan, len(train_loader))
    start_epoch = 0
    if args.resume:
        start_epoch = common.restore_checkpoint(args.resume, run, model, optimizer, scheduler)["epoch"]

    results, test = common.Metrics(run, args), None
    with common.Progress(run, args, steps_per_epoch=len(train_loader)) as progress:
        for epoch in range(start_epoch, args.epochs):
            # Shuffling and dropout draw from these numbers alone, so a run resumed at this
            # epoch draws exactly what an uninterrupted run drew.
            common.seed_everything(args.seed, epoch, run.rank)  # rank: its own dropout masks
            train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            progress.start_epoch(epoch)
            train_loss = train_one_epoch(model, train_loader, optimizer, scheduler, run, plan,
                                         progress)
            samples_per_sec = progress.end_epoch()
            lr = scheduler.last_step_lr()  # the rate the epoch ended with
            test = evaluate(model, test_loader, run)
            results.epoch(epoch, train_loss, test, samples_per_sec, lr)
            if run.is_main:  # all ranks hold the same weights: one writer is enough
                common.save_checkpoint(args.out_dir / "checkpoint.pt", model, optimizer, scheduler,
                                epoch + 1)
            dist.barrier()  # no rank may read the checkpoint before it is complete
    if test is None:  # resumed a finished run: evaluate only
        test = evaluate(model, test_loader, run)
    results.summary(__file__, args, plan, test, progress)
    dist.destroy_process_group()


if __name__ == "__main__":
    common.run_main(main)
