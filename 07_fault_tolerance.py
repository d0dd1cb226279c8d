"""Step 07: survive failures. A killed rank, a preempted job or a time limit loses minutes, not days.

Three things go wrong on shared clusters, and step 06 handles none of them:
  - a process dies (a node fails, a GPU errors out, out of memory). `torchrun --max-restarts N`
    then restarts the whole group (the default is 0: no restart). A restarted process sees
    TORCHELASTIC_RESTART_COUNT > 0 and continues from the latest checkpoint in --out-dir;
  - the scheduler wants the node back (preemption) or the time limit nears. SLURM sends SIGTERM
    (or, with our sbatch templates, the batch script turns its early warning into one); torchrun
    forwards it to the workers. They agree on one step, save there, exit with code 75 ("try
    again"), and the requeued job (SLURM_RESTART_COUNT > 0) continues from that checkpoint;
  - an hour between checkpoints is an hour lost: --checkpoint-every K saves every K steps too.
A checkpoint records where in the epoch it was taken, and every rank's random state, so a
resumed run computes exactly what the uninterrupted run would have, provided the world size,
--batch-size and --num-workers stay the same. Checkpoints are renamed into place when complete:
a kill during a save leaves the previous one intact. A fresh run (no restart count) starts
fresh; --resume PATH resumes explicitly.

Run it:
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 07_fault_tolerance.py \
        --checkpoint-every 100
    sbatch slurm/multinode.sh 07_fault_tolerance.py --checkpoint-every 100   # see slurm/*.sh

Look for: kill one worker (`kill -9 <pid>`) and watch torchrun restart the group and the run
continue: "resumed ... at step S of epoch E". Send SIGTERM to torchrun and watch the workers stop
at a checkpoint: "stopping at step S of epoch E (SIGTERM): checkpoint saved".
"""

import argparse
import itertools
import os
import signal
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from contextlib import nullcontext

from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import IterableDataset, Subset, get_worker_info

import common


def train_one_epoch(model, loader, optimizer, run, plan, meter, prof, position, after_step):
    """One pass over the training set, or its rest when `position` (from a checkpoint taken in
    mid-epoch) says how far it got; returns the mean training loss, or None when
    `after_step(position)` asked to stop."""
    model.train()
    done, loss_total, samples = position["step"], position["loss_sum"], position["samples"]
    loss_sum = torch.tensor(loss_total, device=run.device)  # kept on the device: no host sync
    # Skip the batches the checkpoint covers: the same seed and epoch give the same batches.
    for images, labels in itertools.islice(loader, done, None):
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
        done += 1
        if after_step({"step": done, "loss_sum": loss_sum, "samples": samples}):
            return None
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


def report_topology(run):
    """Every rank says where it runs; rank 0 prints one line per rank. Returns the node count."""
    node_rank = int(os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", 0)))
    me = (node_rank, run.hostname, run.rank, run.local_rank, str(run.device))
    everyone = [None] * run.world_size
    dist.all_gather_object(everyone, me)  # a collective: every rank must call it
    for node, host, rank, local_rank, device in everyone:
        common.log(run, f"[node {node} {host}] rank {rank}/{run.world_size} "
                        f"local rank {local_rank} on {device}")
    return len({node for node, *_ in everyone})


class StopRequest:
    """SIGTERM means "stop soon": SLURM sends it before it cancels, preempts or times out a job
    (our sbatch templates forward their early warning as one), and torchrun passes it on to its
    workers. Stopping mid-step would leave nothing to save, so the handler only takes note;
    the training loop asks `agreed()` between steps."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self.note)

    def note(self, signum, frame):
        self.requested = True

    def agreed(self, run):
        """True on every rank if any rank was asked: all ranks must stop at the same step, or
        the ones still training would wait forever in their next all-reduce."""
        flag = torch.tensor([int(self.requested)], device=run.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


EPOCH_START = {"step": 0, "loss_sum": 0.0, "samples": 0}  # a position: steps done, their sums
STOP_CHECK_EVERY = 10  # steps between checks: each check is an all-reduce and a host sync
EXIT_STOPPED = 75  # "temporary failure, try again" (sysexits.h): stopped early, resumable


def restarted() -> bool:
    """True when torchrun restarted this group or SLURM requeued this job."""
    return any(int(os.environ.get(name, 0)) > 0
               for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


# The chunk size trades read size against shuffling. A chunk is the unit HDF5 reads (and checks):
# bigger chunks mean fewer, larger reads (network filesystems like ~1 MB), but the samples of one
# chunk always land in the same few batches, and each worker holds BUFFER_CHUNKS of them in memory.
# 1024 MNIST images are 0.8 MB.
BUFFER_CHUNKS = 4


class StreamingDigits(IterableDataset):
    """The training set, read from the HDF5 file a few chunks at a time, yielded as batches."""

    def __init__(self, path, count, chunk, batch_size, rank, world_size, seed):
        self.path, self.count, self.chunk, self.batch_size = path, count, chunk, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        # Every rank must run the same number of steps, or the all-reduce waits forever for a
        # rank that stopped early. Policy: drop the remainder (fewer than world_size x batch
        # samples), a different one each epoch as the chunk order changes. Padding with repeats,
        # as DistributedSampler does, would count some samples twice and add scattered reads.
        self.steps = count // (world_size * batch_size)
        if self.steps == 0:
            raise common.UserError(f"{count} training samples do not fill one global batch of "
                                   f"{world_size * batch_size}")
        # Persistent workers keep their own copy of this object: set_epoch() must write where
        # they can read it, in shared memory.
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
        mine = list(self.rows(starts, first * self.batch_size, last * self.batch_size))
        # 3. Read a few chunks, shuffle what is buffered, yield whole batches, keep the rest.
        rng = np.random.default_rng([self.seed, epoch, first])
        images, labels = np.empty((0, 28, 28), np.uint8), np.empty(0, np.int64)
        with h5py.File(self.path, "r") as f:  # opened here, in the worker, after the fork
            for i in range(0, len(mine), BUFFER_CHUNKS):
                new_images, new_labels = self.read(f, mine[i:i + BUFFER_CHUNKS])
                images = np.concatenate([images, new_images])
                labels = np.concatenate([labels, new_labels])
                shuffled = rng.permutation(len(labels))
                ready = len(labels) // self.batch_size * self.batch_size
                for k in range(0, ready, self.batch_size):
                    batch = shuffled[k:k + self.batch_size]
                    yield (common.normalize(torch.from_numpy(images[batch])).unsqueeze(1),
                           torch.from_numpy(labels[batch]))
                images, labels = images[shuffled[ready:]], labels[shuffled[ready:]]

    def rows(self, starts, first, last):
        """The rows at positions first .. last-1 of the stream the chunks form, as (a, b) ranges:
        whole chunks, except at the two ends."""
        position = 0
        for start in starts:
            end = min(start + self.chunk, self.count)
            a, b = max(start, start + first - position), min(end, start + last - position)
            if a < b:
                yield a, b
            position += end - start

    def read(self, f, ranges):
        """One sequential read per range."""
        return (np.concatenate([f["train/images"][a:b] for a, b in ranges]),
                np.concatenate([f["train/labels"][a:b] for a, b in ranges]).astype(np.int64))


def main():
    parser = common.argument_parser(__doc__, __file__)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile the DDP model (default: on)")
    parser.add_argument("command", nargs="?", choices=["train", "prepare"], default="train",
                        help="prepare: only write the HDF5 file (train prepares it if missing)")
    parser.add_argument("--h5", type=Path, metavar="PATH",
                        help="the HDF5 file (default: <data-dir>/mnist.h5)")
    parser.add_argument("--h5-chunk", type=int, default=1024, metavar="N",
                        help="samples per chunk (prepare)")
    parser.add_argument("--h5-compression", choices=["gzip", "lzf"],
                        help="compress chunks (prepare; default: none)")
    parser.set_defaults(num_workers=2)  # workers read the file while the model trains
    parser.add_argument("--checkpoint-every", type=int, default=100, metavar="K",
                        help="also checkpoint every K training steps (0: once per epoch only)")
    args = parser.parse_args()
    args.h5 = args.h5 or args.data_dir / "mnist.h5"
    stop = StopRequest()  # before the (slow) setup: a SIGTERM may come at any time
    run = common.setup(args, distributed=True)
    plan = common.plan_batches(args.batch_size, run.world_size, args.max_device_batch)
    common.announce(run, args, plan, __file__)

    nodes = report_topology(run)
    # Global rank 0 writes the file; the others wait at the barrier. This assumes a filesystem
    # all nodes share (otherwise run `prepare` on every node first). Conversion reads the source
    # into memory once, as steps 00-05 do; only training streams. The file keeps what --data and
    # --train/test-samples chose when it was written: delete it to change that.
    if not common.all_ranks_agree(run, args.h5.is_file()):
        train_set, test_set = common.load_datasets(args, run, download=run.local_rank == 0)
        if run.is_main and not args.h5.is_file():
            common.write_digits_h5(args.h5, train_set, test_set, args.h5_chunk,
                                   args.h5_compression)
        dist.barrier()
    # `prepare` reads every chunk once to verify it; training checks the file's shape and end.
    train_count, chunk, test_set = common.open_digits_h5(
        args.h5, args.train_samples, args.test_samples, verify_all=args.command == "prepare")
    common.log(run, f"{args.h5}: {train_count} training samples (streamed, in chunks of {chunk}), "
                    f"{len(test_set)} test samples (in memory)")
    if args.command == "prepare":
        return
    train_set = StreamingDigits(args.h5, train_count, chunk, plan.per_rank, run.rank,
                                run.world_size, args.seed)
    # batch_size=None: the dataset yields whole batches itself.
    train_loader = common.make_loader(train_set, None, run, args, seed=args.seed + run.rank)
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
    latest = args.out_dir / "checkpoint.pt"
    if args.resume is None and restarted() and latest.is_file():
        args.resume = latest  # a restarted or requeued run continues; a fresh run starts fresh
    start_epoch, position = 0, EPOCH_START
    if args.resume:
        checkpoint = common.resume(args.resume, run, raw_model, optimizer, scheduler,
                                   train_loader.generator)
        start_epoch, position = checkpoint["epoch"], checkpoint.get("position") or position
        common.log(run, f"resumed at step {position['step']} of epoch {start_epoch + 1}")

    def save(epochs_done, position=None):
        rng_states = common.gather_rng_states(run, train_loader.generator)  # every rank's
        if run.is_main:  # all ranks hold the same weights: one writer is enough
            common.save_checkpoint(latest, raw_model, optimizer, scheduler, epochs_done,
                                   rng_states, position=position)
        dist.barrier()  # no rank may read the checkpoint before it is complete

    def after_step(position):
        """Checkpoint every --checkpoint-every steps; on a stop request, checkpoint and stop.
        (Called from inside the epoch loop below: `epoch` is the epoch being trained.)"""
        step = position["step"]
        stopping = step % STOP_CHECK_EVERY == 0 and stop.agreed(run)
        if stopping or (args.checkpoint_every and step % args.checkpoint_every == 0):
            save(epoch, {**position, "loss_sum": position["loss_sum"].item()})
        if stopping:
            common.log(run, f"stopping at step {step} of epoch {epoch + 1} (SIGTERM): "
                            f"checkpoint saved in {latest}")
        return stopping

    metrics, meter, test = common.Metrics(run, args.out_dir), common.Throughput(run), None
    with common.profiler(args, run) as prof:
        for epoch in range(start_epoch, args.epochs):
            train_set.set_epoch(epoch)  # a new chunk order each epoch, the same on every rank
            meter.start_epoch()
            train_loss = train_one_epoch(model, train_loader, optimizer, run, plan, meter, prof,
                                         position, after_step)
            if train_loss is None:  # asked to stop, and checkpointed
                raise SystemExit(EXIT_STOPPED)
            position = EPOCH_START  # the next epoch starts at its beginning
            samples_per_sec = meter.end_epoch()
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            test = evaluate(raw_model, test_loader, run)  # no DDP: eval shards differ in size
            metrics.epoch(epoch, train_loss, test, samples_per_sec, lr)

            save(epoch + 1)
    if test is None:  # resumed a finished run: evaluate only
        test = evaluate(raw_model, test_loader, run)
    metrics.summary(__file__, args, plan, test, meter, nodes=nodes)


if __name__ == "__main__":
    common.run_main(main)
