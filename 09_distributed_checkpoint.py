"""Step 09: every rank writes its own shards. Distributed checkpoints (DCP), on any world size.

Built on step 08b, whose rank 0 gathers the whole state into one file. Here each rank writes its
own shards with `dcp.async_save`, in the background; `dcp.load` reads N ranks' checkpoint on M;
`export` writes one plain checkpoint.pt for step 00. More: docs/fsdp.md.

Run it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a restarted group meets at a fresh store):
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 3 09_distributed_checkpoint.py --checkpoint-every 100
    python 09_distributed_checkpoint.py --resume runs/09_distributed_checkpoint/checkpoint \\
        --epochs 3  # written by 2 ranks, read by 1
    python 09_distributed_checkpoint.py export --resume runs/09_distributed_checkpoint/checkpoint

Look for: "checkpoint ...: 0.0x s blocking training, then 0.x s in the background".
"""

# The repository's checks and one-line errors (harness/__init__.py); a copied step runs without.
try: import harness  # noqa: E701, F401
except ModuleNotFoundError: pass  # noqa: E701
import errno
import json
import os
import pickle
import re
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import Subset

import common
from common import (EPOCH_START, EXIT_STOPPED, ResumableSampler, StopRequest,  # 07's
                    ignore_stop_signals, restarted, rng_state, set_rng_state)

if torch.__version__ < (2, 9):  # a behaviour, not an API: FSDP2 on gloo summed the gradients
    print(f"error: 09_distributed_checkpoint.py needs torch >= 2.9 (FSDP2 on gloo before 2.9 "
          f"summed gradients, not averaged); this is torch {torch.__version__}", file=sys.stderr)
    sys.exit(2)


def saved_settings(folder):
    """The settings of the run that wrote `folder` (its run.json: plain JSON, no code), if any."""
    try:  # (non-blocking: a FIFO planted there is no wait; at most 1 MiB: nor is a device)
        with open(os.open(folder / "run.json", os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
            return json.loads(file.read(1 << 20) or b"")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as err:  # (RecursionError: lists nested deep)
        raise common.UserError(f"{folder / 'run.json'} is damaged or unreadable "
                               f"({type(err).__name__}: {str(err)[:120]})") from None


def own_checkpoint(latest, settings, run):
    """What a restarted group continues from: the checkpoint this run saved, if any. Another
    run's in the same --out-dir (a finished one, say) is left alone: continuing it would report
    that run's results under this run's flags (common.adopted says so in a line)."""
    if not latest.exists():  # (a link to nothing does not exist)
        return None
    return common.adopted(latest, saved_settings(latest), settings, run)


def why(err, folder=None) -> str:
    """An OSError's own words (a disk can run out of inodes with bytes to spare), or torch's."""
    said = getattr(err, "strerror", None) or (str(err).strip().splitlines() or [""])[0][:160]
    if getattr(err, "errno", None) == errno.ENOSPC and os.statvfs(folder.parent).f_favail == 0:
        return f"{said} (no inodes left there, though bytes are: see df -i)"
    return said + (f"; {shutil.disk_usage(folder.parent).free / 2**20:.1f} MiB free there: disk "
                   f"full?" if folder and "inline_container" in said else "")  # (torch's writer)


def made_by_09(path) -> bool:  # the only folders 09 removes (not a checkpoint-best of yours)
    return (re.fullmatch(r"checkpoint-(epoch\d+-(step\d+|end)|copied-\d+)", path.name)
            and path.is_dir() and not path.is_symlink())


class Commits:
    """One save at a time. A checkpoint is a new folder; <out-dir>/checkpoint is a link to the
    newest complete one. Switching a link is one atomic rename, so a kill mid-save leaves the
    link on the previous checkpoint. new_folder() first waits for the last save, commits it.
    A save that fails on one rank fails on every rank (none may wait for it in a collective)."""

    def __init__(self, out_dir, run, settings):
        self.out_dir, self.run, self.settings, self.pending = out_dir, run, settings, None
        self.link = out_dir / "checkpoint"  # the newest complete checkpoint

    def new_folder(self, name: str, rng: dict):
        self.finish()
        folder, self.started_at = self.out_dir / f"checkpoint-{name}", time.perf_counter()
        if self.run.is_main and made_by_09(folder):  # a save killed before its commit left it:
            shutil.rmtree(folder)  # its old .metadata and new shards would load silently wrong
        dist.barrier()
        failed = None
        try:  # never through a link planted at the name: its target is not ours to fill
            if os.path.lexists(folder) and not made_by_09(folder):
                kind = "a symbolic link" if folder.is_symlink() else "not a folder"
                raise OSError(f"it is {kind}, and 09 writes only into folders it makes")
            folder.mkdir(exist_ok=True)
            common.save_torch(folder / f"rng-rank{self.run.rank}.pt", rng)  # its own
            if self.run.is_main:  # which run wrote it (own_checkpoint reads it)
                common.save_atomically(folder / "run.json", lambda file:
                                       file.write(json.dumps(self.settings).encode()))
        except (OSError, RuntimeError) as err:  # a full disk (torch's too), read-only, ...
            failed = why(err, folder)
        self.agree(folder, failed)
        self.folder = folder
        return folder

    def agree(self, folder, failed) -> None:
        """Every rank learns whether any failed (a collective); then all stop, in one line,
        with the failed folder removed and the link left on the last complete checkpoint."""
        everyone = [None] * self.run.world_size
        dist.all_gather_object(everyone, failed)
        failed = next((reason for reason in everyone if reason), None)
        if failed is None:
            return
        if self.run.is_main and made_by_09(folder):
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()  # every rank then says the same line
        removed = ("left the link as it was" if folder.is_symlink() else
                   "could not remove it" if folder.exists() else "removed it")
        kept = (f"the last complete checkpoint, {os.readlink(self.link)}, is unchanged"
                if self.link.is_symlink() else "no complete checkpoint was written before it")
        raise common.UserError(f"could not write checkpoint {folder}: {failed}; {removed}, {kept}")

    def started(self, future) -> None:  # dcp.async_save's: done once the shards are written
        self.pending = (future, self.folder, self.started_at, time.perf_counter())

    def finish(self) -> None:
        if self.pending is None:
            return
        (future, folder, started, returned), self.pending = self.pending, None
        try:
            future.result()
        except dcp.CheckpointException as err:  # every rank gets every rank's failures
            cause = next(iter(err.failures.values()))[0]  # (the error, its traceback)
            self.agree(folder, why(cause, folder)
                       if isinstance(cause, (OSError, RuntimeError)) else None)
            raise
        dist.barrier()  # every rank's shards are written: commit
        failed = None
        if self.run.is_main:
            try:
                self.switch_link(folder)
            except OSError as err:
                failed = (f"could not commit checkpoint {folder}: {why(err, folder)}; it is "
                          f"complete: resume from it with --resume {folder}" + (
                              f" ({self.link} still names {os.readlink(self.link)})"
                              if self.link.is_symlink() else ""))
            common.log(self.run, f"checkpoint {folder.name}: {returned - started:.2f} s blocking "
                                 f"training, then {time.perf_counter() - returned:.2f} s in the "
                                 f"background")
        said = [failed]
        dist.broadcast_object_list(said, src=0)  # no rank goes on before the commit
        if said[0]:
            raise common.UserError(said[0])

    def switch_link(self, folder) -> None:
        """The commit: one atomic rename of a new link over the old. (A run folder copied with
        `scp -r` holds a real checkpoint named checkpoint: moved aside first, removed as old.)"""
        link, temporary = self.link, self.out_dir / f".link.{time.time_ns()}"
        if os.path.lexists(link) and not link.is_symlink():  # replaced: only a link, or a copy
            if not (link / ".metadata").is_file():
                raise OSError(f"{link} is neither 09's link nor a checkpoint")
            link.rename(self.out_dir / f"checkpoint-copied-{time.time_ns()}")
        temporary.symlink_to(folder.name)  # (a new name: no one's file is replaced)
        os.replace(temporary, link)  # the commit; then the older checkpoints go
        for old in set(filter(made_by_09, self.out_dir.glob("checkpoint-*"))) - {folder}:
            shutil.rmtree(old)


class MetadataUnpickler(pickle.Unpickler):
    """.metadata is a pickle, and a pickle may name any function to call (os.system, say): here
    it may name only what DCP's metadata is made of (torch 2.14.1's reader unpickles it plainly)."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib._local", "PosixPath"), ("collections", "OrderedDict"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    def find_class(self, module, name):
        found = getattr(sys.modules.get(module), name, None)
        if ((module, name) in self.ALLOWED or isinstance(found, torch.dtype) or
                module == "torch.distributed.checkpoint.metadata" and isinstance(found, type)):
            return found
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint")


class SafeReader(dcp.FileSystemReader):
    """DCP's reader, with .metadata read by MetadataUnpickler (the rest as torch does it)."""

    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        files = {p.name for p in self.path.iterdir() if not p.is_symlink()}  # (a link: out)
        if gone := {info.relative_path for info in metadata.storage_data.values()} - files:
            raise pickle.UnpicklingError(f"{self.path} has no {min(gone)}, which .metadata names")
        return metadata


class SafePlanner(dcp.DefaultLoadPlanner):
    """DCP's planner; a saved value that is not a tensor (the epoch, the schedule) loads only if
    it is plain data (torch 2.14.1 loads it with weights_only=False, which can run code)."""

    def load_bytes(self, read_item, value):
        torch.load(value, weights_only=True)  # raises on anything but plain data
        value.seek(0)
        super().load_bytes(read_item, value)


def load(folder, model, optimizer, scheduler) -> dict:
    """dcp.load, in place: every rank reads the parts of the saved shards that its own shards
    need now, whatever the world size that wrote them (without a group: all, whole)."""
    model_state, optim = get_state_dict(model, optimizer)  # this run's shard layout
    state = {"model": model_state, "optim": optim, "extra": {
        "epoch": 0, "position": dict(EPOCH_START), "scheduler": scheduler.state_dict()}}
    dcp.load(state, storage_reader=SafeReader(folder), planner=SafePlanner())
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return state["extra"]


def resume(path, run, model, optimizer, scheduler, settings):
    """Load the folder `path` names; returns the epoch to continue, the position in it, and
    this rank's RNG state (when as many ranks wrote it: another world size draws otherwise)."""
    folder = path.resolve()
    saved = load(folder, model, optimizer, scheduler)
    scheduler.load_state_dict(saved["scheduler"])
    position, ranks = saved["position"], len(list(folder.glob("rng-rank*.pt")))
    common.check_same_sample_order(saved_settings(folder), position, settings, folder)  # 07's
    rng, failed, mine = None, None, folder / f"rng-rank{run.rank}.pt"
    if position["step"] and ranks == run.world_size:
        try:  # every rank reads its own; if one cannot, all stop (none waits for it)
            rng = torch.load(mine, map_location="cpu", weights_only=True)
            torch.Generator().set_state(rng["cpu"])  # one torch can set
        except Exception as err:  # noqa: BLE001 -- empty, cut, not a random state, ...
            failed = (f"{mine} is damaged or is not a random state; not loading it "
                      f"({type(err).__name__}: {why(err)})")
    everyone = [None] * run.world_size
    dist.all_gather_object(everyone, failed)
    if any(everyone):
        raise common.UserError(next(reason for reason in everyone if reason))
    common.log(run, f"resumed from {folder} at step {position['step']} of epoch "
                    f"{saved['epoch'] + 1}")
    return saved["epoch"], position, rng


def export(path, out, args) -> None:
    """`export --resume PATH`: the checkpoint as one plain checkpoint.pt, which a plain Net
    loads and `00_single_gpu.py --resume` evaluates. One process, no process group."""
    for signum in common.STOP_SIGNALS:  # nothing to save: a stop signal ends it at once
        signal.signal(signum, lambda n, _: common.end_now(n, f"{signal.Signals(n).name} received"))
    model = common.build_model(args, seed=args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = common.LRSchedule(optimizer)  # replaced by the saved one
    saved = load(path.resolve(), model, optimizer, scheduler)
    LambdaLR.load_state_dict(scheduler, saved["scheduler"])  # as saved: copied, not converted
    out.parent.mkdir(parents=True, exist_ok=True)
    position = saved["position"]  # kept: 00-06 refuse to continue mid-epoch
    common.save_checkpoint(out, model, optimizer, scheduler, saved["epoch"],
                           position=position if position["step"] else None)
    print(f"wrote {out} (epoch {saved['epoch']}, step {position['step']} of the next)", flush=True)


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
    """As in 08b: a rank with fewer test batches runs blank ones (each forward all-gathers)."""
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
    # 08's --mixed-precision: on GPUs, compute in bf16 (half the bytes to gather), reduce in fp32.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  output_dtype=torch.float32) if args.mixed_precision else None
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2, model):
        fully_shard(layer, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
    return model


@common.record  # torch's elastic @record: torchrun's failure summary names the error
def main():
    parser = common.parser(__doc__, __file__)
    parser.add_argument("command", nargs="?", choices=["train", "export"], default="train",
                        help="export: write the --resume checkpoint as one plain checkpoint.pt")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="compute in bf16, average gradients in fp32 (for GPUs with bf16)")
    parser.add_argument("--checkpoint-every", type=int, default=100, metavar="K",
                        help="also checkpoint every K training steps (0: once per epoch only)")
    args = parser.parse_args()  # every flag is checked here
    if args.command == "export":  # one process, no process group
        return export(args.resume, args.out_dir / "checkpoint.pt", args)
    stop = StopRequest()  # before the (slow) setup: a signal may come any time
    common.use_srun_identity()  # as in 05
    run = common.setup_distributed(args)
    if args.mixed_precision and not run.has_bf16:  # as --amp: GPUs with native bf16 only
        common.log(run, "note: --mixed-precision needs a GPU with native bf16; training in float32")
        args.mixed_precision = False
    results = common.Metrics(run, args)  # (in the repository: one run at a time per --out-dir)
    nodes = common.report_topology(run)  # as in 05
    train_set, test_set = common.load_datasets(args, run, download=run.local_rank == 0)
    plan = common.plan_batches(args, run.world_size, len(train_set))
    common.announce(run, args, plan, __file__,
                    mixed_precision="bf16/fp32" if args.mixed_precision else "off")
    train_sampler = ResumableSampler(train_set, num_replicas=run.world_size, rank=run.rank,
                                     shuffle=True, seed=args.seed)
    train_loader = common.make_loader(train_set, plan.per_rank, run, args, sampler=train_sampler,
                                      worker_init_fn=ignore_stop_signals, drop_last=True)
    test_shard = Subset(test_set, range(run.rank, len(test_set), run.world_size))  # as in 03
    test_loader = common.make_loader(test_shard, 1000, run, args, ignore_stop_signals)

    with torch.device("meta"):  # as in 08b: filled from rank 0's copy
        model = common.build_model(args, seed=args.seed)
    shard(model, run, args).to_empty(device=run.device)
    set_model_state_dict(model, common.build_model(args, seed=args.seed).state_dict()
                         if run.is_main else {}, options=StateDictOptions(
                             full_state_dict=True, broadcast_from_rank0=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = common.lr_schedule(optimizer, args, plan, len(train_loader))
    latest = args.out_dir / "checkpoint"
    settings = common.run_settings(__file__, args, plan, train_set)  # saved: see resume()
    # Restarted: continue from what this run saved since its start, if it did (--resume is
    # for the first attempt).
    if restarted(run):
        args.resume = own_checkpoint(latest, settings, run) or args.resume
    start_epoch, position, rng = 0, EPOCH_START, None
    if args.resume:
        start_epoch, position, rng = resume(args.resume, run, model, optimizer, scheduler,
                                            settings)
    # async_save writes from a background thread, whose collectives need a group of their own:
    # one that can do CPU collectives (NCCL cannot: gloo), and whose messages cannot interleave
    # with FSDP's all-gathers (on the training group gloo aborted, 3 runs of 3, torch 2.14).
    checkpoint_group = dist.new_group(backend="gloo")
    saving = Commits(args.out_dir, run, settings)

    def save(epochs_done, step=0, loss_sum=None, samples=0, wait=False):
        """Every rank calls this, and writes its own shards (in the background)."""
        sums = torch.tensor([0.0 if loss_sum is None else loss_sum.item(), samples],
                            dtype=torch.float64, device=run.device)
        dist.all_reduce(sums)  # the epoch's sums so far, over every rank's samples
        done = {"step": step, "loss_sum": position["loss_sum"] + sums[0].item(),
                "samples": position["samples"] + int(sums[1].item())}  # the epoch so far
        model_state, optim = get_state_dict(model, optimizer)  # this rank's shards, no gather
        folder = saving.new_folder(f"epoch{epochs_done + 1}-step{step}" if step
                                   else f"epoch{epochs_done}-end", rng_state())
        # Blocks while this rank's shards are copied to host memory; the writing overlaps the
        # next steps. per_thread_copy_ahead=0: the writer thread makes no CUDA stream (on GPU 0).
        saving.started(dcp.async_save({"model": model_state, "optim": optim, "extra": {
            "epoch": epochs_done, "position": done, "scheduler": scheduler.state_dict()}},
            storage_writer=dcp.FileSystemWriter(folder, per_thread_copy_ahead=0),
            process_group=checkpoint_group))
        if wait:
            saving.finish()

    def after_step(step, loss_sum, samples):
        """Checkpoint every --checkpoint-every steps; on an agreed stop request, save and stop."""
        stopping = stop.agreed(run)
        if stopping or (args.checkpoint_every and step % args.checkpoint_every == 0):
            save(epoch, step, loss_sum, samples, wait=stopping)
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
    saving.finish()  # the last save, complete before the run ends
    if test is None:  # resumed a finished run: evaluate only
        test = evaluate(model, test_loader, run)
    held = [None] * run.world_size  # what each rank holds of the parameters (a collective)
    dist.all_gather_object(held, sum(p.to_local().numel() for p in model.parameters()))
    results.summary(__file__, args, plan, test, progress, nodes=nodes, params_per_rank=held)
    dist.destroy_process_group()


if __name__ == "__main__":
    common.run_main(main)
