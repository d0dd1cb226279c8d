"""Step 05: many nodes. Step 04 unchanged in what it computes; what changes is who is who.

Three numbers identify a process once there is more than one machine:
  - the global rank, 0 .. world_size-1 over all nodes: it picks the data shard and rank 0
    prints and saves for everyone;
  - the local rank, 0 .. processes-per-node-1 on each node: it picks the GPU (cuda:<local rank>),
    and local rank 0 is the one process per node that downloads the data;
  - the node rank (torchrun's GROUP_RANK), 0 .. nodes-1.
The launcher sets them. On every node, one torchrun agent starts the node's workers; the agents
meet at one address (c10d rendezvous, hosted by the first agent to arrive), agree on the node
order, and hand every worker RANK, LOCAL_RANK, WORLD_SIZE and the address of the group's store.
The script itself only reads those, so it runs unchanged on one node or many.

Run it:
    torchrun --standalone --nproc-per-node 2 05_multinode.py            # one machine
    # Two machines (run on each; HOST = the first machine's address, PORT = a free port):
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-id myrun \
        --rdzv-endpoint HOST:PORT 05_multinode.py
    sbatch slurm/multinode.sh 05_multinode.py                          # a SLURM cluster
A rehearsal on one machine: run that two-machine command in two terminals with HOST=127.0.0.1.

Look for: one line per rank naming its node, host, local rank and device, then training as in
step 04. If the run hangs at start-up, the agents never met: check that every node got the same
--rdzv-endpoint and --rdzv-id, that the port is open between nodes, and that --nnodes matches.
"""

import argparse
import os

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


def main():
    parser = common.argument_parser(__doc__, __file__)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile the DDP model (default: on)")
    args = parser.parse_args()
    run = common.setup(args, distributed=True)
    plan = common.plan_batches(args.batch_size, run.world_size, args.max_device_batch)
    common.announce(run, args, plan, __file__)

    nodes = report_topology(run)
    # One download per node (its local rank 0): each node may have its own disk. On a shared
    # filesystem the downloads land in temporary folders and are renamed into place, so two
    # nodes downloading at once cannot leave a half-written file.
    train_set, test_set = common.load_datasets(args, run, download=run.local_rank == 0)
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
    metrics.summary(__file__, args, plan, test, meter, nodes=nodes)


if __name__ == "__main__":
    common.run_main(main)
