"""Step 03b (side trip): ZeRO by hand: each rank keeps 1/N of 03's optimizer state. docs/zero.md

Gradients are reduce-scattered, each rank steps its slice, the slices are all-gathered (ZeRO-1).
--zero-stage 2 sends each bucket as backward makes it (02b's hooks): 1/N of the gradients too.

Run it:
    torchrun --standalone --nproc-per-node 2 03b_sharded_optimizer.py
    torchrun --standalone --nproc-per-node 3 03b_sharded_optimizer.py --zero-stage 2

Look for: the losses of step 03 for the same seed, and "optimizer state per rank": 1/N of 03's
(--zero torch: torch's ZeroRedundancyOptimizer, which gives each rank whole parameters).

Read also: common.py, what every step shares (the flags, the digits, the CNN, Progress, Metrics).
"""

# The repository's checks and one-line errors (harness/__init__.py); a copied step runs without.
try: import harness  # noqa: E701, F401
except ModuleNotFoundError: pass  # noqa: E701
import datetime
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, Subset

import common

# torch 2.14.1 names these two *_single and warns at the old names; 2.8.0 has only the old ones.
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


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


class ShardedSGD(torch.optim.SGD):
    """03's SGD with momentum, but each rank keeps and steps only its slice of each bucket."""

    def __init__(self, model, run, lr, stage, bucket_cap_mb=None):
        self.params, self.world, self.rank = list(model.parameters()), run.world_size, run.rank
        # ZeRO-2: 02b's buckets, fixed once: last layer first (as backward produces them), each
        # closed once it holds its cap (as DDP: 1 MiB the first, 25 the rest). ZeRO-1: one bucket.
        cap, self.buckets = (bucket_cap_mb or 1) * 2**20 if stage == 2 else float("inf"), [[]]
        for k in reversed(range(len(self.params))):
            if sum(self.params[j].nbytes for j in self.buckets[-1]) >= cap:
                self.buckets.append([])
                cap = (bucket_cap_mb or 25) * 2**20
            self.buckets[-1].append(k)  # (autograd calls the hook once k's .grad holds its sum)
            self.params[k].register_post_accumulate_grad_hook(
                lambda _, i=len(self.buckets) - 1: self.gradient_ready(i))
        super().__init__([self.slices(i, self.params)[self.rank].clone()  # copies of its slices
                          for i in range(len(self.buckets))], lr=lr, momentum=0.9)
        self.shards, self.ready, self.in_flight = self.param_groups[0]["params"], {}, []

    def slices(self, i, tensors):  # bucket i's tensors in a row, padded: row r is rank r's slice
        flat = torch.cat([tensors[k].detach().flatten() for k in self.buckets[i]])
        return F.pad(flat, (0, -len(flat) % self.world)).view(self.world, -1)

    def gradient_ready(self, i):
        """The bucket's last gradient (ZeRO-1: at the end of backward) sends it, times 1/N as DDP
        does (reducer.cpp), summed over the ranks: each rank gets only its slice of the mean."""
        self.ready[i] = self.ready.get(i, 0) + self.sync  # (train_one_epoch sets sync)
        if self.ready[i] == len(self.buckets[i]):
            flat = self.slices(i, [p.grad for p in self.params]).mul_(1 / self.world)
            mean = flat.new_empty(flat.shape[1])
            self.in_flight.append((reduce_scatter(mean, flat.flatten(), async_op=True), i, mean))
            for k in self.buckets[i]:
                self.params[k].grad = None  # whole gradients, dropped (ZeRO-2: bucket by bucket)

    def gather(self, i, shard) -> dict:  # every rank's slice of bucket i: whole tensors, by index
        whole = shard.new_empty(len(shard) * self.world)
        all_gather(whole, shard)
        numels = [self.params[k].numel() for k in self.buckets[i]]
        return {k: part.view_as(self.params[k]) for k, part in zip(
            self.buckets[i], whole[:sum(numels)].split(numels))}

    @torch.no_grad()
    def step(self):
        for work, i, mean in self.in_flight:  # sent during backward
            work.wait()
            self.shards[i].grad = mean
        self.ready, self.in_flight = {}, []
        super().step()  # 03's update, sliced: momentum works element by element
        # NCCL's reduce-scatter and this all-gather send the bytes of one all-reduce, which is a
        # reduce-scatter then an all-gather (01's ring). gloo's reduce-scatter all-reduces: more.
        for i, shard in enumerate(self.shards):
            for k, new in self.gather(i, shard).items():
                self.params[k].copy_(new)

    def consolidate_state_dict(self, to=0):
        """03's format (a whole momentum per parameter), gathered (a collective, as torch's): any
        world size resumes it. 09's DCP saves each rank's slices instead, resharded on load."""
        state = {k: {"momentum_buffer": m} for i, shard in enumerate(self.shards)
                 for k, m in self.gather(i, self.state[shard]["momentum_buffer"]).items()}
        group = {**super().state_dict()["param_groups"][0], "params": [*range(len(self.params))]}
        self.consolidated = {"state": state, "param_groups": [group]} if self.rank == to else None

    def state_dict(self):
        return self.consolidated

    def load_state_dict(self, state_dict):  # this rank's slices: of the weights just loaded, too
        saved = {k: state["momentum_buffer"] for k, state in state_dict["state"].items()}
        self.param_groups[0].update({**state_dict["param_groups"][0], "params": self.shards})
        for i, shard in enumerate(self.shards):
            shard.copy_(self.slices(i, self.params)[self.rank])
            self.state[shard] = {"momentum_buffer": self.slices(i, saved)[self.rank].clone()}


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
        for i, (micro_images, micro_labels) in enumerate(micro_batches):
            last = optimizer.sync = i == len(micro_batches) - 1  # (by hand: as 02b's hooks)
            # DDP all-reduces in every backward(); only the last micro-batch needs it.
            with model.no_sync() if not last and isinstance(model, DDP) else nullcontext():
                with run.autocast():
                    loss = F.cross_entropy(model(micro_images), micro_labels)
                (loss * len(micro_labels) / len(labels)).backward()
            loss_sum += loss.detach() * len(micro_labels)
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


def describe_buckets(model) -> str:
    """DDP's gradient buckets, each one all-reduce. After its first steps DDP rebuilds them in
    the order gradients became ready in backward (last layer first); a bucket closes once it
    holds more than its cap: 1 MiB for the first, so communication starts early, 25 MiB for
    the rest (--bucket-cap-mb sets both). _get_ddp_logging_data: DDP's own report, which
    holds the rebuilt buckets only after a few steps (docs/steps.md)."""
    info = model._get_ddp_logging_data() if hasattr(model, "_get_ddp_logging_data") else {}
    if "rebuilt_bucket_sizes" not in info:  # too few steps yet, or a torch without the report
        return "DDP's gradient buckets: not reported yet (DDP reports them after a few steps)"
    names = [name for name, _ in model.module.named_parameters()]
    buckets = zip(info["rebuilt_bucket_sizes"].split(", "),
                  info["rebuilt_per_bucket_param_indices"].split(", "))
    return "DDP's gradient buckets, in the order they are all-reduced:\n" + "\n".join(
        f"  bucket {i}: {int(size) / 2**20:.3f} MiB: "
        f"{', '.join(names[int(p)] for p in indices.split())}"
        for i, (size, indices) in enumerate(buckets))


@common.record  # torch's elastic @record: torchrun's failure summary names the error
def main():
    parser = common.parser(__doc__, __file__)
    parser.add_argument("--bucket-cap-mb", type=float,
                        metavar="MB", help="DDP's bucket size (default: 1 MiB for the first "
                        "bucket, 25 MiB for the others; a value sets all of them)")
    parser.add_argument("--zero-stage", type=int, choices=[1, 2], default=1,
                        help="1: shard the optimizer state; 2: the gradients too")
    parser.add_argument("--zero", choices=["hand", "torch"], default="hand",
                        help="torch: 03's DDP and torch's ZeroRedundancyOptimizer (ZeRO-1)")
    args = parser.parse_args()  # every flag is checked here
    if args.zero == "torch" and args.zero_stage == 2:
        parser.error("--zero torch is ZeRO-1; torch shards gradients in FSDP (step 08)")
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

    raw_model = common.build_model(args, seed=args.seed + run.rank).to(run.device)
    # DDP broadcasts rank 0's weights now and averages gradients in every backward().
    # device_ids: the one GPU this rank drives (None on the CPU).
    model = DDP(raw_model, device_ids=[run.device] if run.device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb) if args.zero == "torch" else raw_model
    for tensor in [] if args.zero == "torch" else raw_model.state_dict().values():
        dist.broadcast(tensor, src=0)  # by hand, without DDP: rank 0's weights to all (as 02)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=args.lr,
                                        momentum=0.9) if args.zero == "torch" else ShardedSGD(
        raw_model, run, args.lr, args.zero_stage, args.bucket_cap_mb)
    scheduler = common.lr_schedule(optimizer, args, plan, len(train_loader))
    start_epoch = 0
    if args.resume:
        start_epoch = common.restore_checkpoint(args.resume, run, raw_model, optimizer,
                                         scheduler)["epoch"]

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
            # The raw model, not DDP: evaluating needs nothing DDP adds, and DDP's first forward
            # after training broadcasts rank 0's buffers (BatchNorm's; this CNN has none), which
            # a rank without a test batch would never join (_pre_forward, torch 2.8-2.14.1).
            test = evaluate(raw_model, test_loader, run)
            results.epoch(epoch, train_loss, test, samples_per_sec, lr)
            if epoch == start_epoch and args.zero == "torch":
                common.log(run, describe_buckets(model))
            optimizer.consolidate_state_dict(to=0)  # every rank's part, to rank 0 (a collective)
            if run.is_main:  # all ranks hold the same weights: one writer is enough
                common.save_checkpoint(args.out_dir / "checkpoint.pt", raw_model, optimizer,
                                scheduler, epoch + 1)
            dist.barrier()  # no rank may read the checkpoint before it is complete
    if test is None:  # resumed a finished run: evaluate only
        test = evaluate(raw_model, test_loader, run)
    state = getattr(optimizer, "optim", optimizer).state.values()  # (torch's: its .optim's)
    held = sum(t.nbytes for s in state for t in s.values())  # rank 0's: torch's, the largest layer
    whole = sum(p.nbytes for p in raw_model.parameters())  # 03's momentum, on every rank
    common.log(run, f"optimizer state per rank: {held / 2**20:.2f} MiB of {whole / 2**20:.2f} MiB")
    results.summary(__file__, args, plan, test, progress, optimizer_state_bytes=held,
                    optimizer_state_bytes_unsharded=whole, zero_stage=args.zero_stage)
    del model  # DDP holds the process group: release it before the group is destroyed
    dist.destroy_process_group()


if __name__ == "__main__":
    common.run_main(main)
