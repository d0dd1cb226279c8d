"""Step 02b: step 02's all-reduce, in buckets, while backward() still runs: DDP's overlap by hand.

Autograd calls a hook on each parameter as soon as its gradient is ready, last layer first. The
hook adds it to a bucket; a full bucket (--bucket-cap-mb) is all-reduced with async_op=True, and
optimizer.step() waits for them all. Why buckets, and what 03's DDP adds: docs/inside-ddp.md.

Run it:
    torchrun --standalone --nproc-per-node 2 02b_overlap_by_hand.py
    torchrun --standalone --nproc-per-node 2 02b_overlap_by_hand.py --bucket-cap-mb 0.05 --profile

Look for: the losses of step 02 for the same seed (on 2 ranks, equal weights bit for bit). With
--profile, `python bench/timeline.py runs/02b_overlap_by_hand` draws the all-reduce in backward.

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


class OverlappingAllReduce:
    """Hooks that all-reduce the gradients in buckets, in the order backward() produces them."""

    def __init__(self, model, world_size, bucket_cap_mb=None):
        if bucket_cap_mb is None:  # as DDP: a small first bucket, so communication starts early
            self.first_cap, self.cap = 2**20, 25 * 2**20
        else:  # --bucket-cap-mb sets both
            self.first_cap = self.cap = int(bucket_cap_mb * 2**20)
        self.world_size = world_size
        self.sync = True  # False: this backward() only accumulates (an early micro-batch)
        self.bucket = []  # parameters whose gradients are ready, not yet sent
        self.in_flight = []  # (work, flat gradients, their parameters), one per bucket sent
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(self.gradient_ready)

    def gradient_ready(self, param):
        """Called by autograd inside backward(), as soon as param.grad holds its sum."""
        if not self.sync:
            return
        self.bucket.append(param)
        cap = self.cap if self.in_flight else self.first_cap
        if sum(p.grad.nbytes for p in self.bucket) >= cap:
            self.send_bucket()

    def send_bucket(self):
        # Every rank runs the same backward in the same order, so every rank sends the same
        # buckets in the same order: the k-th all-reduce adds up the same gradients everywhere.
        flat = torch.cat([p.grad.flatten() for p in self.bucket])  # one message, not many
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)  # returns at once
        self.in_flight.append((work, flat, self.bucket))
        self.bucket = []

    def finish(self):
        """After backward(): send the last bucket, wait for all, copy the sums back, divide."""
        if self.bucket:  # the gradients that came last, too few to fill a bucket
            self.send_bucket()
        for work, flat, params in self.in_flight:
            work.wait()  # this bucket's sum has arrived
            flat /= self.world_size
            for param, mean in zip(params, flat.split([p.numel() for p in params])):
                param.grad.copy_(mean.view_as(param))
        self.in_flight = []


def train_one_epoch(model, all_reduce, loader, optimizer, scheduler, run, plan, progress):
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
        for i, (micro_images, micro_labels) in enumerate(micro_batches):
            all_reduce.sync = i == len(micro_batches) - 1  # only the last micro-batch syncs
            with run.autocast():
                loss = F.cross_entropy(model(micro_images), micro_labels)
            (loss * len(micro_labels) / len(labels)).backward()
            loss_sum += loss.detach() * len(micro_labels)
        all_reduce.finish()  # every bucket summed and averaged before the step
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
    parser = common.parser(__doc__, __file__)
    parser.add_argument("--bucket-cap-mb", type=float,
                        metavar="MB", help="bucket size (default: 1 MiB for the first "
                        "bucket, 25 MiB for the others, as DDP; a value sets all of them)")
    args = parser.parse_args()  # every flag is checked here
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
    all_reduce = OverlappingAllReduce(model, run.world_size, args.bucket_cap_mb)
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
            train_loss = train_one_epoch(model, all_reduce, train_loader, optimizer, scheduler,
                                         run, plan, progress)
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
