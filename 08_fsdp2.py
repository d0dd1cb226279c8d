"""Step 08: FSDP2's choices at scale, and what each rank holds, measured.

Built on step 08b. --hsdp shards within a node and replicates across nodes (a 2-D mesh: the
all-gathers stay on the node's fast links); --mixed-precision computes in bf16 and averages the
gradients in fp32; --no-reshard-after-forward keeps the gathered weights from forward to
backward (memory for one all-gather less). summary.json gets every rank's parameters, optimizer
state and peak memory. When each choice pays: docs/fsdp.md.

Run it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a restarted group meets at a fresh store):
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 3 08_fsdp2.py --checkpoint-every 100
    sbatch slurm/multinode.sh 08_fsdp2.py --hsdp  # shard within each node, replicate across

Look for: "each rank holds 599,941 of the 1,199,882 parameters"; peak_memory_mib in summary.json.
"""

# The repository's checks and one-line errors (harness/__init__.py); a copied step runs without.
try: import harness  # noqa: E701, F401
except ModuleNotFoundError: pass  # noqa: E701
import argparse
import os
import resource
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import Subset

import common
from common import (EPOCH_START, EXIT_STOPPED, ResumableSampler, StopRequest,  # 07's
                    ignore_stop_signals, restarted, rng_state, set_rng_state)

if torch.__version__ < (2, 9):  # a behaviour, not an API: FSDP2 on gloo summed the gradients
    print(f"error: 08_fsdp2.py needs torch >= 2.9 (FSDP2 on gloo before 2.9 "
          f"summed gradients, not averaged); this is torch {torch.__version__}", file=sys.stderr)
    sys.exit(2)


def own_checkpoint(latest, settings, run):
    """What a restarted group continues from: the checkpoint this run saved, if any. Another
    run's in the same --out-dir (a finished one, say) is left alone: continuing it would report
    that run's results under this run's flags (common.adopted says so in a line)."""
    if not latest.is_file():
        return None
    saved = torch.load(latest, map_location="cpu", weights_only=True)
    return common.adopted(latest, saved.get("run"), settings, run)


def rekeyed(optim_state: dict, key) -> dict:
    """The optimizer state with parameter p's key replaced by key[p]: torch's state-dict API
    names parameters ("fc1.weight"), the file numbers them (0, 1, ...) as any step's SGD does."""
    return {"state": {key[p]: s for p, s in optim_state["state"].items()}, "param_groups": [
        {**g, "params": [key[p] for p in g["params"]]} for g in optim_state["param_groups"]]}


def resume(path, run, model, optimizer, scheduler, settings):
    """Load `path` into the shards (every rank reads the whole file and keeps its own part);
    returns the epoch to continue, the position in it, this rank's RNG state."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    names = [name for name, _ in model.named_parameters()]  # by number: the file's order
    set_state_dict(model, optimizer, model_state_dict=saved["model"],
                   optim_state_dict=rekeyed(saved["optimizer"], names),
                   options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(saved["scheduler"])
    position, states = saved.get("position") or EPOCH_START, saved.get("rng") or []
    common.check_same_sample_order(saved.get("run"), position, settings, path)
    # Each rank its own (their dropout masks differ); none fits on another world size.
    rng = states[run.rank] if position["step"] and len(states) == run.world_size else None
    common.log(run, f"resumed at step {position['step']} of epoch {saved['epoch'] + 1}")
    return saved["epoch"], position, rng


def train_one_epoch(model, loader, optimizer, scheduler, run, plan, progress, position, rng,
                    after_step):
    """One pass over the training set, or the rest of it after a mid-epoch checkpoint (its
    `position` and `rng`); returns the mean training loss, or None when after_step says stop."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)  # on the device: no sync
    samples, step = 0, position["step"]
    batches = iter(loader)  # (draws the loader's seed from the RNG the epoch started with)
    if rng is not None:
        set_rng_state(rng)  # resumed mid-epoch: dropout draws on as it would have
    for images, labels in batches:
        images, labels = images.to(run.device), labels.to(run.device)
        optimizer.zero_grad(set_to_none=True)
        micro_batches = list(zip(images.split(plan.micro_batch), labels.split(plan.micro_batch)))
        for i, (micro_images, micro_labels) in enumerate(micro_batches):
            # FSDP2's no_sync: reduce-scatter the gradients after the last micro-batch only.
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            with run.autocast():
                loss = F.cross_entropy(model(micro_images), micro_labels)
            (loss * len(micro_labels) / len(labels)).backward()
            loss_sum += loss.detach() * len(micro_labels)
        optimizer.step()
        scheduler.step()
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
    correct answers, samples), then over all ranks. Every forward all-gathers weights: a rank
    with fewer test batches runs blank ones, counting none (how many: agreed before)."""
    most = torch.tensor(len(loader), device=run.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the most test batches any rank has
    sums = common.test_sums(model, loader, run)
    with torch.no_grad(), run.autocast():
        for _ in range(int(most) - len(loader)):
            model(torch.zeros(1, 1, 28, 28, device=run.device))  # a blank digit
    dist.all_reduce(sums)
    return common.test_results(sums)


def shard(model, run, args):
    """FSDP2: each parameter becomes a DTensor split over the ranks along its first dimension
    (`p.to_local()`: this rank's rows). One group per call, gathered and scattered together."""
    mesh = init_device_mesh(run.device.type, (run.world_size,))
    if args.hsdp:  # nodes x processes per node: replicate across nodes, shard within one
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", run.world_size))
        mesh = init_device_mesh(run.device.type, (run.world_size // per_node, per_node),
                                mesh_dim_names=("replicate", "shard"))
    # On GPUs: compute in bf16 (half the bytes to gather), average gradients in fp32.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  output_dtype=torch.float32) if args.mixed_precision else None
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2, model):
        fully_shard(layer, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy(),
                    reshard_after_forward=args.reshard_after_forward)  # or keep until backward
    return model


def peak_memory_mib(run) -> float:
    """The most this process held: its GPU tensors, or on the CPU its peak resident set."""
    if run.device.type == "cuda":
        return torch.cuda.max_memory_allocated(run.device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # (Linux: KiB)


def held_per_rank(model, optimizer, run) -> dict:
    """For summary.json (a collective): the elements each rank holds of the parameters and of
    the optimizer state (its shards: SGD's momentum), and its peak memory (MiB)."""
    state = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    mine = (sum(p.to_local().numel() for p in model.parameters()),
            sum(t.to_local().numel() for t in state), peak_memory_mib(run))
    everyone = [None] * run.world_size
    dist.all_gather_object(everyone, mine)
    return {"params_total": sum(p.numel() for p in model.parameters()),
            "params_per_rank": [e[0] for e in everyone],
            "optimizer_state_per_rank": [e[1] for e in everyone],
            "peak_memory_mib": [e[2] for e in everyone]}


@common.record  # torch's elastic @record: torchrun's failure summary names the error
def main():
    parser = common.parser(__doc__, __file__)
    parser.add_argument("--mixed-precision", action="store_true",
                        help="compute in bf16, average gradients in fp32 (for GPUs with bf16)")
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction,
                        default=True, help="free gathered weights after forward (default)")
    parser.add_argument("--hsdp", action="store_true",
                        help="shard within each node, replicate across nodes (a 2-D mesh)")
    parser.add_argument("--checkpoint-every", type=int, default=100, metavar="K",
                        help="also checkpoint every K training steps (0: once per epoch only)")
    args = parser.parse_args()  # every flag is checked here
    stop = StopRequest()  # before the (slow) setup: a signal may come any time
    common.use_srun_identity()  # as in 05
    run = common.setup_distributed(args)
    if args.mixed_precision and not run.has_bf16:  # as --amp: GPUs with native bf16 only
        common.log(run, "note: --mixed-precision needs a GPU with native bf16; training in float32")
        args.mixed_precision = False
    results = common.Metrics(run, args)  # (in the repository: one run at a time per --out-dir)
    nodes = common.report_topology(run)  # as in 05
    # One download per node (its local rank 0): each node may have its own disk.
    train_set, test_set = common.load_datasets(args, run, download=run.local_rank == 0)
    plan = common.plan_batches(args, run.world_size, len(train_set))
    common.announce(run, args, plan, __file__,
                    mixed_precision="bf16/fp32" if args.mixed_precision else "off")
    # Every rank shuffles with the same seed, then takes every world_size-th index from its
    # rank on: disjoint shares that together cover the set. When the set does not divide,
    # the sampler pads with repeats so all ranks run the same number of steps.
    train_sampler = ResumableSampler(train_set, num_replicas=run.world_size, rank=run.rank,
                                     shuffle=True, seed=args.seed)
    train_loader = common.make_loader(train_set, plan.per_rank, run, args, sampler=train_sampler,
                                      worker_init_fn=ignore_stop_signals, drop_last=True)
    # Evaluation must count every test sample exactly once, so no sampler padding here:
    # a strided shard per rank, of unequal sizes when the set does not divide.
    test_shard = Subset(test_set, range(run.rank, len(test_set), run.world_size))
    test_loader = common.make_loader(test_shard, 1000, run, args, ignore_stop_signals)

    # On the meta device a model has shapes and no memory: building it initialises nothing.
    # shard() splits each parameter over the ranks first: to_empty() allocates only this rank's
    # shards, and rank 0's copy is broadcast into them: only rank 0 holds the whole model.
    with torch.device("meta"):
        model = common.build_model(args, seed=args.seed)
    shard(model, run, args).to_empty(device=run.device)
    set_model_state_dict(model, common.build_model(args, seed=args.seed).state_dict()
                         if run.is_main else {}, options=StateDictOptions(
                             full_state_dict=True, broadcast_from_rank0=True))
    held = sum(p.to_local().numel() for p in model.parameters())  # this rank's shards
    total = sum(p.numel() for p in model.parameters())
    common.log(run, f"FSDP2: each rank holds {held:,} of the {total:,} parameters "
                    f"({100 * held / total:.1f}%), and as much of their gradients and "
                    f"optimizer state")
    # The optimizer comes after shard(): it must hold the sharded parameters.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = common.lr_schedule(optimizer, args, plan, len(train_loader))
    latest = args.out_dir / "checkpoint.pt"
    settings = common.run_settings(__file__, args, plan, train_set)  # saved: see resume()
    # Restarted: continue from what this run saved since its start, if it did (--resume is
    # for the first attempt).
    if restarted(run):
        args.resume = own_checkpoint(latest, settings, run) or args.resume
    start_epoch, position, rng = 0, EPOCH_START, None
    if args.resume:
        start_epoch, position, rng = resume(args.resume, run, model, optimizer, scheduler,
                                            settings)

    def save(epochs_done, step=0, loss_sum=None, samples=0):
        """Every rank calls this: the partial sums and RNG states are gathered from all."""
        sums = torch.tensor([0.0 if loss_sum is None else loss_sum.item(), samples],
                            dtype=torch.float64, device=run.device)
        dist.all_reduce(sums)  # the epoch's sums so far, over every rank's samples
        rng_states = [None] * run.world_size
        dist.all_gather_object(rng_states, rng_state())  # every rank's own
        done = {"step": step, "loss_sum": position["loss_sum"] + sums[0].item(),
                "samples": position["samples"] + int(sums[1].item())}  # the epoch so far
        # The whole state, gathered to rank 0's CPU a tensor at a time (the others get {}).
        model_state, optim = get_state_dict(model, optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if run.is_main:  # the only rank that holds the gathered state: 07's file, atomically
            numbers = {name: i for i, (name, _) in enumerate(model.named_parameters())}
            common.save_torch(latest, {"model": model_state, "optimizer": rekeyed(optim, numbers),
                                       "scheduler": scheduler.state_dict(), "epoch": epochs_done,
                                       "position": done if step else None, "rng": rng_states,
                                       "run": settings})
        dist.barrier()  # no rank may read the checkpoint before it is complete

    def after_step(step, loss_sum, samples):
        """Checkpoint every --checkpoint-every steps; on an agreed stop request, save and stop."""
        stopping = stop.agreed(run)
        if stopping or (args.checkpoint_every and step % args.checkpoint_every == 0):
            save(epoch, step, loss_sum, samples)
        if stopping:
            why = stop.requested or "a stop signal to another rank"
            common.log(run, f"stopping at step {step} of epoch {epoch + 1} ({why}): "
                            f"checkpoint saved in {latest}")
        return stopping

    test = None
    with common.Progress(run, args, steps_per_epoch=len(train_loader)) as progress:
        for epoch in range(start_epoch, args.epochs):
            common.seed_everything(args.seed, epoch, run.rank)  # as in 02: exact resume
            train_sampler.set_epoch(epoch)
            train_sampler.skip = position["step"] * plan.per_rank  # what a checkpoint covers
            progress.start_epoch(epoch, steps_done=position["step"])
            train_loss = train_one_epoch(model, train_loader, optimizer, scheduler, run, plan,
                                         progress, position, rng, after_step)
            if train_loss is None:  # asked to stop, and checkpointed
                raise SystemExit(EXIT_STOPPED)
            position, rng = EPOCH_START, None  # the next epoch starts at its beginning
            samples_per_sec = progress.end_epoch()
            test = evaluate(model, test_loader, run)
            results.epoch(epoch, train_loss, test, samples_per_sec, scheduler.last_step_lr())
            save(epoch + 1)
    if test is None:  # resumed a finished run: evaluate only
        test = evaluate(model, test_loader, run)
    results.summary(__file__, args, plan, test, progress, nodes=nodes,  # + what each rank held
                    **held_per_rank(model, optimizer, run))
    dist.destroy_process_group()


if __name__ == "__main__":
    common.run_main(main)
