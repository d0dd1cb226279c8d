"""Step 06: stream the training set from an HDF5 file instead of holding it in memory.

A side trip from 05. Each rank's DataLoader workers stream its share of one chunked HDF5 file,
a few chunks at a time: open it in each worker, read whole chunks, shuffle twice (docs/steps.md).

Run it:
    python 06_streaming_h5.py prepare --data mnist               # only write data/mnist.h5
    torchrun --standalone --nproc-per-node 2 06_streaming_h5.py  # prepares the file if missing

Look for: "<file>: N training samples (streamed, in chunks of C)", then step 05's accuracy.

Read also: common.py (write_h5, open_h5: the file, written once, checked when opened).
"""

# The repository's checks and one-line errors (harness/__init__.py); a copied step runs without.
try: import harness  # noqa: E701, F401
except ModuleNotFoundError: pass  # noqa: E701
import argparse
import os
from contextlib import nullcontext
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import IterableDataset, Subset, get_worker_info

import common


def use_srun_identity():
    """Started by `srun python` (one task per GPU, no torchrun): who is who, from SLURM's
    variables. The group meets at the step's first node, at a port derived from the job id."""
    env = os.environ
    if "RANK" in env or int(env.get("SLURM_STEP_NUM_TASKS", 1)) < 2:
        return  # started by torchrun, or by plain python
    env.update(RANK=env["SLURM_PROCID"], LOCAL_RANK=env["SLURM_LOCALID"],
               WORLD_SIZE=env["SLURM_STEP_NUM_TASKS"], GROUP_RANK=env["SLURM_NODEID"],
               LOCAL_WORLD_SIZE=str(common.slurm_tasks_on_this_node()))
    env.setdefault("MASTER_ADDR", common.slurm_head_address(env["SLURM_STEP_NODELIST"]))
    env.setdefault("MASTER_PORT", str(15000 + int(env["SLURM_JOB_ID"]) % 15000))


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
            # DDP all-reduces in every backward(); only the last micro-batch needs it.
            with model.no_sync() if i < len(micro_batches) - 1 else nullcontext():
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


def report_topology(run):
    """Rank 0 prints where every rank runs, and the inherited variables that steer how the group
    connects (often left over in a shell, different per node). Returns the node count."""
    node_rank = int(os.environ.get("GROUP_RANK", 0))  # torchrun's name for the node rank
    steering = " ".join(f"{name}={value}" for name, value in sorted(os.environ.items())
                        if name == "NODE_RANK" or name.startswith("NCCL_")
                        or name.endswith("_SOCKET_IFNAME"))
    me = (node_rank, run.hostname, run.rank, run.local_rank, str(run.device), steering)
    everyone = [None] * run.world_size
    dist.all_gather_object(everyone, me)  # a collective: every rank must call it
    for node, host, rank, local_rank, device, steering in everyone:
        common.log(run, f"[node {node} {host}] rank {rank}/{run.world_size} "
                        f"local rank {local_rank} on {device}"
                        + (f" ({steering})" if steering else ""))
    return len({node for node, *_ in everyone})


def describe_buckets(model) -> str:
    """DDP's gradient buckets, each one all-reduce. After its first steps DDP rebuilds them in
    the order gradients became ready in backward (last layer first); a bucket closes once it
    holds more than its cap: 1 MiB for the first, so communication starts early, 25 MiB for
    the rest (--bucket-cap-mb sets both). _get_ddp_logging_data: DDP's own report, which
    holds the rebuilt buckets only after a few steps (docs/steps.md)."""
    info = model._get_ddp_logging_data() if hasattr(model, "_get_ddp_logging_data") else {}
    if "rebuilt_bucket_sizes" not in info:  # too few steps yet, or a torch without the report
        return "DDP's gradient buckets: not reported yet (DDP reports them after a few steps)"
    # A compiled module names its parameters _orig_mod.<name>: the names of the model itself.
    names = [name.removeprefix("_orig_mod.") for name, _ in model.module.named_parameters()]
    buckets = zip(info["rebuilt_bucket_sizes"].split(", "),
                  info["rebuilt_per_bucket_param_indices"].split(", "))
    return "DDP's gradient buckets, in the order they are all-reduced:\n" + "\n".join(
        f"  bucket {i}: {int(size) / 2**20:.3f} MiB: "
        f"{', '.join(names[int(p)] for p in indices.split())}"
        for i, (size, indices) in enumerate(buckets))


class StreamingDigits(IterableDataset):
    """The training set, read from the HDF5 file a few chunks at a time, yielded as batches."""
    buffer_chunks = 4  # chunks each worker holds in memory and shuffles together

    def __init__(self, path, count, chunk, batch_size, rank, world_size, seed):
        self.path, self.count, self.chunk, self.batch_size = path, count, chunk, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        # Every rank must run the same number of steps, or the all-reduce waits forever: drop
        # the remainder (< world_size x batch samples), another one each epoch as chunks move.
        self.steps = count // (world_size * batch_size)
        if self.steps == 0:
            raise common.UserError(f"{count} training samples do not fill one global batch of "
                                   f"{world_size * batch_size}")
        # In shared memory: set_epoch() reaches each worker's copy, even a persistent worker's.
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch):
        self.epoch.fill_(epoch)

    def __len__(self):
        return self.steps  # batches per epoch on this rank

    def __iter__(self):
        epoch = int(self.epoch)
        # 1. The chunks in a new order each epoch, the same on every rank: one stream of samples.
        starts = np.arange(0, self.count, self.chunk)
        starts = np.random.default_rng([self.seed, epoch]).permutation(starts)
        # 2. Rank r takes batches r*steps .. (r+1)*steps-1 of that stream, split over its workers.
        worker = get_worker_info()  # None without worker processes: this process reads it all
        worker_id, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        first = self.rank * self.steps + worker_id * self.steps // workers
        last = self.rank * self.steps + (worker_id + 1) * self.steps // workers
        ends = np.minimum(starts + self.chunk, self.count)
        at = np.cumsum(ends - starts) - (ends - starts)  # where each chunk begins in the stream
        a = np.maximum(starts, starts + first * self.batch_size - at).tolist()
        b = np.minimum(ends, starts + last * self.batch_size - at).tolist()
        mine = [(x, y) for x, y in zip(a, b) if x < y]  # row ranges: whole chunks but at the ends
        # 3. Read a few chunks, shuffle what is buffered, yield whole batches, keep the rest.
        rng = np.random.default_rng([self.seed, epoch, first])
        images, labels = np.empty((0, 28, 28), np.uint8), np.empty(0, np.int64)
        with h5py.File(self.path, "r") as f:  # opened here, in the worker, after the fork
            for i in range(0, len(mine), self.buffer_chunks):
                new_images, new_labels = self.read(f, mine[i:i + self.buffer_chunks])
                images = np.concatenate([images, new_images])
                labels = np.concatenate([labels, new_labels])
                shuffled = rng.permutation(len(labels))
                ready = len(labels) // self.batch_size * self.batch_size
                for k in range(0, ready, self.batch_size):
                    batch = shuffled[k:k + self.batch_size]
                    pixels = torch.from_numpy(images[batch]).float() / 255
                    yield (((pixels - common.MNIST_MEAN) / common.MNIST_STD).unsqueeze(1),
                           torch.from_numpy(labels[batch]))
                images, labels = images[shuffled[ready:]], labels[shuffled[ready:]]

    def read(self, f, ranges):  # one sequential read per range; a damaged chunk: OSError
        images = np.concatenate([f["train/images"][a:b] for a, b in ranges])
        labels = np.concatenate([f["train/labels"][a:b] for a, b in ranges])
        return images, labels.astype(np.int64)


@common.record  # torch's elastic @record: torchrun's failure summary names the error
def main():
    parser = common.parser(__doc__, __file__)
    parser.add_argument("--bucket-cap-mb", type=float,
                        metavar="MB", help="DDP's bucket size (default: 1 MiB for the first "
                        "bucket, 25 MiB for the others; a value sets all of them)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="torch.compile the model (default: on GPUs; off on the CPU, "
                        "where it measured slower for this model: see docs/benchmarks.md)")
    parser.add_argument("command", nargs="?", choices=["train", "prepare"], default="train")
    parser.add_argument("--h5", type=Path, metavar="PATH", help="default: <data-dir>/mnist.h5")
    parser.add_argument("--h5-chunk", type=int, default=1024, metavar="N", help="samples per chunk")
    parser.add_argument("--h5-compression", choices=["gzip", "lzf"], help="compress the chunks")
    parser.set_defaults(num_workers=2)  # workers read the file while the model trains
    args = parser.parse_args()  # every flag is checked here
    args.h5 = args.h5 or args.data_dir / "mnist.h5"
    use_srun_identity()  # before setup, which reads RANK, LOCAL_RANK, WORLD_SIZE, ...
    run = common.setup_distributed(args)  # step 02's setup(), in common.py from here on
    nodes = report_topology(run)
    missing = torch.tensor(float(not args.h5.is_file()), device=run.device)
    dist.all_reduce(missing)  # missing on any rank: all ranks load (load_datasets has collectives)
    if missing > 0:
        train_set, test_set = common.load_datasets(args, run, download=run.local_rank == 0)
        if run.is_main:  # one writer, on a filesystem all ranks share
            common.write_h5(args.h5, train_set, test_set, args.h5_chunk, args.h5_compression)
        dist.barrier()  # no rank opens the file before it is complete
    train_count, chunk, test_set = common.open_h5(args)  # (the harness checks it further)
    common.log(run, f"{args.h5}: {train_count} training samples (streamed, in chunks of {chunk}), "
                    f"{len(test_set)} test samples (in memory)")
    if args.command == "prepare":
        return dist.destroy_process_group()
    plan = common.plan_batches(args, run.world_size, train_count)
    compiled = common.compile_choice(args, run)  # default: on GPUs, if the node can build
    common.announce(run, args, plan, __file__, compile="on" if compiled else "off")
    train_set = StreamingDigits(args.h5, train_count, chunk, plan.per_rank, run.rank,
                                run.world_size, args.seed)
    train_loader = common.make_loader(train_set, None, run, args)  # None: it yields batches
    # Evaluation must count every test sample exactly once, so no sampler padding here:
    # a strided shard per rank, of unequal sizes when the set does not divide.
    test_shard = Subset(test_set, range(run.rank, len(test_set), run.world_size))
    # In memory, no workers: forking them just after the stream's had ended hung 1 run in 8.
    test_loader = common.make_loader(test_shard, 1000, run, args, num_workers=0)

    raw_model = common.build_model(args, seed=args.seed + run.rank).to(run.device)
    # DDP broadcasts rank 0's weights now and averages gradients in every backward().
    # device_ids: the one GPU this rank drives (None on the CPU). Compile inside the wrapper
    # (as in 04); evaluation and checkpoints keep using the plain raw_model.
    model = DDP(torch.compile(raw_model) if compiled else raw_model,
                device_ids=[run.device] if run.device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
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
            train_set.set_epoch(epoch)  # a new chunk order each epoch, the same on every rank
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
            if epoch == start_epoch:
                common.log(run, describe_buckets(model))
            if run.is_main:  # all ranks hold the same weights: one writer is enough
                common.save_checkpoint(args.out_dir / "checkpoint.pt", raw_model, optimizer,
                                scheduler, epoch + 1)
            dist.barrier()  # no rank may read the checkpoint before it is complete
    if test is None:  # resumed a finished run: evaluate only
        test = evaluate(raw_model, test_loader, run)
    if progress.first_step_seconds is not None:
        common.log(run, f"first step {progress.first_step_seconds:.2f} s (one-off costs: warm-up, "
                        f"the compile if on), then {progress.samples_per_sec or 0:,.0f} samples/s")
    results.summary(__file__, args, plan, test, progress, nodes=nodes)
    del model  # DDP holds the process group: release it before the group is destroyed
    dist.destroy_process_group()


if __name__ == "__main__":
    common.run_main(main)
