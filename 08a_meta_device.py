"""Step 08a: build the model on the meta device: shapes, no memory; rank 0 fills in the weights.

Built on step 07 (whose restart mechanics now come from common.py). So far every rank built and
initialised the whole model, and DDP then replaced the weights by rank 0's. Here only rank 0
computes them: every rank allocates uninitialised memory, and torch's state-dict API fills it
from rank 0's copy: 07's weights, to the bit. Step 08b does the same with a sharded model.

Run it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a restarted group meets at a fresh store):
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 3 08a_meta_device.py --checkpoint-every 100

Look for: the same losses and accuracy as 07 (summary.json).
"""

# The repository's checks and one-line errors (harness/__init__.py); a copied step runs without.
try: import harness  # noqa: E701, F401
except ModuleNotFoundError: pass  # noqa: E701
import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset

import common
from common import (EPOCH_START, EXIT_STOPPED, ResumableSampler, StopRequest,  # 07's
                    ignore_stop_signals, restarted, rng_state, set_rng_state)


def own_checkpoint(latest, settings, run):
    """What a restarted group continues from: the checkpoint this run saved, if any. Another
    run's in the same --out-dir (a finished one, say) is left alone: continuing it would report
    that run's results under this run's flags (common.adopted says so in a line)."""
    if not latest.is_file():
        return None
    saved = torch.load(latest, map_location="cpu", weights_only=True)
    return common.adopted(latest, saved.get("run"), settings, run)


def resume(path, run, model, optimizer, scheduler, settings):
    """Load `path`; returns the epoch to continue, the position in it, this rank's RNG state."""
    saved = common.restore_checkpoint(path, run, model, optimizer, scheduler)
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
            with model.no_sync() if i < len(micro_batches) - 1 else nullcontext():  # as in 03
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
    correct answers, samples), then the sums are added up over all ranks."""
    sums = common.test_sums(model, loader, run)
    dist.all_reduce(sums)
    return common.test_results(sums)


@common.record  # torch's elastic @record: torchrun's failure summary names the error
def main():
    parser = common.parser(__doc__, __file__)
    parser.add_argument("--bucket-cap-mb", type=float, metavar="MB", help="as in 03")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, help="as in 04")
    parser.add_argument("--checkpoint-every", type=int, default=100, metavar="K",
                        help="also checkpoint every K training steps (0: once per epoch only)")
    args = parser.parse_args()  # every flag is checked here
    stop = StopRequest()  # before the (slow) setup: a signal may come any time
    common.use_srun_identity()  # as in 05
    run = common.setup_distributed(args)
    results = common.Metrics(run, args)  # (in the repository: one run at a time per --out-dir)
    nodes = common.report_topology(run)  # as in 05
    # One download per node (its local rank 0): each node may have its own disk.
    train_set, test_set = common.load_datasets(args, run, download=run.local_rank == 0)
    plan = common.plan_batches(args, run.world_size, len(train_set))
    compiled = common.compile_choice(args, run)  # default: on GPUs, if the node can build
    common.announce(run, args, plan, __file__, compile="on" if compiled else "off")
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
    # to_empty() allocates it (uninitialised), and rank 0's whole copy is broadcast into it,
    # one tensor at a time (torch's state-dict API): the same weights as 07's.
    with torch.device("meta"):
        raw_model = common.build_model(args, seed=args.seed)
    raw_model.to_empty(device=run.device)
    set_model_state_dict(raw_model, common.build_model(args, seed=args.seed).state_dict()
                         if run.is_main else {}, options=StateDictOptions(
                             full_state_dict=True, broadcast_from_rank0=True))
    # DDP broadcasts rank 0's weights (the same here) and averages gradients in every backward().
    # device_ids: the one GPU this rank drives (None on the CPU). Compile inside the wrapper
    # (as in 04); evaluation and checkpoints keep using the plain raw_model.
    model = DDP(torch.compile(raw_model) if compiled else raw_model,
                device_ids=[run.device] if run.device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
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
        start_epoch, position, rng = resume(args.resume, run, raw_model, optimizer, scheduler,
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
        if run.is_main:  # all ranks hold the same weights: one writer is enough
            common.save_checkpoint(latest, raw_model, optimizer, scheduler, epochs_done,
                                   position=done if step else None, rng=rng_states, run=settings)
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
            test = evaluate(raw_model, test_loader, run)  # raw_model: as in 03
            results.epoch(epoch, train_loss, test, samples_per_sec, scheduler.last_step_lr())
            save(epoch + 1)
    if test is None:  # resumed a finished run: evaluate only
        test = evaluate(raw_model, test_loader, run)
    results.summary(__file__, args, plan, test, progress, nodes=nodes)
    del model  # DDP holds the process group: release it before the group is destroyed
    dist.destroy_process_group()


if __name__ == "__main__":
    common.run_main(main)
