"""Step 05: many nodes. Step 04 unchanged in what it computes; what changes is who is who.

The global rank picks the data shard; the local rank (within a node) picks the GPU, and local
rank 0 downloads the data once per node. How nodes meet, SLURM, a hang: docs/clusters.md.

Run it:
    torchrun --standalone --nproc-per-node 2 05_multinode.py            # one machine
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-id myrun \\
        --rdzv-endpoint HOST:PORT 05_multinode.py  # on both machines; HOST:PORT on the first
    sbatch slurm/multinode.sh 05_multinode.py                          # SLURM

Look for: one line per rank naming its node, host, local rank and device.

Read also: common.py (setup_distributed, slurm_head_address, slurm_tasks_on_this_node).
"""

# The repository's checks and one-line errors (harness/__init__.py); a copied step runs without.
try: import harness  # noqa: E701, F401
except ModuleNotFoundError: pass  # noqa: E701
import argparse
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, Subset

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


@common.record  # torch's elastic @record: torchrun's failure summary names the error
def main():
    parser = common.parser(__doc__, __file__)
    parser.add_argument("--bucket-cap-mb", type=float,
                        metavar="MB", help="DDP's bucket size (default: 1 MiB for the first "
                        "bucket, 25 MiB for the others; a value sets all of them)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="torch.compile the model (default: on GPUs; off on the CPU, "
                        "where it measured slower for this model: see docs/benchmarks.md)")
    args = parser.parse_args()  # every flag is checked here
    use_srun_identity()  # before setup, which reads RANK, LOCAL_RANK, WORLD_SIZE, ...
    run = common.setup_distributed(args)  # step 02's setup(), in common.py from here on
    nodes = report_topology(run)
    # One download per node (its local rank 0): each node may have its own disk.
    train_set, test_set = common.load_datasets(args, run, download=run.local_rank == 0)
    plan = common.plan_batches(args, run.world_size, len(train_set))
    compiled = common.compile_choice(args, run)  # default: on GPUs, if the node can build
    common.announce(run, args, plan, __file__, compile="on" if compiled else "off")
    # Every rank shuffles with the same seed, then takes every world_size-th index from its
    # rank on: disjoint shares that together cover the set. When the set does not divide,
    # the sampler pads with repeats so all ranks run the same number of steps.
    train_sampler = DistributedSampler(train_set, num_replicas=run.world_size, rank=run.rank,
                                       shuffle=True, seed=args.seed)
    train_loader = common.make_loader(train_set, plan.per_rank, run, args, sampler=train_sampler,
                                    drop_last=True)  # a smaller last batch would recompile
    # Evaluation must count every test sample exactly once, so no sampler padding here:
    # a strided shard per rank, of unequal sizes when the set does not divide.
    test_shard = Subset(test_set, range(run.rank, len(test_set), run.world_size))
    test_loader = common.make_loader(test_shard, 1000, run, args)

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
