"""Watching a run: progress inside an epoch, samples/s, a stop on a NaN loss, and the results.

Step 00 first needs it. `Progress` sits in the training loop (one `step()` per optimizer step,
on every rank); `Metrics` writes one line and TensorBoard scalars per epoch, and summary.json at
the end. Only rank 0 prints.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import test_results, test_sums  # noqa: F401 -- steps 04-11 call them here

from .checkpoint import write_atomically, write_failure
from .errors import UserError
from .flops import peak_flops, training_flops_per_sample
from .ranks import log
from .step07_fault_tolerance import claim_out_dir

CHECK_EVERY = 10  # steps between loss checks: each is a host-device sync (and a collective)
TERMINAL_SECONDS = 0.5  # how often a terminal's live line is redrawn
LOG_FRACTION, LOG_SECONDS = 0.1, 30  # elsewhere: a line per 10 % of the epoch, or per 30 s


class Diverged(UserError):
    """The training loss became NaN or infinite."""


class Progress:
    """Sits in the training loop; call `step()` after every optimizer step, on every rank.

    - Progress: on a terminal, rank 0 redraws one live line (steps, samples/s, running loss);
      when the output is a file (SLURM logs, CI, `torchrun --tee`), it prints plain lines at
      a steady pace instead, never carriage returns. --quiet turns both off.
    - samples/s counts the steady state: the first step of a run pays one-off costs (CUDA
      context, cuDNN autotuning, torch.compile) and is timed apart (`first_step_seconds`).
    - A loss that is NaN or infinite stops the run at the next check (every CHECK_EVERY steps)
      with one line naming the step where it happened and the rank whose loss it was.
    - --profile: the profiler records a few steps.
    The running loss stays on the device; it is read only to print or to check.
    """

    def __init__(self, run, args, steps_per_epoch: int):
        self.run, self.args, self.steps_per_epoch = run, args, steps_per_epoch
        self.live = run.is_main and not args.quiet and sys.stdout.isatty()
        self.logging = run.is_main and not args.quiet and not self.live
        self.first_step_seconds = None
        self.samples = 0  # steady-state samples and seconds, all epochs of this process
        self.seconds = 0.0
        self.train_seconds = 0.0  # wall time of the training epochs, first steps included
        self.profiler = None

    def __enter__(self):
        from .profiling import profiler  # imported on use: most runs never profile

        self.profiler = profiler(self.args, self.run).__enter__()
        return self

    def __exit__(self, *exc):
        return self.profiler.__exit__(*exc)

    def _now(self) -> float:
        if self.run.device.type == "cuda":
            torch.cuda.synchronize(self.run.device)  # GPU work is asynchronous
        return time.perf_counter()

    def start_epoch(self, epoch: int, steps_done: int = 0) -> None:
        """`steps_done`: steps a resumed epoch already did before this process took over."""
        self.epoch, self.step_index, self.timed_steps, self.epoch_samples = epoch, steps_done, 0, 0
        self.bad_step = torch.full((1,), -1, device=self.run.device)  # first step of a bad loss
        self.started = self.epoch_started = self.last_print = self._now()
        self.printed_at = steps_done

    def step(self, loss_sum: torch.Tensor, samples: int, samples_so_far: int) -> None:
        """After an optimizer step: `loss_sum` is this epoch's running loss sum on this rank
        (a tensor on the device), `samples` the samples of this step, `samples_so_far` the
        epoch's samples on this rank."""
        self.step_index += 1
        self.timed_steps += 1
        if self.timed_steps == 1:  # one-off costs end here; the steady state starts
            now = self._now()
            if self.first_step_seconds is None:
                self.first_step_seconds = now - self.started
            self.started = now
        else:
            self.epoch_samples += samples
        self.bad_step = torch.where(torch.isfinite(loss_sum) | (self.bad_step >= 0),
                                    self.bad_step, self.step_index)
        every = getattr(self.args, "checkpoint_every", 0)  # 07-09: never save a NaN loss's model
        if self.step_index % CHECK_EVERY == 0 or (every and self.step_index % every == 0):
            self.check_loss()
        if self.live or self.logging:
            self._maybe_print(loss_sum, samples_so_far)
        self.profiler.step()

    def check_loss(self) -> None:
        """Stop every rank, at the same step, if any rank's loss has become NaN or infinite."""
        bad = [self.bad_step]
        if dist.is_initialized():
            bad = [torch.empty_like(self.bad_step) for _ in range(dist.get_world_size())]
            dist.all_gather(bad, self.bad_step)  # every rank calls this at the same step
        # One device-to-host copy of all ranks' steps: each .item() would be a sync of its own.
        steps = torch.cat(bad).tolist()
        bad_ranks = {rank: step for rank, step in enumerate(steps) if step >= 0}
        if bad_ranks:
            step = min(bad_ranks.values())
            ranks = ", ".join(str(r) for r, s in bad_ranks.items() if s == step)
            amp = " or train in float32 (without --amp)" if self.run.amp else ""
            advice = f"a lower --lr (now {self.args.lr:g})"
            scaling = getattr(self.args, "lr_scaling", "none")
            if scaling != "none":  # the rate that diverged was --lr times the scale
                milder = "sqrt or none" if scaling == "linear" else "none"
                advice = (f"a lower --lr (now {self.args.lr:g}, multiplied by --lr-scaling "
                          f"{scaling}), or a milder scaling ({milder})")
            raise Diverged(f"the training loss became NaN or infinite at step {step} of epoch "
                           f"{self.epoch + 1} on rank {ranks}; stopped without saving it (the "
                           f"last checkpoint is unchanged). Try {advice}{amp}")

    def _maybe_print(self, loss_sum: torch.Tensor, samples_so_far: int) -> None:
        now, done, total = time.perf_counter(), self.step_index, self.steps_per_epoch
        if self.live:
            due = now - self.last_print >= TERMINAL_SECONDS or done == total
        else:
            due = done < total and (done - self.printed_at >= LOG_FRACTION * total
                                    or now - self.last_print >= LOG_SECONDS)
        if not due:
            return
        rate = self.epoch_samples * self.run.world_size / max(now - self.started, 1e-9)
        line = (f"epoch {self.epoch + 1}: step {done}/{total} ({100 * done / total:.0f}%), "
                f"{rate:,.0f} samples/s, loss {loss_sum.item() / max(samples_so_far, 1):.4f}")
        if self.live:
            print(f"\r{line}\033[K", end="", flush=True)  # \033[K: clear to the line's end
        else:
            print(line, flush=True)
        self.last_print, self.printed_at = now, done

    def end_epoch(self) -> float | None:
        """Check the loss a last time; return this epoch's samples/s (all ranks together), or
        None when this process timed no steady step (a resumed epoch that had one step left)."""
        if self.step_index % CHECK_EVERY:  # (else step() has just checked)
            self.check_loss()
        now = self._now()
        if self.live:
            print("\r\033[K", end="", flush=True)  # the epoch's own line replaces the live one
        seconds = now - self.started
        self.train_seconds += now - self.epoch_started
        if self.timed_steps < 2:
            return None
        self.samples += self.epoch_samples
        self.seconds += seconds
        return self.epoch_samples * self.run.world_size / max(seconds, 1e-9)

    @property
    def samples_per_sec(self) -> float | None:
        if not self.seconds:
            return None
        return self.samples * self.run.world_size / self.seconds


def flop_rate(flops_per_sec: float) -> str:
    """34.5 GFLOP/s, 1.20 TFLOP/s: the unit that keeps the number short."""
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops_per_sec >= scale:
            return f"{flops_per_sec / scale:.3g} {unit}"
    return f"{flops_per_sec / 1e6:.3g} MFLOP/s"


class Metrics:
    """One line and TensorBoard scalars per epoch (rank 0), and summary.json at the end."""

    def __init__(self, run, args):
        self.run, self.out_dir, self.writer, self.train_losses = run, args.out_dir, None, []
        self.lrs = []  # the learning rate each epoch ended with
        # The model's training FLOPs per sample, counted once (flops.py): samples/s per rank
        # times this is the arithmetic each rank achieves, which MFU compares with its peak.
        self.flops_per_sample = training_flops_per_sample(args)
        # Before the first file is written there: one run at a time in an --out-dir (07-09 have
        # claimed theirs already; see claim_out_dir).
        claim_out_dir(args.out_dir, run)
        if run.is_main:
            self.writer = open_tensorboard(args.out_dir)  # on a full disk: one line, here

    def epoch(self, epoch: int, train_loss: float, test: dict, samples_per_sec: float | None,
              lr: float) -> None:
        if not math.isfinite(test["loss"]):  # the last step's update broke the weights
            raise Diverged(f"the test loss after epoch {epoch + 1} is {test['loss']}: the "
                           f"weights became NaN or infinite; stopped without saving them. Try "
                           f"a lower --lr (now {lr:g})")
        self.train_losses.append(train_loss)
        self.lrs.append(lr)
        rate = "n/a samples/s"
        if samples_per_sec is not None:
            per_rank = samples_per_sec / self.run.world_size * self.flops_per_sample
            rate = f"{samples_per_sec:,.0f} samples/s ({flop_rate(per_rank)} per rank)"
        log(self.run, f"epoch {epoch + 1}: train loss {train_loss:.4f}  test loss "
                      f"{test['loss']:.4f}  test accuracy {100 * test['accuracy']:.2f}% "
                      f"({test['correct']}/{test['samples']})  {rate}")
        if self.writer:
            scalars = {"train/loss": train_loss, "test/loss": test["loss"],
                       "test/accuracy": test["accuracy"], "train/lr": lr}
            if samples_per_sec is not None:
                scalars["train/samples_per_sec"] = samples_per_sec
            with tensorboard_errors(self.out_dir):
                for name, value in scalars.items():
                    self.writer.add_scalar(name, value, epoch + 1)
                self.writer.flush()

    def summary(self, script: str, args, plan, test: dict, progress: Progress, **extra) -> dict:
        """Write <out-dir>/summary.json (rank 0) and return what was written."""
        achieved, peak, source = None, None, None
        if progress.samples_per_sec is not None:
            achieved = progress.samples_per_sec / self.run.world_size * self.flops_per_sample
        if self.run.is_main:  # rank 0 measures or looks up its peak; ranks are alike
            bf16 = self.run.amp or bool(getattr(args, "mixed_precision", False))  # 08: FSDP2's
            peak, source = peak_flops(self.run.device, bf16=bf16)
        summary = {
            "script": Path(script).name, "world_size": self.run.world_size,
            "device": str(self.run.device), "backend": getattr(self.run, "backend", None),
            "global_batch_size": plan.global_batch, "per_rank_batch_size": plan.per_rank,
            "micro_batch_size": plan.micro_batch, "accumulation_steps": plan.accumulation_steps,
            "epochs": args.epochs, "seed": args.seed, "lr": args.lr,
            "lr_scaling": getattr(args, "lr_scaling", "none"),
            "warmup_steps": getattr(args, "warmup_steps", 0), "lrs": self.lrs,
            "train_loss": self.train_losses[-1] if self.train_losses else None,
            "train_losses": self.train_losses, "test_loss": test["loss"],
            "test_accuracy": test["accuracy"], "test_correct": test["correct"],
            "test_samples": test["samples"], "samples_per_sec": progress.samples_per_sec,
            "first_step_seconds": progress.first_step_seconds,
            "train_seconds": progress.train_seconds,
            "flops_per_sample": self.flops_per_sample, "flops_per_sec_per_rank": achieved,
            "peak_flops_per_rank": peak, "peak_source": source,
            "mfu": achieved / peak if achieved and peak else None, **extra}
        if self.run.is_main:
            write_json_atomic(self.out_dir / "summary.json", summary)
            if self.writer:
                with tensorboard_errors(self.out_dir):
                    self.writer.close()
        return summary


def open_tensorboard(out_dir: Path):
    """TensorBoard's SummaryWriter for `out_dir`, failing here, in one line, when it cannot write.

    The writer writes its event file from a thread of its own. When a write fails there (a full
    disk, a quota, a read-only filesystem), the thread keeps the error and the writer raises it
    again in the training thread, at once here or at the next write or flush, where
    tensorboard_errors turns it into one line. The thread's own traceback would only say the same
    thing a second time: it is not printed.
    """
    from torch.utils.tensorboard import SummaryWriter

    if not getattr(threading.excepthook, "quiet_for_tensorboard", False):
        threading.excepthook = _quiet_for_tensorboard(threading.excepthook)
    with tensorboard_errors(out_dir):
        # A random end to the event file's name, which is otherwise the time, the host and the
        # pid: a link planted at it beforehand would receive the events (test_real_failures).
        return SummaryWriter(log_dir=str(out_dir), filename_suffix=f".{secrets.token_hex(4)}")


def _quiet_for_tensorboard(excepthook):
    def hook(args):
        writer_thread = type(args.thread).__module__.startswith("tensorboard.summary.writer")
        if not (writer_thread and issubclass(args.exc_type, OSError)):
            excepthook(args)

    hook.quiet_for_tensorboard = True
    return hook


@contextlib.contextmanager
def tensorboard_errors(out_dir: Path):
    """A TensorBoard write that failed, as one line (see open_tensorboard)."""
    try:
        yield
    except OSError as err:
        raise UserError(f"could not write TensorBoard's event file in {out_dir}: "
                        f"{write_failure(err, out_dir / 'events')}") from None


def write_json_atomic(path: Path, data: dict) -> None:
    """Write `path` whole or not at all (checkpoint.write_atomically: a temporary file of this
    process, then a rename; two runs writing into one --out-dir never share a temporary file)."""
    try:
        write_atomically(path, lambda f: f.write((json.dumps(data, indent=2) + "\n").encode()))
    except OSError as err:
        raise UserError(f"could not write {path}: {write_failure(err, path)}") from None
