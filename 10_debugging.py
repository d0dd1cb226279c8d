"""Step 10 (side trip from 03): find a hang in minutes: three planted bugs, and torch's tools.

Collectives are paired by order alone: a rank that skips one, or makes one more, leaves the
others waiting, or (gloo) pairs two different ones. --bug skip, shape or uneven plants a mistake
learners make (find the lines marked "BUG"); --fix is the corrected code. Torch's own tools are
on: TORCH_DISTRIBUTED_DEBUG=DETAIL, the Flight Recorder and its analyser, py-spy.

Run it (any --nproc-per-node from 2; on GPUs, one per GPU):
    torchrun --standalone --nproc-per-node 2 10_debugging.py --bug skip    # or --bug shape
    torchrun --standalone --nproc-per-node 3 10_debugging.py --bug uneven
    torchrun --standalone --nproc-per-node 2 10_debugging.py --fix

Look for: each --bug run ends non-zero within --timeout (10 s here) plus a few seconds; each
failed rank prints torch's error, where it was and its Flight Recorder file. In the repository,
harness/step10_debugging.py then adds every rank's state and a diagnosis line: docs/debugging.md.
"""

# The repository's checks and one-line errors (harness/__init__.py); a copied step runs without.
try: import harness  # noqa: E701, F401
except ModuleNotFoundError: pass  # noqa: E701
import datetime
import os
import pickle
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, Subset

import common

EXIT_HANG = 3  # the exit code of a run whose collective failed


def turn_on_tools() -> None:
    """The variables are read when a process group is created, so set them before.

    NCCL's collectives return before they are done, and by default a watchdog thread ends the
    whole process (SIGABRT) once one times out: nothing raises in Python. With
    TORCH_NCCL_BLOCKING_WAIT=1 a timed-out collective raises in the thread that waits for it,
    like gloo's (gloo ignores the variable). The Flight Recorder keeps 2000 collectives by
    default on gloo from torch 2.11; on 2.8-2.10 gloo kept none unless this was set."""
    os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")


def setup(args):
    """Join the process group, as step 03 does; --timeout bounds every collective. Returns
    the run and `checked`: a second group over the same ranks for this step's own collectives.

    DETAIL wraps every group created while it is on, and DDP on a wrapped gloo group crashes
    in torch 2.14.1 and 2.15.0 (a segmentation fault while DDP is built). So the default group,
    which DDP uses, is created with DETAIL off and `checked` with DETAIL on: DETAIL checks our
    collectives, the Flight Recorder sees DDP's."""
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    device = common.choose_device(args.device, local_rank, local_ranks)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.set_debug_level(dist.DebugLevel.OFF)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    dist.set_debug_level_from_env()  # torch.distributed read the variable when imported
    checked = dist.new_group(backend=backend, timeout=timeout)
    if device.type == "cuda" and hasattr(dist.group.WORLD, "_get_backend"):  # torch 2.15's "nccl"
        backend = dist.group.WORLD._get_backend(device).name()  # is "nccl2" (private: looked up)
    return common.Run(device, rank, local_rank, world_size, backend=backend), checked


def training_shard(train_set, run, args):
    """This rank's share of the training set, and the sampler to reshuffle (None if none)."""
    if args.bug == "uneven":
        # BUG uneven: a strided shard by hand. 32N+1 samples give rank 0 33 and the others
        # 32: 5 batches of 8 against 4, so rank 0's fifth all-reduce waits for partners.
        return Subset(train_set, range(run.rank, len(train_set), run.world_size)), None
    # Fix: DistributedSampler pads with repeats until every rank has as many samples (or
    # drop_last=True drops the rest; torch.distributed.algorithms.Join lets ranks that ran out
    # shadow the others' collectives instead).
    sampler = DistributedSampler(train_set, num_replicas=run.world_size, rank=run.rank,
                                 shuffle=True, seed=args.seed)
    return train_set, sampler


def wait_until_done(done, seconds: float) -> None:
    """Wait until `done` (a torch.cuda.Event recorded after a training step) has happened, at
    most `seconds`. Under NCCL, DDP's all-reduces do not block the host: a rank whose all-reduce
    waits for a partner would run on and stop, without a word, in the next .item(). Waiting
    here, with the collective's timeout, makes an NCCL rank fail at the step gloo fails at."""
    deadline = time.monotonic() + seconds
    while not done.query():
        if time.monotonic() > deadline:
            raise RuntimeError(f"this training step's GPU work did not finish within "
                               f"{seconds:g} s (--timeout): one of DDP's all-reduces waits "
                               f"for a rank that never joined it")
        time.sleep(0.001)


def train_one_epoch(model, loader, optimizer, run, checked, progress, timeout):
    """One pass over this rank's batches; returns the mean loss over every rank's samples."""
    model.train()
    totals = torch.zeros(2, dtype=torch.float64, device=run.device)  # loss sum, samples
    for images, labels in loader:
        progress["steps"] += 1  # the rank with fewer steps is behind
        images, labels = images.to(run.device), labels.to(run.device)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()  # DDP all-reduces the gradients in here: one collective per bucket
        optimizer.step()
        if run.device.type == "cuda":  # NCCL's all-reduces do not block: wait, with a timeout
            done = torch.cuda.Event()
            done.record()
            wait_until_done(done, timeout)
        totals[0] += loss.detach().double() * len(labels)
        totals[1] += len(labels)
    dist.all_reduce(totals, group=checked)
    return (totals[0] / totals[1]).item()


def should_stop(mean_loss, run, checked, args) -> bool:
    """Early stopping once the loss is below --stop-at-loss (default: after the first epoch)."""
    wants_to_stop = mean_loss < args.stop_at_loss
    if args.bug == "skip":
        # BUG skip: the check sits in rank 0's printing block, so rank 0 alone leaves the loop
        # and the other ranks wait in their next epoch's first all-reduce.
        return run.is_main and wants_to_stop
    # Fix: decide on every rank. One all-reduced flag (stop if any rank wants to) makes the
    # decision the same everywhere, whatever each rank measured.
    flag = torch.tensor([int(wants_to_stop)], device=run.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=checked)
    return bool(flag.item())


@torch.no_grad()
def test_losses(model, test_shard, run) -> torch.Tensor:
    """The loss of every test sample in this rank's shard (11 samples on rank 0, 10 on the
    others: 10N+1 test samples)."""
    model.eval()
    images, labels = zip(*[test_shard[i] for i in range(len(test_shard))])
    logits = model(torch.stack(images).to(run.device))
    return F.cross_entropy(logits, torch.stack(labels).to(run.device), reduction="none")


def all_test_losses(losses, run, checked, args) -> torch.Tensor:
    """Every rank's per-sample test losses, on every rank (to print their median)."""
    if args.bug == "shape":
        # BUG shape: all-reduce the rank's own vector; its length depends on the rank's data.
        dist.all_reduce(losses, group=checked)
        return losses
    # Fix: reduce the counts first, then reduce tensors of one shape: each rank writes its
    # losses into its own slots of a zero vector as long as all of them together.
    counts = torch.zeros(run.world_size, dtype=torch.long, device=run.device)
    counts[run.rank] = len(losses)
    dist.all_reduce(counts, group=checked)
    everyone = torch.zeros(int(counts.sum()), device=run.device)
    start = int(counts[:run.rank].sum())
    everyone[start:start + len(losses)] = losses
    dist.all_reduce(everyone, group=checked)  # each slot written by one rank: the sum gathers
    return everyone


def watch(run, progress, args) -> None:
    """py-spy reads a running Python process's stack from outside: while a rank waits, run
    the command printed here (pip install py-spy; in a container it needs SYS_PTRACE)."""
    print(f"rank {run.rank}: pid {os.getpid()}; while it waits, py-spy dump --pid "
          f"{os.getpid()} shows where", flush=True)


def save_flight_record(rank: int, folder: Path) -> str:
    """This rank's Flight Recorder buffer (its last collectives, completed or not) as a file
    for torch's analyser (no public reader: a private function, looked up). gloo names the
    default group '' in pg_config but '0' in its entries (fr_trace: KeyError ('0', 1)), and a
    DETAIL-wrapped group '': DDP's group is kept, named '0'. (NCCL: harness/step10_diagnosis.py)"""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        return f"none: torch {torch.__version__} has no _dump_fr_trace"
    record = pickle.loads(dump(includeStackTraces=False))
    record["entries"] = [e for e in record.get("entries", []) if e["process_group"][0] == "0"]
    record["pg_config"] = {"0": {**record.get("pg_config", {}).get("", {}), "desc": "default_pg"}}
    try:  # whole or not at all (fr_trace cannot read half a file); a full disk is a line
        folder.mkdir(parents=True, exist_ok=not folder.is_symlink())  # (a link: not ours)
        common.save_atomically(folder / f"rank{rank}",
                               lambda file: file.write(pickle.dumps(record)))
    except OSError as err:
        return f"not written ({err.strerror or err})"
    return str(folder / f"rank{rank}")


def report_failure(err, run, args, progress) -> None:
    """A collective raised (gloo; NCCL with blocking wait): torch's error, where this rank was,
    its Flight Recorder file. Never returns: a gloo group whose collective failed cannot be
    destroyed cleanly, so leave at once (common.leave_at_once: os._exit, no teardown)."""
    ours = [f for f in traceback.extract_tb(err.__traceback__)
            if Path(f.filename).name == Path(__file__).name]
    where = f"{Path(__file__).name}:{ours[-1].lineno} in {ours[-1].name}" if ours else "?"
    message = (str(err).strip() or type(err).__name__).splitlines()[0]  # torch's own line
    print(f"rank {run.rank}: {message}\nrank {run.rank}: failed at {where} after "
          f"{progress['steps']} training steps", flush=True)
    folder = args.out_dir / "flight_recorder"
    print(f"rank {run.rank}: Flight Recorder record: {save_flight_record(run.rank, folder)}; "
          f"read every rank's: python -m torch.distributed.flight_recorder.fr_trace {folder}",
          flush=True)
    common.leave_at_once(EXIT_HANG)


def check_the_bug_shows(args, world_size: int) -> None:
    """A bug planted where it cannot show would end in a clean exit, not a lesson."""
    if args.bug and world_size < 2:
        raise common.UserError(f"the planted bugs need 2 or more processes, not {world_size}: "
                               f"torchrun --standalone --nproc-per-node 2 10_debugging.py "
                               f"--bug {args.bug}")
    per_rank = args.batch_per_rank or args.batch_size // world_size
    if args.bug == "shape" and args.test_samples % world_size == 0:
        raise common.UserError(f"--bug shape: --test-samples {args.test_samples} splits evenly "
                               f"over {world_size} ranks; leave it out (default 10N+1)")
    if args.bug == "uneven" and (args.train_samples % world_size == 0 or
                                 args.train_samples // world_size % max(per_rank, 1)):
        raise common.UserError(f"--bug uneven: with --train-samples {args.train_samples} rank 0 "
                               f"has no extra batch; leave it out (default 32N+1)")


def sized_for(args, n: int) -> None:
    """Small and quick, on the synthetic digits unless --data is given (no download). Sized for N
    ranks: 8 samples per rank and step, 4 steps per rank, and one sample more for rank 0."""
    args.train_samples = args.train_samples or 32 * n + 1
    args.test_samples = args.test_samples or 10 * n + 1
    if args.batch_per_rank is None:
        args.batch_size = args.batch_size or 8 * n


@common.record  # torch's elastic @record: torchrun's failure summary names the error
def main():
    if torch.__version__ < "2.8":  # (a version, not text: 2.10 > 2.8) gloo's Flight Recorder
        raise common.UserError(f"10_debugging.py needs torch >= 2.8 (the Flight Recorder's dump "
                               f"on gloo); this is torch {torch.__version__}")
    parser = common.parser(__doc__, __file__)
    choice = parser.add_mutually_exclusive_group(required=True)
    choice.add_argument("--bug", choices=["skip", "shape", "uneven"],
                        help="plant one bug (the others stay fixed)")
    choice.add_argument("--fix", action="store_true", help="run the corrected code")
    parser.add_argument("--stop-at-loss", type=float, default=10.0, metavar="LOSS",
                        help="stop early once the mean training loss is below LOSS "
                             "(default 10: after the first epoch)")
    parser.set_defaults(timeout=10, data="synthetic", batch_size=None, epochs=2, quiet=True)
    args = parser.parse_args()
    if args.lr_scaling != "none":  # a shared flag, but this step has no learning-rate schedule
        parser.error("--lr-scaling: 10_debugging.py trains at a fixed --lr (steps 00-09 scale)")
    n = int(os.environ.get("WORLD_SIZE", 1))
    sized_for(args, n)
    recorder = os.environ.get("TORCH_FR_BUFFER_SIZE", "2000 (set by 10)")  # before turn_on_tools
    check_the_bug_shows(args, n)  # before any work starts
    turn_on_tools()
    run, checked = setup(args)
    train_set, test_set = common.load_datasets(args, run, download=run.is_main)
    plan = common.plan_batches(args, run.world_size, len(train_set))
    common.log(run, f"10_debugging.py: world_size={run.world_size} "
                    f"{'bug=' + args.bug if args.bug else 'fixed'} timeout={args.timeout:g}s "
                    f"backend={run.backend} "
                    f"TORCH_DISTRIBUTED_DEBUG={os.environ['TORCH_DISTRIBUTED_DEBUG']} "
                    f"TORCH_FR_BUFFER_SIZE={recorder}")
    shard, sampler = training_shard(train_set, run, args)
    loader = common.make_loader(shard, plan.per_rank, run, args, sampler=sampler)
    test_shard = Subset(test_set, range(run.rank, len(test_set), run.world_size))
    raw_model = common.build_model(args, seed=args.seed).to(run.device)
    model = DDP(raw_model, device_ids=[run.device] if run.device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    progress = {"steps": 0}
    watch(run, progress, args)
    try:
        for epoch in range(args.epochs):
            common.seed_everything(args.seed, epoch, run.rank)
            if sampler is not None:
                sampler.set_epoch(epoch)
            mean_loss = train_one_epoch(model, loader, optimizer, run, checked, progress,
                                        args.timeout)
            common.log(run, f"epoch {epoch + 1}: mean training loss {mean_loss:.4f}")
            if should_stop(mean_loss, run, checked, args):
                common.log(run, f"stopping early: loss below {args.stop_at_loss:g}")
                break
        everyone = all_test_losses(test_losses(raw_model, test_shard, run), run, checked, args)
        common.log(run, f"median test loss over {len(everyone)} samples: "
                        f"{everyone.median().item():.4f}")
    except RuntimeError as err:  # torch raised: DETAIL's check, a timeout or a closed peer
        report_failure(err, run, args, progress)
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    common.run_main(main)
