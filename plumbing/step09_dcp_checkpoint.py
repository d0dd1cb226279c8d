"""The mechanics of step 09's distributed checkpoints (DCP) that no step teaches: a folder's
atomic commit, every rank's random state, reading without running code, export to one file.

Step 09 first needs it (09 calls dcp.async_save and dcp.load itself). A checkpoint is a folder,
<out-dir>/checkpoint-epoch<E>-step<S>, with DCP's files (every rank writes its own shards;
`.metadata`, written last, makes it complete) and each rank's random state (rng-rank<R>.pt).
<out-dir>/checkpoint is a link to the newest complete one: switching a link is one atomic
rename, so a kill during a save leaves the link on the previous checkpoint.

Nothing read from a checkpoint can run code. torch 2.14's DCP reads `.metadata` with plain
`pickle.load`, and the non-tensor values of a state dict (epoch, scheduler, ...) with
`torch.load(weights_only=False)`: a replaced file would run whatever it holds. Every load here
goes through SafeReader and SafePlanner, which accept plain data and DCP's own classes only.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pathlib
import pickle
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from . import checkpoint
from .errors import UserError, first_line
from .model import build_model
from .ranks import log
from .schedule import LRSchedule


# ---------------------------------------------------------------- reading without running code
# What a DCP .metadata holds (checked on checkpoints of torch 2.14): DCP's own dataclasses,
# sizes, dtypes, layouts, paths. Classes only, looked up by exact name: a dotted name such as
# "os.system" would otherwise reach any function through a module's attributes.
METADATA_GLOBALS = {
    **{(dcp_metadata.__name__, name): cls for name, cls in vars(dcp_metadata).items()
       if isinstance(cls, type) and cls.__module__ == dcp_metadata.__name__},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # name -> layout
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
}


class MetadataUnpickler(pickle.Unpickler):
    """pickle, refusing every global but METADATA_GLOBALS and torch's dtypes. (torch's own
    weights-only unpickler cannot be used: it refuses the FRAME opcode of the protocol DCP
    writes .metadata with.)"""

    def find_class(self, module, name):
        if (module, name) in METADATA_GLOBALS:
            return METADATA_GLOBALS[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint")


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader, reading .metadata with MetadataUnpickler instead of pickle.load
    (the rest as torch 2.14's read_metadata does)."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f"a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default planner, but a saved value that is not a tensor (an epoch, the scheduler's
    state) must load with weights_only=True before it is loaded at all."""

    def load_bytes(self, read_item, value):
        torch.load(value, weights_only=True)  # raises on anything but plain data
        value.seek(0)
        super().load_bytes(read_item, value)  # the same bytes, now known to be plain data


def complete_folder(path: Path) -> Path:
    """The checkpoint folder `path` names (or links to), if a save finished writing it and its
    .metadata holds nothing but metadata."""
    folder = Path(path).resolve()
    if not (folder / ".metadata").is_file():
        raise UserError(f"{path} is not a complete DCP checkpoint: no .metadata in {folder} (a "
                        f"save that did not finish, or not a checkpoint of step 09)")
    try:
        SafeReader(folder).read_metadata()
    except Exception as err:  # noqa: BLE001 -- pickle errors, truncated file, ...
        raise UserError(f"{folder / '.metadata'} is not a DCP checkpoint's metadata; not "
                        f"loading it ({type(err).__name__}: {first_line(err, 120)})"
                        ) from None
    return folder


def root_cause(err: CheckpointException) -> str:
    """DCP raises one CheckpointException for every rank's failures; the first one says why."""
    failure = next(iter(err.failures.values()), None)
    cause = failure[0] if isinstance(failure, tuple) else failure
    return f"{type(cause).__name__}: {first_line(cause, 160)}" if cause else str(err)


@contextlib.contextmanager
def one_line_errors(folder: Path):
    """Around dcp.load: a checkpoint that does not fit, or holds what is not data, is one line.
    (CheckpointException is a BaseException: `except Exception` would let it through as a
    traceback.)"""
    try:
        yield
    except CheckpointException as err:
        cause = root_cause(err)
        if cause.startswith("UnpicklingError"):
            raise UserError(f"checkpoint {folder} holds something other than data; not loading "
                            f"it ({cause})") from None
        raise UserError(f"checkpoint {folder} does not fit this model ({cause})") from None


def load(state: dict, folder: Path) -> None:
    """dcp.load into `state` (in place), as step 09 calls it."""
    with one_line_errors(folder):
        dcp.load(state, storage_reader=SafeReader(folder), planner=SafePlanner())


def rng_state(folder: Path, run) -> dict | None:
    """This rank's random state as the checkpoint saved it, when the checkpoint was written by as
    many ranks as this run has; otherwise None (the streams of another world size differ)."""
    saved = sorted(folder.glob("rng-rank*.pt"))
    if len(saved) != run.world_size:
        log(run, f"note: the checkpoint was written by {len(saved)} ranks, this run has "
                 f"{run.world_size}: random streams restart from the seed")
        return None
    path = folder / f"rng-rank{run.rank}.pt"
    try:
        return torch.load(path, map_location="cpu", weights_only=True)  # to the CPU: see 07
    except Exception as err:  # noqa: BLE001 -- not plain data, truncated, ...
        raise UserError(f"{path} is not a random state; not loading it ({type(err).__name__}: "
                        f"{first_line(err, 120)})") from None


class Commits:
    """One checkpoint at a time: new_folder() waits for the previous save and commits it, then
    prepares the next folder; started() takes the save's future (dcp.async_save's), finish()
    waits for it and commits it (every rank's shards written, then rank 0 switches the link)."""

    def __init__(self, out_dir: Path, run):
        self.out_dir, self.run, self.pending = out_dir, run, None
        self.folder, self.started_at = None, 0.0

    def new_folder(self, name: str, rng: dict) -> Path:
        self.finish()
        folder = self.out_dir / f"checkpoint-{name}"
        if self.run.is_main and folder.exists():  # what a killed save left behind
            shutil.rmtree(folder)
        dist.barrier()
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(rng, folder / f"rng-rank{self.run.rank}.pt")
        self.folder, self.started_at = folder, time.perf_counter()
        return folder

    def started(self, future) -> None:
        self.pending = (future, self.folder, time.perf_counter() - self.started_at,
                        self.started_at)

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
    """`09_distributed_checkpoint.py export --resume PATH`: the checkpoint as one plain
    checkpoint.pt that a plain Net loads with weights_only=True, and `00_single_gpu.py --resume`
    evaluates. One process."""
    if path is None:
        raise UserError("export needs --resume PATH: the checkpoint to export")
    folder = complete_folder(path)
    model = build_model(args, seed=args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = LRSchedule(optimizer)  # the template: the saved state is copied as it is
    # Without a process group, dcp.load reads every shard of every rank into whole tensors:
    # the same safe load as a resume, into a plain model in this one process.
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state,
             "extra": {"epoch": 0, "position": {"step": 0, "loss_sum": 0.0, "samples": 0},
                       "scheduler": scheduler.state_dict()}}
    with warnings.catch_warnings():  # "assuming the intent is to ... a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        load(state, folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    scheduler.steps_per_epoch = state["extra"]["scheduler"]["steps_per_epoch"]  # no conversion
    scheduler.load_state_dict(state["extra"]["scheduler"])
    checkpoint.save(out, model, optimizer, scheduler, state["extra"]["epoch"])
    print(f"wrote {out}: the model, optimizer and scheduler after epoch "
          f"{state['extra']['epoch']} (step {state['extra']['position']['step']} of the next)",
          flush=True)
