"""What the harness checks around step 09, whose own functions are its own (around.py):

- 07's (step07_fault_tolerance.around): the store check, the checked end_now;
- reading a DCP folder: torch's dcp.load and FileSystemReader.read_data, wrapped while 09 runs
  (09 passes its own SafeReader and SafePlanner, which run no code from a file): the folder is
  complete and reads without running code (complete_folder), a shard outside it or a damaged
  file is one line naming it, the epoch, position and schedule loaded are checked
  (checkpoint.check_values), and a signal during the load ends the run as that signal;
- a background save that fails (a full disk): dcp.async_save's future, wrapped, removes the
  half-written folder on every rank's word and says so in one line.
dcp_reading.py holds the readers; its names are re-exported here (the tests use them).
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from . import checkpoint, step07_fault_tolerance
from .errors import UserError
from .dcp_reading import (  # noqa: F401 -- re-exported: the tests use them here
    METADATA_GLOBALS, MetadataUnpickler, SafeReader, OutsideFolder, check_inside,
    UnreadableFile, why, SafePlanner, complete_folder, first_failure, root_cause,
    one_line_errors, raise_interrupts, load, read_by_file, rng_state)

TORCH = {"load": dcp.load, "async_save": dcp.async_save, "read_data": FileSystemReader.read_data}


def write_atomically(path: Path, data: bytes) -> None:
    """A temporary file, fsync, then a rename: `path` is whole or absent, never cut short."""
    checkpoint.write_atomically(path, lambda f: f.write(data))


def is_write_failure(err: BaseException | None) -> bool:
    """A save failed on its disk: an OSError (a full disk: ENOSPC, a quota, ...) or torch's
    zip writer failing (RuntimeError "[enforce fail at inline_container.cc...]"). Not a peer
    lost mid-save (gloo's RuntimeError), which errors.run_main explains."""
    return isinstance(err, OSError) or (isinstance(err, RuntimeError) and any(
        marker in str(err) for marker in ("inline_container", "PytorchStreamWriter")))


def checked_load(state_dict, *, checkpoint_id=None, storage_reader=None, **kwargs):
    """torch's dcp.load, as 09 calls it: the folder complete and its .metadata plain data
    first, DCP's failures in one line, and the values loaded into "extra" checked."""
    folder = complete_folder(getattr(storage_reader, "path", None) or checkpoint_id)
    with one_line_errors(folder), warnings.catch_warnings():  # (export: no group, and says so)
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        TORCH["load"](state_dict, checkpoint_id=checkpoint_id, storage_reader=storage_reader,
                      **kwargs)
    if isinstance(state_dict.get("extra"), dict):
        checkpoint.check_values(state_dict["extra"], folder)  # an edited epoch: one line


def read_data_by_file(self, plan, planner):
    """torch's FileSystemReader.read_data, one file at a time: a damaged file is named."""
    return read_by_file(self, plan, planner, TORCH["read_data"])


class CheckedSave:
    """dcp.async_save's future: a save that failed on its disk (on any rank: DCP tells every
    rank) removes its folder, and every rank ends with rank 0's line."""

    def __init__(self, future, folder: Path):
        self.future, self.folder = future, folder

    def __getattr__(self, name):
        return getattr(self.future, name)

    def result(self, *args, **kwargs):
        try:
            return self.future.result(*args, **kwargs)
        except CheckpointException as err:
            if is_write_failure(first_failure(err)):
                abandon(self.folder, checkpoint.write_failure(first_failure(err), self.folder))
            raise RuntimeError(f"a checkpoint save failed ({root_cause(err)})") from None


def checked_async_save(state_dict, *, checkpoint_id=None, storage_writer=None, **kwargs):
    future = TORCH["async_save"](state_dict, checkpoint_id=checkpoint_id,
                                 storage_writer=storage_writer, **kwargs)
    return CheckedSave(future, Path(getattr(storage_writer, "path", None) or checkpoint_id))


def abandon(folder: Path, reason: str) -> None:
    """Every rank calls this: the folder goes, the link stays, and every rank says rank 0's
    reason (the same line, printed once per machine)."""
    main = not dist.is_initialized() or dist.get_rank() == 0
    if main and folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder, ignore_errors=True)
    said = [reason, folder.exists()]
    if dist.is_initialized():
        dist.broadcast_object_list(said, src=0)  # after the removal: before any rank exits
    link = folder.parent / "checkpoint"
    kept = (f"the last complete checkpoint, {link.readlink()}, is unchanged"
            if link.is_symlink() else "no complete checkpoint was written before it")
    raise UserError(f"could not write checkpoint {folder}: {said[0]}; "
                    f"{'could not remove it' if said[1] else 'removed it'}, {kept}")


@contextlib.contextmanager
def around(script: Path):
    """07's checks, and torch's DCP functions checked while 09 runs (put back after)."""
    with step07_fault_tolerance.around(script):
        dcp.load, dcp.async_save = checked_load, checked_async_save
        FileSystemReader.read_data = read_data_by_file
        try:
            yield
        finally:
            dcp.load, dcp.async_save = TORCH["load"], TORCH["async_save"]
            FileSystemReader.read_data = TORCH["read_data"]
