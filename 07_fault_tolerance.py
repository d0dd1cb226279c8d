"""Step 07: survive failures. A killed rank, a preempted job or a time limit costs minutes.

Built on step 05. A process dies: `torchrun --max-restarts N` restarts the whole group, which
continues from the newest checkpoint in --out-dir. SLURM sends SIGTERM: the ranks agree on a
step, checkpoint there and exit 75 for a requeue. Exact resume, lost nodes: docs/fault-tolerance.md.

Run it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a restarted group meets at a fresh store):
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 3 07_fault_tolerance.py --checkpoint-every 100
    sbatch slurm/multinode.sh 07_fault_tolerance.py --checkpoint-every 100

Look for: `kill -9` one worker: torchrun restarts the group, "resumed at step S of epoch E".
SIGTERM to torchrun: "stopping at step S of epoch E (SIGTERM): checkpoint saved".

Read also: harness/step07_fault_tolerance.py (StopRequest, ResumableSampler), harness/checkpoint.py.
"""

import harness.startup  # noqa: F401 -- first: a Ctrl-C while torch loads is one line
import argparse
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset

import common
from harness import ranks
from harness import checkpoint, data, flags, metrics, step07_fault_tolerance as fault_tolerance
from harness.model import build_model


def use_srun_identity():
    """`srun python 05_multinode.py` (one task per GPU, no torchrun) tells each process who it
    is in SLURM's variables: the same numbers under other names. The group then meets at the
    first node of the job step, at a port derived from the job id."""
    env = os.environ
    if "RANK" in env or int(env.get("SLURM_STEP_NUM_TASKS", 1)) < 2:
        return  # started by torchrun, or by plain python
    env.update(RANK=env["SLURM_PROCID"], LOCAL_RANK=env["SLURM_LOCALID"],
               WORLD_SIZE=env["SLURM_STEP_NUM_TASKS"], GROUP_RANK=env["SLURM_NODEID"],
               LOCAL_WORLD_SIZE=str(common.slurm_tasks_on_this_node()))
    env.setdefault("MASTER_ADDR", common.slurm_head_address(env["SLURM_STEP_NODELIST"]))
    env.setdefault("MASTER_PORT", str(15000 + int(env["SLURM_JOB_ID"]) % 15000))


EPOCH_START = {"step": 0, "loss_sum": 0.0, "samples": 0}  # steps done, and their sums


def train_one_epoch(model, loader, optimizer, scheduler, run, plan, progress, position, rng,
                    after_step):
    """One pass over the training set, or the rest of it after a mid-epoch checkpoint (its
    `position` and `rng`); returns the mean training loss, or None when after_step says stop."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)  # on the device: no sync
    samples, step = 0, position["step"]
    batches = iter(loader)  # (draws the loader's seed from the RNG the epoch started with)
    if rng is not None:
        fault_tolerance.set_rng_state(rng)  # resumed mid-epoch: the checkpoint's random state
    for images, labels in batches:
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
        step += 1
        if after_step(step, loss_sum, samples):
            return None
    totals = torch.tensor([loss_sum.item(), samples], dtype=torch.float64, device=run.device)
    dist.all_reduce(totals)  # the mean over every rank's samples, not rank 0's alone
    totals += torch.tensor([position["loss_sum"], position["samples"]], dtype=torch.float64,
                           device=run.device)  # with the sums from before a resume
    return (totals[0] / totals[1]).item()


def evaluate(model, loader, run):
    """Loss and accuracy over the whole test set: each rank sums over its shard (loss,
    correct answers, samples), then the sums are added up over all ranks."""
    sums = metrics.test_sums(model, loader, run)
    dist.all_reduce(sums)
    return metrics.test_results(sums)


def report_topology(run):
    """Every rank says where it runs, and the variables that steer how the group connects
    which it inherited (often left over in a shell or a module file, and different per node);
    rank 0 prints one line per rank. Returns the node count."""
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


@common.record  # torch's elastic @record: torchrun's failure summary names the error
def main():
    parser = flags.parser(__doc__, __file__)
    parser.add_argument("--bucket-cap-mb", type=flags.positive_float("--bucket-cap-mb"),
                        metavar="MB", help="DDP's bucket size (default: 1 MiB for the first "
                        "bucket, 25 MiB for the others; a value sets all of them)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="torch.compile the model (default: on GPUs; off on the CPU, "
                        "where it measured slower for this model: see docs/benchmarks.md)")
    parser.add_argument("--checkpoint-every", type=flags.integer(0, what="--checkpoint-every"),
                        default=100, metavar="K",
                        help="also checkpoint every K training steps (0: once per epoch only)")
    args = parser.parse_args()  # every flag is checked here
    fault_tolerance.check_restart_store()  # a restarted group must not meet at a stale store
    stop = fault_tolerance.StopRequest()  # before the (slow) setup: a signal may come any time
    use_srun_identity()  # before setup, which reads RANK, LOCAL_RANK, WORLD_SIZE, ...
    run = common.setup_distributed(args)  # step 02's setup(), now shared
    fault_tolerance.claim_out_dir(args.out_dir, run)  # one run at a time in an --out-dir
    nodes = report_topology(run)
    # One download per node (its local rank 0): each node may have its own disk. On a shared
    # filesystem the downloads land in temporary folders and are renamed into place, so two
    # nodes downloading at once cannot leave a half-written file.
    train_set, test_set = data.load_datasets(args, run, download=run.local_rank == 0)
    plan = common.plan_batches(args, run.world_size, len(train_set))
    compiled = common.compile_choice(args, run)  # default: on GPUs, if the node can build
    common.announce(run, args, plan, __file__, compile="on" if compiled else "off")
    # Every rank shuffles with the same seed, then takes every world_size-th index from its
    # rank on: disjoint shares that together cover the set. When the set does not divide,
    # the sampler pads with repeats so all ranks run the same number of steps.
    train_sampler = fault_tolerance.ResumableSampler(
        train_set, num_replicas=run.world_size, rank=run.rank, shuffle=True, seed=args.seed)
    train_loader = data.make_loader(train_set, plan.per_rank, run, args, sampler=train_sampler,
                                    worker_init_fn=fault_tolerance.ignore_stop_signals,
                                    drop_last=True)  # a smaller last batch would recompile
    # Evaluation must count every test sample exactly once, so no sampler padding here:
    # a strided shard per rank, of unequal sizes when the set does not divide.
    test_shard = Subset(test_set, range(run.rank, len(test_set), run.world_size))
    test_loader = data.make_loader(test_shard, 1000, run, args)

    raw_model = build_model(args, seed=args.seed + run.rank).to(run.device)
    # DDP broadcasts rank 0's weights now and averages gradients in every backward().
    # device_ids: the one GPU this rank drives (None on the CPU). Compile inside the wrapper
    # (see the top); evaluation and checkpoints keep using the plain raw_model.
    model = DDP(torch.compile(raw_model) if compiled else raw_model,
                device_ids=[run.device] if run.device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = common.lr_schedule(optimizer, args, plan, len(train_loader))
    latest = args.out_dir / "checkpoint.pt"
    settings = fault_tolerance.run_settings(__file__, args, plan, train_set)  # what this run is
    # Any rank restarted: all resume (an agent restarted only because another node failed
    # does not count that restart), from this run's own checkpoint only: another run's, left in
    # the same --out-dir, is not adopted. --resume is for the first attempt: a restart continues
    # from what this run saved since, if it did. A fresh run starts fresh, or from --resume.
    if ranks.all_ranks_agree(run, fault_tolerance.restarted(), any_rank=True):
        args.resume = fault_tolerance.own_checkpoint(latest, settings, run) or args.resume
    start_epoch, position, rng = 0, EPOCH_START, None
    if args.resume:
        saved = checkpoint.restore(args.resume, run, raw_model, optimizer, scheduler,
                                   mid_epoch=True)  # 07 continues mid-epoch: see below
        fault_tolerance.check_same_sample_order(saved, settings, args.resume)  # mid-epoch
        start_epoch, position = saved["epoch"], saved.get("position") or EPOCH_START
        if "rng" in saved and len(saved["rng"]) == run.world_size and position["step"]:
            rng = saved["rng"][run.rank]  # each rank its own (their dropout masks differ)
        common.log(run, f"resumed at step {position['step']} of epoch {start_epoch + 1}")

    def save(epochs_done, step=0, loss_sum=None, samples=0):
        """Every rank calls this: the partial sums and RNG states are gathered from all."""
        sums = torch.tensor([0.0 if loss_sum is None else loss_sum.item(), samples],
                            dtype=torch.float64, device=run.device)
        dist.all_reduce(sums)  # the epoch's sums so far, over every rank's samples
        rng_states = [None] * run.world_size
        dist.all_gather_object(rng_states, fault_tolerance.rng_state())  # every rank's own
        done = {"step": step, "loss_sum": position["loss_sum"] + sums[0].item(),
                "samples": position["samples"] + int(sums[1].item())}  # the epoch so far
        if run.is_main:  # all ranks hold the same weights: one writer is enough
            checkpoint.save(latest, raw_model, optimizer, scheduler, epochs_done,
                            position=done if step else None, rng=rng_states, run=settings)
        dist.barrier()  # no rank may read the checkpoint before it is complete

    def after_step(step, loss_sum, samples):
        """Checkpoint every --checkpoint-every steps; on an agreed stop request, save and stop.
        (`epoch` is the epoch the loop below is training.)"""
        stopping = stop.agreed(run)
        if stopping or (args.checkpoint_every and step % args.checkpoint_every == 0):
            progress.check_loss()  # never save a model whose loss went NaN
            save(epoch, step, loss_sum, samples)
        if stopping:
            common.log(run, f"stopping at step {step} of epoch {epoch + 1} ({stop.reason}): "
                            f"checkpoint saved in {latest}")
        return stopping

    results, test = metrics.Metrics(run, args), None
    with metrics.Progress(run, args, steps_per_epoch=len(train_loader)) as progress:
        for epoch in range(start_epoch, args.epochs):
            # Shuffling and dropout draw from these numbers alone, so a run resumed at this
            # epoch draws exactly what an uninterrupted run drew.
            common.seed_everything(args.seed, epoch, run.rank)  # rank: its own dropout masks
            train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            train_sampler.skip = position["step"] * plan.per_rank  # what a checkpoint covers
            progress.start_epoch(epoch, steps_done=position["step"])
            train_loss = train_one_epoch(model, train_loader, optimizer, scheduler, run, plan,
                                         progress, position, rng, after_step)
            if train_loss is None:  # asked to stop, and checkpointed
                raise SystemExit(fault_tolerance.EXIT_STOPPED)
            position, rng = EPOCH_START, None  # the next epoch starts at its beginning
            samples_per_sec = progress.end_epoch()
            lr = scheduler.last_step_lr()  # the rate the epoch ended with
            # The raw model, not DDP: DDP's forward broadcasts the module's buffers (BatchNorm's
            # statistics; this CNN has none) from rank 0, and test shards can differ in size,
            # so a rank with one batch more would wait in a broadcast no peer joins.
            test = evaluate(raw_model, test_loader, run)
            results.epoch(epoch, train_loss, test, samples_per_sec, lr)
            if epoch == start_epoch:
                common.log(run, common.describe_buckets(model))  # as in 03
            save(epoch + 1)
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
