"""What the harness checks around step 09, whose own functions are its own (around.py):

- 07's (step07_fault_tolerance.around): the store check, the checked end_now;
- reading a DCP folder: torch's dcp.load and FileSystemReader.read_data, wrapped while 09 runs
  (09 passes its own SafeReader and SafePlanner, which run no code from a file): the folder is
  complete and reads without running code (complete_folder), a shard outside it or a damaged
  file is one line naming it, the epoch, position and schedule loaded are checked
  (checkpoint.check_values), and a signal during the load ends the run as that signal.
A background save that fails (a full disk) is 09's own to handle (Commits.agree): nothing here.
dcp_reading.py holds the readers; its names are re-exported here (the tests use them).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from . import checkpoint, step07_fault_tolerance
from .dcp_reading import (  # noqa: F401 -- re-exported: the tests use them here
    METADATA_GLOBALS, MetadataUnpickler, SafeReader, OutsideFolder, check_inside,
    UnreadableFile, why, SafePlanner, complete_folder, first_failure, root_cause,
    one_line_errors, raise_interrupts, load, read_by_file, rng_state)

TORCH = {"load": dcp.load, "read_data": FileSystemReader.read_data}


def checked_load(state_dict, *, checkpoint_id=None, storage_reader=None, **kwargs):
    """torch's dcp.load, as 09 calls it: the folder complete and its .metadata plain data
    first (read by 09's own SafeReader first: never by torch's plain one, which runs what a
    pickle names), DCP's failures in one line, and the values loaded into "extra" checked."""
    own = type(storage_reader) if storage_reader is not None and (
        type(storage_reader).read_metadata is not FileSystemReader.read_metadata) else None
    folder = complete_folder(getattr(storage_reader, "path", None) or checkpoint_id, own)
    with one_line_errors(folder), warnings.catch_warnings():  # (export: no group, and says so)
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        TORCH["load"](state_dict, checkpoint_id=checkpoint_id, storage_reader=storage_reader,
                      **kwargs)
    if isinstance(state_dict.get("extra"), dict):
        checkpoint.check_values(state_dict["extra"], folder)  # an edited epoch: one line


def read_data_by_file(self, plan, planner):
    """torch's FileSystemReader.read_data, one file at a time: a damaged file is named."""
    return read_by_file(self, plan, planner, TORCH["read_data"])


@contextlib.contextmanager
def around(script: Path):
    """07's checks, and torch's DCP functions checked while 09 runs (put back after)."""
    with step07_fault_tolerance.around(script):
        dcp.load = checked_load
        FileSystemReader.read_data = read_data_by_file
        try:
            yield
        finally:
            dcp.load = TORCH["load"]
            FileSystemReader.read_data = TORCH["read_data"]
