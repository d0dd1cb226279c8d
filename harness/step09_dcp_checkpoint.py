"""The checked twins of step 09's own functions, taken in before its main() runs (twins.py).

09 writes out plain versions: dcp.async_save into a folder, a link switched to commit it, each
rank's random state in a file, dcp.load on any world size, the export to one checkpoint.pt.
take_in(step) takes in 07's twins (step07_fault_tolerance) and 08's held_per_rank (09 takes the
plain ones from common.py into its own namespace, where they are replaced), and replaces:
- Commits by the one below: a save that fails on any rank (a full disk) removes its folder on
  every rank's word, in one line; small files written atomically; run.json records the run's
  settings; a link planted at a folder's name is refused; only folders 09 names are removed;
- own_checkpoint by one that adopts only this run's folder (its run.json);
- resume and export by checked ones: a complete folder, read without running code (SafeReader,
  SafePlanner in dcp_reading.py, whose names are re-exported here: torch 2.14's DCP reads
  `.metadata` with plain pickle and saved values with weights_only=False), its values and
  sample order checked, every rank's random state checked on every rank together.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from . import checkpoint, errors, step07_fault_tolerance as fault_tolerance, step08_fsdp2
from .errors import UserError, first_line
from .model import build_model
from .ranks import log
from .schedule import LRSchedule
from .dcp_reading import (  # noqa: F401 -- re-exported: tests and 09 use them here
    METADATA_GLOBALS, MetadataUnpickler, SafeReader, OutsideFolder, check_inside, UnreadableFile, why, SafePlanner, complete_folder, first_failure, root_cause, one_line_errors, raise_interrupts, load, rng_state)


# ---------------------------------------------------------------- which run wrote a checkpoint
RUN_FILE = "run.json"  # the settings of the run that wrote the folder: plain JSON, no code


def saved_settings(folder: Path) -> dict | None:
    """The settings run.json records (None in a folder written before it existed)."""
    path = Path(folder) / RUN_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    # (A UnicodeDecodeError is a ValueError; a RecursionError, lists nested some thousand deep.)
    except (OSError, ValueError, RecursionError) as err:
        raise UserError(f"{path} is damaged or unreadable ({type(err).__name__}: "
                        f"{first_line(err, 120)})") from None


def own_checkpoint(latest: Path, settings: dict, run) -> Path | None:
    """Step 07's own_checkpoint, for a DCP folder: the link `latest` if this run's settings
    wrote the folder it names. Another run's checkpoint in the same --out-dir (a finished one,
    say) is left alone: adopting it would report that run's results under this run's flags."""
    if not latest.exists():  # (a link to nothing does not exist)
        return None
    return fault_tolerance.adopted(latest, saved_settings(latest), settings, run)


def check_same_sample_order(folder: Path, position: dict, settings: dict) -> None:
    """Step 07's check: a checkpoint from the middle of an epoch continues only with the data,
    seed and global batch that wrote it; otherwise one line naming what differs."""
    fault_tolerance.check_same_sample_order(
        {"position": position if position["step"] else None, "run": saved_settings(folder)},
        settings, folder)


def write_atomically(path: Path, data: bytes) -> None:
    """A temporary file, fsync, then a rename: `path` is whole or absent, never cut short."""
    checkpoint.write_atomically(path, lambda f: f.write(data))


def is_write_failure(err: BaseException | None) -> bool:
    """A save failed on its disk: an OSError (a full disk: ENOSPC, a quota, ...) or torch's
    zip writer failing (RuntimeError "[enforce fail at inline_container.cc...]"). Not a peer
    lost mid-save (gloo's RuntimeError), which errors.run_main explains."""
    return isinstance(err, OSError) or (isinstance(err, RuntimeError) and any(
        marker in str(err) for marker in ("inline_container", "PytorchStreamWriter")))


# The folders Commits makes (checkpoint-epoch2-step40, checkpoint-epoch3-end, and the copy that
# switch_link renames): the only ones a commit removes. checkpoint-best, kept by a user, stays.
MADE_BY_09 = re.compile(r"checkpoint-(epoch\d+-(step\d+|end)|copied-\d+)")


def made_by_09(path: Path) -> bool:
    """A real folder (not a link) whose name a run of step 09 makes."""
    return (MADE_BY_09.fullmatch(path.name) is not None and path.is_dir()
            and not path.is_symlink())


class Commits:
    """One checkpoint at a time: new_folder() waits for the previous save and commits it, then
    prepares the next folder (every rank's random state, and the run's settings); started()
    takes the save's future (dcp.async_save's), finish() waits for it and commits it (every
    rank's shards written, then rank 0 switches the link). A save that fails to write on any
    rank fails on every rank, with one line: its folder is removed (abandon)."""

    def __init__(self, out_dir: Path, run, settings: dict):
        self.out_dir, self.run, self.settings, self.pending = out_dir, run, settings, None
        self.folder, self.started_at = None, 0.0

    def new_folder(self, name: str, rng: dict) -> Path:
        self.finish()
        folder = self.out_dir / f"checkpoint-{name}"
        if self.run.is_main and made_by_09(folder):  # what a killed save left behind
            shutil.rmtree(folder)
        dist.barrier()
        failed = None
        try:
            if folder.is_symlink():  # planted under the name: its target is not ours to fill
                raise OSError(errno.ELOOP, "it is a symbolic link, and 09 writes only into "
                                           "folders it makes")
            folder.mkdir(parents=True, exist_ok=True)
            state = io.BytesIO()
            torch.save(rng, state)
            write_atomically(folder / f"rng-rank{self.run.rank}.pt", state.getvalue())
            if self.run.is_main:
                write_atomically(folder / RUN_FILE, json.dumps(self.settings).encode())
        except OSError as err:  # a full disk, a read-only filesystem, no inodes left, ...
            failed = checkpoint.write_failure(err, folder)
        everyone = [None] * self.run.world_size
        dist.all_gather_object(everyone, failed)  # so that every rank stops if one must
        if any(everyone):
            self.abandon(folder, next(reason for reason in everyone if reason))
        self.folder, self.started_at = folder, time.perf_counter()
        return folder

    def abandon(self, folder: Path, reason: str) -> None:
        """Every rank calls this: the folder goes, the link stays, and every rank says rank 0's
        reason (the same line, printed once per machine; the free space each rank measured
        differs)."""
        if self.run.is_main:
            shutil.rmtree(folder, ignore_errors=True)
        said = [reason, folder.exists(), folder.is_symlink()]  # (a read-only fs keeps all)
        dist.broadcast_object_list(said, src=0)  # after the removal: before any rank exits
        reason, kept_folder, link = said
        removed = ("left the link as it was" if link else
                   "could not remove it" if kept_folder else "removed it")
        linked = self.linked()
        kept = (f"the last complete checkpoint, {linked}, is unchanged" if linked
                else "no complete checkpoint was written before it")
        raise UserError(f"could not write checkpoint {folder}: {reason}; {removed}, {kept}")

    def linked(self) -> str | None:
        """What <out-dir>/checkpoint names (a copied run folder's is a real folder), if any."""
        link = self.out_dir / "checkpoint"
        if not link.exists():
            return None
        return os.readlink(link) if link.is_symlink() else str(link)

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
        except CheckpointException as err:  # every rank gets every rank's failures
            if is_write_failure(first_failure(err)):  # a full disk, ...
                self.abandon(folder, checkpoint.write_failure(first_failure(err), folder))
            # A peer died mid-save: see errors.run_main
            raise RuntimeError(f"a checkpoint save failed ({root_cause(err)})") from None
        seconds = time.perf_counter() - started
        dist.barrier()  # every rank's shards are written
        failed = None
        if self.run.is_main:
            try:
                self.switch_link(folder)
            except OSError as err:  # a read-only filesystem, no inodes left, ...
                linked = self.linked()
                failed = (f"could not commit checkpoint {folder}: "
                          f"{checkpoint.write_failure(err, folder)}; it is complete: resume "
                          f"from it with --resume {folder}"
                          + (f" ({self.out_dir / 'checkpoint'} still names {linked})"
                             if linked else ""))
            else:
                for old in self.out_dir.glob("checkpoint-*"):
                    if old != folder and made_by_09(old):
                        shutil.rmtree(old, ignore_errors=True)
                log(self.run, f"checkpoint {folder.name}: {blocked:.2f} s blocking training, "
                              f"then {seconds - blocked:.2f} s in the background")
        said = [failed]
        dist.broadcast_object_list(said, src=0)  # (and no rank goes on before the commit)
        if said[0]:
            raise UserError(said[0])

    def switch_link(self, folder: Path) -> None:
        """The commit: <out-dir>/checkpoint names `folder`, switched in one atomic rename.

        A run folder copied with `scp -r` or `rsync -L` holds a real folder named checkpoint
        (the copy of the one the link named). A rename cannot put a link over a folder: the
        copy is renamed to checkpoint-copied-<time> first, a name the removal of older
        checkpoints, right after this commit, takes away. (Between these two renames, no
        checkpoint is named; `folder` and the copy are both complete.)
        """
        link, temporary = self.out_dir / "checkpoint", self.out_dir / ".checkpoint.link"
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(folder.name)
        if link.is_dir() and not link.is_symlink():
            link.rename(self.out_dir / f"checkpoint-copied-{time.time_ns()}")
        os.replace(temporary, link)  # the commit: the link now names the new folder


def load_into(path: Path, model, optimizer, scheduler) -> tuple[Path, dict]:
    """09's load(), checked: the folder `path` names is complete, is read without running code,
    and its epoch, position and schedule agree. Returns the folder and those saved values (the
    schedule's state not yet loaded: export adapts it first)."""
    folder = complete_folder(path)
    model_state, optim_state = get_state_dict(model, optimizer)  # this run's shard layout
    state = {"model": model_state, "optim": optim_state,
             "extra": {"epoch": 0, "position": {"step": 0, "loss_sum": 0.0, "samples": 0},
                       "scheduler": scheduler.state_dict()}}
    load(state, folder)
    checkpoint.check_values(state["extra"], folder)  # an edited epoch or position: one line
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return folder, state["extra"]


def resume(path: Path, run, model, optimizer, scheduler, settings: dict):
    """09's resume(), checked: the epoch to continue, the position in it, this rank's RNG."""
    folder, saved = load_into(path, model, optimizer, scheduler)
    scheduler.load_state_dict(saved["scheduler"])
    position = saved["position"]
    check_same_sample_order(folder, position, settings)  # mid-epoch: 07's check
    rng = rng_state(folder, run) if position["step"] else None  # same world size only
    log(run, f"resumed from {folder} at step {position['step']} of epoch {saved['epoch'] + 1}")
    return saved["epoch"], position, rng


def export(path: Path | None, out: Path, args) -> None:
    """`09_distributed_checkpoint.py export --resume PATH`: the checkpoint as one plain
    checkpoint.pt that a plain Net loads with weights_only=True, and `00_single_gpu.py --resume`
    evaluates. One process."""
    errors.stop_signals_end_now()  # nothing to save on SIGTERM: one line, exit 143 (not silent)
    if path is None:
        raise UserError("export needs --resume PATH: the checkpoint to export")
    model = build_model(args, seed=args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = LRSchedule(optimizer)  # the template: the saved state is copied as it is
    # Without a process group, dcp.load reads every shard of every rank into whole tensors:
    # the same safe load as a resume, into a plain model in this one process.
    with warnings.catch_warnings():  # "assuming the intent is to ... a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        _, saved = load_into(path, model, optimizer, scheduler)
    scheduler.steps_per_epoch = saved["scheduler"]["steps_per_epoch"]  # no conversion
    scheduler.base_lrs = list(saved["scheduler"]["base_lrs"])  # the saved --lr, kept
    scheduler.load_state_dict(saved["scheduler"])
    position = saved["position"]  # kept: 00-06 refuse to continue mid-epoch
    checkpoint.save(out, model, optimizer, scheduler, saved["epoch"],
                    position=position if position["step"] else None)
    print(f"wrote {out}: the model, optimizer and scheduler after epoch {saved['epoch']} "
          f"(step {position['step']} of the next)", flush=True)


def take_in(step: dict) -> None:
    """07's twins, 08's held_per_rank, then 09's own (above)."""
    fault_tolerance.take_in(step)
    step.update(held_per_rank=step08_fsdp2.held_per_rank, Commits=Commits,
                own_checkpoint=own_checkpoint, resume=resume, export=export)
