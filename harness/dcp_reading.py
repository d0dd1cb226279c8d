"""Reading step 09's DCP folders without running code, and DCP's failures in one line.

Used around step 09 (step09_dcp_checkpoint.py, which re-exports every name here). torch 2.14's
DCP reads `.metadata` with plain `pickle.load`, and the non-tensor values of a state dict with
`torch.load(weights_only=False)`: a replaced file would run whatever it holds. Every load goes
through SafeReader and SafePlanner, which accept plain data and DCP's own classes only; a folder
is complete when its `.metadata` is (complete_folder); one_line_errors turns DCP's
CheckpointException into the one line of the rank whose read failed. Each rank's random state
(rng-rank<R>.pt) is read with weights_only=True, and checked on every rank together (rng_state).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import pathlib
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch.distributed.checkpoint.planner import LoadPlan
from torch.futures import Future

from .checkpoint_reading import rng_problem
from .errors import Interrupted, PeerFailure, UserError, first_line
from .ranks import log


# ---------------------------------------------------------------- reading without running code
# What a DCP .metadata holds (checked on checkpoints of torch 2.14): DCP's own dataclasses,
# sizes, dtypes, layouts, paths. Classes only, looked up by exact name: a dotted name such as
# "os.system" would otherwise reach any function through a module's attributes.
METADATA_GLOBALS = {
    **{(dcp_metadata.__name__, name): cls for name, cls in vars(dcp_metadata).items()
       if isinstance(cls, type) and cls.__module__ == dcp_metadata.__name__},
    ("torch", "Size"): torch.Size,
    # Private names, looked up: one a torch lacks is left out (its .metadata is then refused)
    **{(module.__name__, name): getattr(module, name)
       for module, name in [(dcp_filesystem, "_StorageInfo"),
                            (torch.serialization, "_get_layout")]  # name -> layout
       if hasattr(module, name)},
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
        check_inside(Path(self.path), getattr(metadata, "storage_data", None))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner) -> Future:
        return read_by_file(self, plan, planner, FileSystemReader.read_data)


def read_by_file(reader, plan: LoadPlan, planner, read) -> Future:
    """torch's read_data (`read`), one file at a time, so that a file that cannot be read
    (truncated, overwritten, missing) is named: torch's own error says only what failed."""
    per_file: dict[str, list] = {}
    for item in plan.items:
        per_file.setdefault(reader.storage_data[item.storage_index].relative_path,
                            []).append(item)
    for relative_path, items in per_file.items():
        try:
            read(reader, dataclasses.replace(plan, items=items), planner).wait()
        except Exception as err:  # noqa: BLE001 -- zip, pickle, I/O errors, ...
            raise UnreadableFile(str(Path(reader.path) / relative_path), why(err)) from None
    done: Future = Future()
    done.set_result(None)
    return done


class OutsideFolder(ValueError):
    """A .metadata that names a shard outside its checkpoint folder."""


def check_inside(folder: Path, storage_data) -> None:
    """Every file a .metadata names must lie inside its folder: DCP joins the folder and each
    saved relative path, so `../other/__1_0.distcp` (or an absolute path, or a link in the
    folder) would load a shard from elsewhere."""
    if not isinstance(storage_data, dict):
        return  # (torch then fails on it itself: one line, see one_line_errors)
    root = folder.resolve()
    for info in storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not (root / name).resolve().is_relative_to(root):
            raise OutsideFolder(f"it names {name!r}, a file outside {root}")
        if not (root / name).exists():  # (a FIFO is: opening it blocks, as on a hung NFS)
            raise MissingFile(f"its .metadata names {name!r}, which is not in it")


class MissingFile(ValueError):
    """A .metadata that names a shard its folder lacks (copied in part, a file deleted)."""


class UnreadableFile(Exception):
    """A checkpoint file that could not be read: (its path, why). Plain strings: DCP sends a
    rank's exception to every rank."""


def why(err: BaseException) -> str:
    """An error in one line; for torch's weights-only unpickler, the line that says what it met
    (its first line only says that it failed)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        detail = [line for line in lines[1:] if not line.startswith(("Please file", "Check the"))]
        return f"{type(err).__name__}: {detail[0][:160] if detail else lines[0][:160]}"
    return f"{type(err).__name__}: {first_line(err, 160)}"


class SafePlanner(DefaultLoadPlanner):
    """DCP's default planner, but a saved value that is not a tensor (an epoch, the scheduler's
    state) must load with weights_only=True before it is loaded at all."""

    def load_bytes(self, read_item, value):
        torch.load(value, weights_only=True)  # raises on anything but plain data
        value.seek(0)
        super().load_bytes(read_item, value)  # the same bytes, now known to be plain data


def complete_folder(path: Path, own_reader: type | None = None) -> Path:
    """The checkpoint folder `path` names (or links to), if a save finished writing it and its
    .metadata holds nothing but metadata. `own_reader`: the step's own safe reader (09's
    SafeReader), read first, so that its refusal is the one that runs; this one's then names a
    shard outside the folder."""
    folder = Path(path).resolve()
    if not (folder / ".metadata").is_file():
        raise UserError(f"{path} is not a complete DCP checkpoint: no .metadata in {folder} (a "
                        f"save that did not finish, or not a checkpoint of step 09)")
    failed = []
    for reader in dict.fromkeys([own_reader or SafeReader, SafeReader]):
        try:
            reader(folder).read_metadata()
        except Exception as err:  # noqa: BLE001 -- pickle errors, truncated file, ...
            failed.append(err)
    outside = [err for err in failed if isinstance(err, OutsideFolder)]
    if outside:
        raise UserError(f"{folder / '.metadata'} reaches outside its checkpoint folder: "
                        f"{outside[0]}; not loading it")
    missing = [err for err in failed if isinstance(err, MissingFile)]
    if missing:
        raise UserError(f"checkpoint {folder} is incomplete: {missing[0]} (copied in part?); "
                        f"not loading it")
    if failed:
        raise UserError(f"{folder / '.metadata'} is damaged or is not a DCP checkpoint's "
                        f"metadata; not loading it ({type(failed[0]).__name__}: "
                        f"{first_line(failed[0], 120)})")
    return folder


def first_failure(err: CheckpointException) -> BaseException | None:
    """DCP raises one CheckpointException for every rank's failures (the same on every rank:
    it is sent from the coordinator); the first one says why."""
    failure = next(iter(err.failures.values()), None)
    return failure[0] if isinstance(failure, tuple) else failure


def root_cause(err: CheckpointException) -> str:
    cause = first_failure(err)
    return f"{type(cause).__name__}: {first_line(cause, 160)}" if cause else str(err)


@contextlib.contextmanager
def one_line_errors(folder: Path):
    """Around dcp.load: a checkpoint that does not fit, or holds what is not data, is one line.
    (CheckpointException is a BaseException: `except Exception` would let it through as a
    traceback.)"""
    try:
        yield
    except CheckpointException as err:
        raise_interrupts(err)
        cause = first_failure(err)
        if isinstance(cause, UnreadableFile):  # read, but not as a checkpoint's file
            path, reason = cause.args
            if "unsupported global" in reason.lower():  # a class or function: code
                raise UserError(f"checkpoint file {path} holds something other than data; not "
                                f"loading it ({reason})") from None
            raise UserError(f"checkpoint file {path} is damaged or unreadable; not loading it "
                            f"({reason})") from None
        raise UserError(f"checkpoint {folder} does not fit this model ({root_cause(err)})"
                        ) from None


def raise_interrupts(err: CheckpointException) -> None:
    """A signal that interrupted a rank during dcp.load ends the run as that signal does, not as
    a checkpoint that does not fit: DCP catches every exception, KeyboardInterrupt too, and
    sends it to every rank. The rank that got the signal raises it again; the others name it."""
    me = dist.get_rank() if dist.is_initialized() else 0
    interrupted = {rank: failure[0] for rank, failure in err.failures.items()
                   if isinstance(failure[0], (KeyboardInterrupt, Interrupted))}
    if me in interrupted:
        raise interrupted[me] from None
    for rank, signal in interrupted.items():
        why = str(signal) or "interrupted (SIGINT)"  # (a KeyboardInterrupt says nothing)
        raise PeerFailure(f"rank {rank} was interrupted while it loaded the checkpoint ({why})")


def load(state: dict, folder: Path) -> None:
    """dcp.load into `state` (in place), as step 09 calls it."""
    with one_line_errors(folder):
        dcp.load(state, storage_reader=SafeReader(folder), planner=SafePlanner())


def rng_state(folder: Path, run) -> dict | None:
    """This rank's random state as the checkpoint saved it, when the checkpoint was written by as
    many ranks as this run has; otherwise None (the streams of another world size differ).
    Every rank reads its own file, so every rank learns whether all could: a rank whose file
    is damaged would otherwise leave the others waiting in the next collective until
    --timeout. All stop with the first damaged file's line (exit 2)."""
    saved = sorted(folder.glob("rng-rank*.pt"))
    if len(saved) != run.world_size:
        log(run, f"note: the checkpoint was written by {len(saved)} ranks, this run has "
                 f"{run.world_size}: random streams restart from the seed")
        return None
    path = folder / f"rng-rank{run.rank}.pt"
    state, failed = None, None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # to the CPU: see 07
        if not (isinstance(state, dict) and torch.is_tensor(state.get("cpu"))
                and state["cpu"].dtype == torch.uint8):
            failed = (f"{path} is damaged or is not a random state; not loading it (a "
                      f"{type(state).__name__} without a CPU random state)")
    except Exception as err:  # noqa: BLE001 -- not plain data, empty, truncated, ...
        failed = f"{path} is damaged or is not a random state; not loading it ({why(err)})"
    problem = None if failed else rng_problem(state)  # 07's check: torch can set it
    if problem:
        failed = f"{path} is damaged or is not a random state; not loading it ({problem})"
    everyone = [failed]
    if dist.is_initialized():
        everyone = [None] * run.world_size
        dist.all_gather_object(everyone, failed)
    failed = next((reason for reason in everyone if reason), None)
    if failed:
        raise UserError(failed)
    return state
