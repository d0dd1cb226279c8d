"""The checked twins of step 07's restart mechanics (08 and 09 take them in too).

take_in(step), before the step's main() runs, replaces its plain versions by these (same
training, one-line failures): StopRequest (a second signal, or one before the first step, ends
at once; a vote about once a second), ignore_stop_signals (SIGINT too), run_settings (the data's
fingerprint, model, learning rate), own_checkpoint (only this run's: adopted), resume (checked
reading, check_same_sample_order, settable random states); it refuses restarts without a fresh
store (check_restart_store). The --out-dir lock (claim_out_dir) comes in with common.Metrics.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import itertools
import os
import signal
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from . import checkpoint, data
from .errors import STOP_SIGNALS, UserError, interrupt
from .ranks import log

EXIT_STOPPED = 75  # "temporary failure, try again" (sysexits.h): stopped early, resumable


class ResumableSampler(DistributedSampler):
    """Step 02's sampler, able to start mid-epoch: it skips the samples a checkpoint covers
    (the same seed and epoch give the same order, so they are the ones already trained on)."""

    skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self):
        return super().__len__() - self.skip


class StopRequest:
    """A stop signal means "stop soon": SLURM sends SIGTERM before it preempts a job or at the
    time limit (USR1 or USR2 with --signal), and kills after KillWait (30 s by default);
    torchrun forwards SIGTERM, SIGHUP and SIGQUIT (and those of --signals-to-handle) to its
    workers and kills them after --shutdown-timeout (30 s). Stopping mid-step would leave nothing
    to save, so the handler only takes note; about once a second the ranks vote, at the same step.

    A request that cannot become a checkpoint ends the process at once (errors.Interrupted, exit
    128 + the signal's number): one before the first vote (no step trained yet: nothing to save),
    and a second one (whoever sends it twice means now). Ctrl-C (SIGINT) always ends at once.
    "Second" means at least REPEAT_AFTER_S after the first: one preemption often arrives twice
    within a second or two (SLURM signals every process of the job step, and torchrun forwards
    the signal it got, once more when its own shutdown is interrupted by a second one; seen on
    the two-node test cluster), and that repeat is the same request."""

    REPEAT_AFTER_S = 5.0

    def __init__(self):
        self.requested = None  # the name of the signal that asked this rank to stop
        self.requested_at = None
        self.steps, self.next_vote, self.started = 0, 1, time.monotonic()
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:
            if time.monotonic() - self.requested_at < self.REPEAT_AFTER_S:
                return  # the same request, delivered twice
            raise interrupt(signum, f"a second stop signal ({name} after {self.requested})")
        if not self.steps:
            raise interrupt(signum, f"{name} before the first training step")
        self.requested, self.requested_at = name, time.monotonic()

    @property
    def reason(self) -> str:
        return self.requested or "a stop signal to another rank"

    def agreed(self, run) -> bool:
        """Call after every step on every rank: True on all ranks if any rank was asked."""
        self.steps += 1
        if self.steps < self.next_vote:
            return False
        pace = self.steps / (time.monotonic() - self.started)  # steps per second so far
        votes = torch.tensor([float(self.requested is not None), pace], device=run.device)
        dist.all_reduce(votes)  # any request stops all; the mean pace times the next vote
        self.next_vote = self.steps + max(1, int(votes[1] / run.world_size))  # in ~1 s
        return bool(votes[0] > 0)


def rng_state() -> dict:
    """This process's random state: what dropout draws next (on the GPU, when there is one)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # a CPU tensor too
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])  # CPU tensors: checkpoints load to the CPU
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])


# The settings that decide which samples the rest of an epoch trains, and in which order.
SAMPLE_ORDER = ("step", "data", "train_samples", "seed", "global_batch")


def run_settings(script: str, args, plan, train_set) -> dict:
    """What makes a run the same run, recorded in every checkpoint: the step, the data (its
    labels' fingerprint: MNIST and the synthetic digits differ) and its size, the seed, the
    global batch, the model's shape and the learning rate, its scaling and warm-up. (Not the
    world size: with the same global batch, any world size trains the same samples in the same
    steps.)"""
    labels = getattr(train_set, "labels", None)
    fingerprint = (hashlib.sha1(labels.numpy().tobytes()).hexdigest()[:16]
                   if labels is not None else "unknown")
    return {"step": Path(script).name, "data": fingerprint, "train_samples": len(train_set),
            "seed": args.seed, "global_batch": plan.global_batch, "width": args.width,
            "dropout": args.dropout, "lr": args.lr, "lr_scaling": args.lr_scaling,
            "warmup_steps": args.warmup_steps}


def differences(saved, current: dict, keys) -> list[str]:
    """`seed 0 -> 1` for each setting in `keys` that differs."""
    if not isinstance(saved, dict):
        return ["settings (the checkpoint does not record them)"]
    return [f"{key} {saved.get(key)!r} -> {current[key]!r}" for key in keys
            if saved.get(key) != current[key]]


def own_checkpoint(latest: Path, settings: dict, run) -> Path | None:
    """The checkpoint a restarted run continues from: `latest` if this run's settings wrote it.
    Another run's checkpoint in the same --out-dir (a finished one, say) is left alone: adopting
    it would report that run's results under this run's flags."""
    if not latest.is_file():
        return None
    return adopted(latest, checkpoint.load(latest).get("run"), settings, run)


def adopted(latest: Path, saved: dict | None, settings: dict, run) -> Path | None:
    """`latest` if the settings `saved` with it are this run's; else None, and a line why (and
    what then happens to it: this run's first save replaces it, as a fresh run's does)."""
    differ = differences(saved, settings, settings)
    if differ:
        log(run, f"not resuming from {latest}: another run wrote it ({', '.join(differ)}); "
                 f"starting afresh: this run's first checkpoint replaces it")
        return None
    return latest


_out_dir_lock = None  # the lock's descriptor, open for the life of the process: closing unlocks
_claimed = set()  # the --out-dirs this process has claimed


def claim_out_dir(out_dir: Path, run) -> None:
    """One run at a time in an --out-dir: two runs at once would replace each other's
    checkpoints, and a restart of one could continue from the other's. Rank 0 holds an
    exclusive lock on <out-dir>/.lock for as long as it lives; the kernel releases it when the
    process ends, however it ends, so a restart or a requeue is never locked out. A second run
    is refused, on every rank, in one line naming the first.
    (Where the filesystem has no locks, some Lustre mounts, nothing is checked.)
    Steps 00-06 claim theirs when metrics.Metrics starts; a second call is a no-op."""
    if Path(out_dir).absolute() in _claimed:  # (every rank records it: all return here)
        return
    holder, problem = None, None
    if run.is_main:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            problem = checkpoint.foreign(out_dir / ".lock")  # a hard link, a FIFO: refused
            holder = None if problem else lock_for_life(out_dir / ".lock")
        except OSError as err:
            if err.errno == errno.ELOOP:  # a symbolic link: never written through
                problem = (f"{out_dir / '.lock'} is a symbolic link; not writing through it. "
                           f"Remove it (a run makes it a plain file)")
        except ImportError:
            pass  # no locks here, or no --out-dir yet: writing there will say why
    said = [holder, problem]
    if dist.is_initialized():
        dist.broadcast_object_list(said, src=0)
    if said[1]:
        raise UserError(said[1])
    if said[0]:
        raise UserError(f"--out-dir {out_dir} is in use by another run ({said[0]}): two runs "
                        f"in one --out-dir would replace each other's checkpoints. Give each "
                        f"run its own --out-dir")
    _claimed.add(Path(out_dir).absolute())


def lock_for_life(path: Path) -> str | None:
    """Lock `path` until this process ends; None, or the holder's line if another has it.

    A flock on a read-only descriptor: one open for writing would keep the filesystem from
    being remounted read-only (mount says "busy"). NFS emulates flock with POSIX locks, which
    need a writable descriptor: there, lockf on one. Forked children (DataLoader workers)
    close their copy: a worker that outlives a killed rank 0 by a second must not hold the
    lock against its restart.
    Every open is O_NOFOLLOW: a symbolic link planted as .lock would have us write the holder's
    line into whatever it names (ELOOP instead: claim_out_dir refuses)."""
    import fcntl  # (POSIX)
    global _out_dir_lock
    nofollow = os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NONBLOCK | nofollow, 0o644)  # (FIFO)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise
        except OSError:  # EBADF: flock emulated by POSIX locks (NFS)
            os.close(fd)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | nofollow, 0o644)
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # (EAGAIN or EACCES: held)
        os.close(fd)
        with open(os.open(path, os.O_RDONLY | nofollow), encoding="utf-8",
                  errors="replace") as f:
            return f.read(200).strip() or "a process"
    _out_dir_lock = fd
    os.register_at_fork(after_in_child=lambda: os.close(fd))
    with open(os.open(path, os.O_WRONLY | os.O_TRUNC | nofollow), "w") as f:  # (closed again)
        f.write(f"process {os.getpid()} on {socket.gethostname()}\n")
    return None


def check_same_sample_order(saved: dict, settings: dict, path: Path) -> None:
    """A checkpoint from the middle of an epoch records how many steps of it were trained; the
    rest of the epoch is the rest of the same shuffled order only with the same data, seed and
    global batch. Anything else would skip some samples and train others twice: refuse, naming
    what differs. (At an epoch's end any setting may change: the next epoch starts afresh.)"""
    if not saved.get("position"):
        return
    differ = differences(saved.get("run"), settings, SAMPLE_ORDER)
    if differ:
        raise UserError(f"checkpoint {path} was written in the middle of an epoch, by a run "
                        f"with other settings ({', '.join(differ)}): continuing it would skip "
                        f"some samples and repeat others. Resume with that run's settings, or "
                        f"from a checkpoint written at the end of an epoch")


def ignore_stop_signals(worker_id):
    """DataLoader workers get SLURM's SIGTERM (and a terminal's Ctrl-C) too, and one dying of it
    would fail its rank before the rank can save: they ignore the stop signals and SIGINT, and
    end with their rank (errors.run_main kills them; a rank killed outright leaves workers that
    notice within seconds and exit)."""
    data.seed_worker(worker_id)
    for signum in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(signum, signal.SIG_IGN)



def restarted() -> bool:
    """True in a group that torchrun restarted or a job that SLURM requeued."""
    return any(int(os.environ.get(name, 0)) > 0
               for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def check_restart_store() -> None:
    """torchrun --max-restarts restarts the group, and by default the new group meets at the
    same store as the dead one (hosted by node 0's agent), where the dead group's addresses are
    still written: gloo then connects to processes that no longer exist (pytorch/pytorch#135712).
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, set where torchrun starts, gives every round a fresh
    store hosted by its rank 0."""
    if (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        raise UserError("torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
                        "torchrun's environment, or a restarted group reads the dead group's "
                        "addresses and cannot connect (pytorch/pytorch#135712)")


def resume(path: Path, run, model, optimizer, scheduler, settings: dict):
    """07's resume(), checked: the epoch to continue, the position in it, this rank's RNG."""
    saved = checkpoint.restore(path, run, model, optimizer, scheduler, mid_epoch=True)
    return continue_from(saved, settings, path, run)


def continue_from(saved: dict, settings: dict, path: Path, run):
    """Where a loaded checkpoint continues (07, 08): checked to be the same sample order."""
    check_same_sample_order(saved, settings, path)
    position = saved.get("position") or {"step": 0, "loss_sum": 0.0, "samples": 0}
    states = saved.get("rng") or []
    rng = states[run.rank] if position["step"] and len(states) == run.world_size else None
    log(run, f"resumed at step {position['step']} of epoch {saved['epoch'] + 1}")
    return saved["epoch"], position, rng


def take_in(step: dict) -> None:
    """Replace the plain restart mechanics of step 07 (or 08, 09) by the checked ones above."""
    check_restart_store()  # before anything: a restarted group must not meet at a stale store
    step.update(StopRequest=StopRequest, ignore_stop_signals=ignore_stop_signals,
                set_rng_state=set_rng_state, rng_state=rng_state, restarted=restarted,
                run_settings=functools.partial(run_settings, step["__file__"]),
                own_checkpoint=own_checkpoint, resume=resume)
