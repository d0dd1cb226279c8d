"""Step 08: shard instead of replicate. FSDP2, for a model too large for one device.

Built on step 07. DDP keeps the whole model, its gradients and optimizer state on every rank;
`fully_shard` (FSDP2) keeps 1/N of each, and gathers a layer's weights only while it computes.
Checkpoints are 07's (rank 0's one file). What is not sharded, and the init: docs/fsdp.md.

Run it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a restarted group meets at a fresh store):
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 3 08_fsdp2.py --checkpoint-every 100
    sbatch slurm/multinode.sh 08_fsdp2.py --hsdp  # shard within each node, replicate across

Look for: "each rank holds 599,941 of the 1,199,882 parameters"; peak_memory_mib in summary.json.

Read also: harness/step08_fsdp2.py (the one file restored into shards, what each rank holds),
and step 07's harness/step07_fault_tolerance.py and harness/checkpoint.py.
"""

import harness.startup  # noqa: F401 -- first: a Ctrl-C while torch loads is one line
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import Subset

import common
from harness import versions
versions.require_torch("2.9", "FSDP2 on gloo: before 2.9 its gradients were summed, not averaged")
from harness import ranks
from harness import checkpoint, data, flags, metrics, step07_fault_tolerance as fault_tolerance
from harness import step08_fsdp2 as sharded
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
            # FSDP2's no_sync: reduce-scatter the gradients after the last micro-batch only.
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
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
    correct answers, samples), then the sums are added up over all ranks. Every forward
    all-gathers weights, so a rank with fewer test batches runs blank ones, counting none. How
    many is agreed before the first forward: an all-reduce among them would meet an all-gather."""
    most = torch.tensor(len(loader), device=run.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the most test batches any rank has
    sums = metrics.test_sums(model, loader, run)
    with torch.no_grad(), run.autocast():
        for _ in range(int(most) - len(loader)):
            model(torch.zeros(1, 1, 28, 28, device=run.device))  # a blank digit
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


def shard(model, run, args):
    """FSDP2: each parameter becomes a DTensor split over the ranks along its first dimension
    (`p.to_local()`: this rank's rows). One group per call, gathered and scattered together."""
    if args.hsdp:  # nodes x processes per node: replicate across nodes, shard within one
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", run.world_size))
        mesh = init_device_mesh(run.device.type, (run.world_size // per_node, per_node),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(run.device.type, (run.world_size,))
    # On GPUs: compute in bf16 (half the bytes to gather), average gradients in fp32 (precision;
    # stated, since with reduce_dtype=None torch 2.14 reduced in bf16, 2.15 in the fp32 params').
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  output_dtype=torch.float32) if args.mixed_precision else None
    # reshard_after_forward: free the gathered weights after forward and gather them again in
    # backward (less memory), or keep them until backward (less communication).
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2, model):
        fully_shard(layer, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy(),
                    reshard_after_forward=args.reshard_after_forward)
    return model


@common.record  # torch's elastic @record: torchrun's failure summary names the error
def main():
    parser = flags.parser(__doc__, __file__)
    parser.add_argument("--mixed-precision", action="store_true",
                        help="compute in bf16, average gradients in fp32 (for GPUs with bf16)")
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction,
                        default=True, help="free gathered weights after forward (default)")
    parser.add_argument("--hsdp", action="store_true",
                        help="shard within each node, replicate across nodes (a 2-D mesh)")
    parser.add_argument("--checkpoint-every", type=flags.integer(0, what="--checkpoint-every"),
                        default=100, metavar="K",
                        help="also checkpoint every K training steps (0: once per epoch only)")
    args = parser.parse_args()  # every flag is checked here
    fault_tolerance.check_restart_store()  # a restarted group must not meet at a stale store
    stop = fault_tolerance.StopRequest()  # before the (slow) setup: a signal may come any time
    use_srun_identity()  # before setup, which reads RANK, LOCAL_RANK, WORLD_SIZE, ...
    run = common.setup_distributed(args)  # step 02's setup(), now shared
    if args.mixed_precision and not run.has_bf16:  # as --amp: GPUs with native bf16 only
        common.log(run, "note: --mixed-precision needs a GPU with native bf16; training in "
                        "float32")
        args.mixed_precision = False
    fault_tolerance.claim_out_dir(args.out_dir, run)  # one run at a time in an --out-dir
    nodes = report_topology(run)
    # One download per node (its local rank 0): each node may have its own disk. On a shared
    # filesystem the downloads land in temporary folders and are renamed into place, so two
    # nodes downloading at once cannot leave a half-written file.
    train_set, test_set = data.load_datasets(args, run, download=run.local_rank == 0)
    plan = common.plan_batches(args, run.world_size, len(train_set))
    common.announce(run, args, plan, __file__,
                    mixed_precision="bf16/fp32" if args.mixed_precision else "off")
    # Every rank shuffles with the same seed, then takes every world_size-th index from its
    # rank on: disjoint shares that together cover the set. When the set does not divide,
    # the sampler pads with repeats so all ranks run the same number of steps.
    train_sampler = fault_tolerance.ResumableSampler(
        train_set, num_replicas=run.world_size, rank=run.rank, shuffle=True, seed=args.seed)
    train_loader = data.make_loader(train_set, plan.per_rank, run, args, sampler=train_sampler,
                                    worker_init_fn=fault_tolerance.ignore_stop_signals,
                                    drop_last=True)  # as in 07: equal steps on every rank
    # Evaluation must count every test sample exactly once, so no sampler padding here:
    # a strided shard per rank, of unequal sizes when the set does not divide.
    test_shard = Subset(test_set, range(run.rank, len(test_set), run.world_size))
    test_loader = data.make_loader(test_shard, 1000, run, args)

    # On the meta device a model has shapes and no memory. shard() splits each parameter over
    # the ranks, to_empty() allocates this rank's shards (uninitialised), and rank 0's full
    # copy is broadcast into them, one whole tensor at a time: only rank 0 holds the whole model.
    with torch.device("meta"):
        model = build_model(args, seed=args.seed)
    shard(model, run, args).to_empty(device=run.device)
    set_model_state_dict(model, build_model(args, seed=args.seed).state_dict() if run.is_main
                         else {}, options=StateDictOptions(full_state_dict=True,
                                                           broadcast_from_rank0=True))
    memory_after_build = sharded.peak_memory_mib(run)  # (MiB)
    common.log(run, sharded.describe_shards(model))  # "each rank holds N of the M ..."
    # The optimizer comes after shard(): it must hold the sharded parameters.
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
        saved = sharded.restore(args.resume, run, model, optimizer, scheduler)
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
        # The whole state, gathered to rank 0's CPU a tensor at a time (the others get {}).
        model_state, optim = get_state_dict(model, optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if run.is_main:  # the only rank that holds the gathered state
            checkpoint.save(latest, model_state, sharded.numbered(optim), scheduler, epochs_done,
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
            test = evaluate(model, test_loader, run)
            results.epoch(epoch, train_loss, test, samples_per_sec, lr)
            save(epoch + 1)
    if test is None:  # resumed a finished run: evaluate only
        test = evaluate(model, test_loader, run)
    if progress.first_step_seconds is not None:
        common.log(run, f"first step {progress.first_step_seconds:.2f} s (one-off costs: warm-up, "
                        f"FSDP2's set-up), then {progress.samples_per_sec or 0:,.0f} samples/s")
    results.summary(__file__, args, plan, test, progress, nodes=nodes,  # + what each rank held
                    **sharded.held_per_rank(model, optimizer, run, memory_after_build))
    dist.destroy_process_group()


if __name__ == "__main__":
    common.run_main(main)
