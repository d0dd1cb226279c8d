"""Distributed checkpoints (DCP) for step 08: written in the background, committed atomically,
loaded at any world size, exported as one plain file.

Step 08 first needs it. A checkpoint is a folder, <out-dir>/checkpoint-epoch<E>-step<S>, with
DCP's files (every rank writes its own shards; `.metadata`, written last, makes it complete)
and each rank's random state (rng-rank<R>.pt). <out-dir>/checkpoint is a link to the newest
complete one: switching a link is one atomic rename, so a kill during a save leaves the link on
the previous checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import set_state_dict

from . import checkpoint
from .errors import UserError
from .model import build_model
from .ranks import log


def complete_folder(path: Path) -> Path:
    """The checkpoint folder `path` names (or links to), if a save finished writing it."""
    folder = Path(path).resolve()
    if not (folder / ".metadata").is_file():
        raise UserError(f"{path} is not a complete DCP checkpoint: no .metadata in {folder} (a "
                        f"save that did not finish, or not a checkpoint of step 08)")
    return folder


def root_cause(err: CheckpointException) -> str:
    """DCP raises one CheckpointException for every rank's failures; the first one says why."""
    failure = next(iter(err.failures.values()), None)
    cause = failure[0] if isinstance(failure, tuple) else failure
    return f"{type(cause).__name__}: {str(cause).splitlines()[0][:160]}" if cause else str(err)


def load(state: dict, folder: Path) -> None:
    """dcp.load into `state` (in place), with a failure as one line. (CheckpointException is a
    BaseException: `except Exception` would let it through as a traceback.)"""
    try:
        dcp.load(state, checkpoint_id=folder)
    except CheckpointException as err:
        raise UserError(f"checkpoint {folder} does not fit this model "
                        f"({root_cause(err)})") from None


def rng_state(folder: Path, run) -> dict | None:
    """This rank's random state as the checkpoint saved it, when the checkpoint was written by as
    many ranks as this run has; otherwise None (the streams of another world size differ)."""
    saved = sorted(folder.glob("rng-rank*.pt"))
    if len(saved) != run.world_size:
        log(run, f"note: the checkpoint was written by {len(saved)} ranks, this run has "
                 f"{run.world_size}: random streams restart from the seed")
        return None
    return torch.load(folder / f"rng-rank{run.rank}.pt", map_location="cpu", weights_only=True)


class Saver:
    """Writes one checkpoint at a time with dcp.async_save: the call blocks only while the state
    is copied to host memory, the writing overlaps the next training steps, and finish() waits
    for it, then commits it (every rank, then rank 0 switches the link)."""

    def __init__(self, out_dir: Path, run):
        self.out_dir, self.run, self.pending = out_dir, run, None
        # async_save communicates from a background thread: on the training group its messages
        # would interleave with FSDP's all-gathers (gloo aborted, 3 runs of 3). A group of its own.
        self.group = dist.new_group(backend="gloo")

    def start(self, state: dict, name: str, rng: dict) -> None:
        self.finish()
        folder = self.out_dir / f"checkpoint-{name}"
        if self.run.is_main and folder.exists():  # what a killed save left behind
            shutil.rmtree(folder)
        dist.barrier()
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(rng, folder / f"rng-rank{self.run.rank}.pt")
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=folder, process_group=self.group)
        self.pending = (future, folder, time.perf_counter() - started, started)

    def finish(self) -> None:
        if self.pending is None:
            return
        future, folder, blocked, started = self.pending
        self.pending = None
        try:
            future.result()
        except CheckpointException as err:  # a peer died mid-save: see errors.run_main
            raise RuntimeError(f"a checkpoint save failed ({root_cause(err)})") from None
        seconds = time.perf_counter() - started
        dist.barrier()  # every rank's shards are written
        if self.run.is_main:
            link, temporary = self.out_dir / "checkpoint", self.out_dir / ".checkpoint.link"
            temporary.unlink(missing_ok=True)
            temporary.symlink_to(folder.name)
            os.replace(temporary, link)  # the commit: the link now names the new folder
            for old in self.out_dir.glob("checkpoint-*"):
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)
            log(self.run, f"checkpoint {folder.name}: {blocked:.2f} s blocking training, then "
                          f"{seconds - blocked:.2f} s in the background")
        dist.barrier()


def export(path: Path | None, out: Path, args) -> None:
    """`08_fsdp2.py export --resume PATH`: the checkpoint as one plain checkpoint.pt that a plain
    Net loads with weights_only=True, and `00_single_gpu.py --resume` evaluates. One process."""
    if path is None:
        raise UserError("export needs --resume PATH: the checkpoint to export")
    folder = complete_folder(path)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            dcp_to_torch_save(folder, Path(tmp) / "all.pt")
        except CheckpointException as err:
            raise UserError(f"cannot read checkpoint {folder} ({root_cause(err)})") from None
        state = torch.load(Path(tmp) / "all.pt", map_location="cpu", weights_only=True)
    model = build_model(args, seed=args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    try:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    except (KeyError, RuntimeError, ValueError) as err:
        raise UserError(f"checkpoint {folder} does not fit this model "
                        f"({str(err).splitlines()[0][:160]})") from None
    scheduler.load_state_dict(state["extra"]["scheduler"])
    checkpoint.save(out, model, optimizer, scheduler, state["extra"]["epoch"])
    print(f"wrote {out}: the model, optimizer and scheduler after epoch "
          f"{state['extra']['epoch']} (step {state['extra']['position']['step']} of the next)",
          flush=True)
