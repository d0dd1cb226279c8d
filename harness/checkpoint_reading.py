"""Reading a checkpoint: to the CPU with weights_only=True (reading a file runs no code from
it), then checked: ours, whole, its numbers consistent, and fitting the model (restore).

checkpoint.py writes them; its load, restore and check_values are these.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .errors import UserError, first_line
from .flags import EPOCHS_LIMIT, STEPS_LIMIT, unreadable
from .ranks import log

REQUIRED = {"model": dict, "optimizer": dict, "scheduler": dict, "epoch": int}
# True while steps 07a-09 run (step07_fault_tolerance.around): they continue mid-epoch.
CONTINUES_MID_EPOCH = False


def load(path: Path) -> dict:
    """Load to the CPU, accepting plain tensors and containers only, and check it is ours.

    To the CPU first: `load_state_dict` then copies each tensor to where its parameter lives,
    and what must stay on the CPU (step 07's RNG states) does.
    """
    if path.is_dir():
        raise UserError(f"checkpoint {path} is a folder, not a file: {folder_hint(path)}")
    problem = unreadable(path)  # missing, a FIFO, a device, not ours to read
    if problem:
        raise UserError(f"checkpoint {path} {problem}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except PermissionError as err:  # (os.access said yes, the open did not: ACLs, ...)
        raise UserError(f"checkpoint {path} cannot be read ({err.strerror})") from None
    except Exception as err:  # noqa: BLE001 -- truncated zip, pickle error, ...
        raise UserError(f"checkpoint {path} is corrupt or not a checkpoint "
                        f"({type(err).__name__}: {first_line(err, 120)})") from None
    if not isinstance(checkpoint, dict):
        raise UserError(f"checkpoint {path} holds a {type(checkpoint).__name__}, not a "
                        f"checkpoint of this tutorial")
    for key, kind in REQUIRED.items():
        if not isinstance(checkpoint.get(key), kind):
            raise UserError(f"checkpoint {path} is not one of this tutorial's: its {key!r} is "
                            f"{type(checkpoint.get(key)).__name__}, expected {kind.__name__}")
    check_values(checkpoint, path)
    weights = checkpoint["model"]
    if not all(torch.is_tensor(t) for t in weights.values()):
        raise UserError(f"checkpoint {path} is not one of this tutorial's: its model holds "
                        f"something other than tensors")
    if not all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point()):
        raise UserError(f"checkpoint {path} holds NaN or infinite weights; resume from an "
                        f"earlier one")
    return checkpoint


def folder_hint(path: Path) -> str:
    """What a folder given as a checkpoint file probably is, and what to give instead."""
    if (path / "checkpoint.pt").is_file():  # a run's --out-dir
        return f"did you mean {path / 'checkpoint.pt'}?"
    if (path / ".metadata").is_file():  # 09's checkpoint folder, or the link to one
        return (f"a distributed checkpoint of step 09, which steps 00-08 cannot read; write "
                f"one file from it with: python 09_distributed_checkpoint.py export --resume "
                f"{path}")
    return "give the checkpoint.pt file a run wrote"


def check_position_and_rng(checkpoint: dict, path: Path) -> None:
    """Step 07's additions, when present: the position in an epoch (whole numbers of steps and
    samples, a finite loss sum) and one random state per rank (a CPU byte tensor each)."""
    position, rng = checkpoint.get("position"), checkpoint.get("rng")
    counts = (position.get("step"), position.get("samples")) if isinstance(position, dict) else ()
    if position is not None and not (
            counts and all(type(n) is int and n >= 0 for n in counts)
            and type(position.get("loss_sum")) in (int, float)
            and math.isfinite(position["loss_sum"])):
        raise UserError(f"checkpoint {path} is not one of this tutorial's: its 'position' is "
                        f"{position!r:.80}, expected whole numbers of steps and samples and a "
                        f"loss sum")
    if rng is not None and not isinstance(rng, list):
        raise UserError(f"checkpoint {path} is not one of this tutorial's: its 'rng' is not a "
                        f"list of random states")
    for rank, state in enumerate(rng or []):
        problem = rng_problem(state)
        if problem:
            raise UserError(f"checkpoint {path} is damaged: the random state of rank {rank} is "
                            f"{problem}")


def rng_problem(state) -> str | None:
    """What is wrong with a saved random state ({"cpu": ..., "cuda": ...}), or None. A state
    torch would refuse, say one of the wrong size, is refused here, before any rank sets it: on a
    scratch generator, which checks it as torch.set_rng_state does."""
    if not (isinstance(state, dict) and torch.is_tensor(state.get("cpu"))):
        return f"a {type(state).__name__} without a CPU random state"
    try:
        torch.Generator().set_state(state["cpu"])
    except (RuntimeError, TypeError) as err:
        return f"not one torch can set ({first_line(err, 100)})"
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_initialized():  # only then is it set (rng_state)
        if not (torch.is_tensor(cuda) and cuda.dtype == torch.uint8
                and cuda.shape == torch.cuda.get_rng_state().shape):
            return "a CUDA random state of another size than this GPU's"
    return None


def whole(value, lowest: int, highest: int | None = None) -> bool:
    """A whole number (not a bool, not a float) in [lowest, highest]."""
    return (type(value) is int and value >= lowest
            and (highest is None or value <= highest))


def check_values(saved: dict, path: Path) -> None:
    """The numbers a resume continues from, checked against each other: a checkpoint that was
    edited by hand or damaged is one line naming the value, not a traceback or a run that
    silently trains nothing. `saved` holds "epoch" (finished epochs), "scheduler" (LRSchedule's
    state: the optimizer steps taken, "last_epoch", counted in "steps_per_epoch") and, from
    step 07 on, "position" (the steps of the next epoch already taken). Every step that resumes
    calls this: load() for one file, 09 for the values of a DCP folder.

    A checkpoint written after E epochs and S steps of the next holds last_epoch = E x steps
    per epoch + S, with 0 <= S < steps per epoch: one edited number breaks that."""
    check_position_and_rng(saved, path)  # their types, and each random state
    epoch, scheduler = saved.get("epoch"), saved.get("scheduler")
    if not whole(epoch, 0, EPOCHS_LIMIT):
        raise UserError(f"checkpoint {path} is damaged: its epoch is {epoch!r}, expected a "
                        f"whole number of finished epochs from 0 to {EPOCHS_LIMIT}")
    position = saved.get("position") or {}
    step = position.get("step", 0)
    if not (isinstance(scheduler, dict) and "steps_per_epoch" in scheduler):
        return  # not an LRSchedule's state: restore says it does not fit
    per_epoch, taken = scheduler["steps_per_epoch"], scheduler.get("last_epoch")
    if not whole(per_epoch, 1, STEPS_LIMIT):
        raise UserError(f"checkpoint {path} is damaged: its schedule counts {per_epoch!r} steps "
                        f"per epoch, expected a whole number from 1 to {STEPS_LIMIT}")
    if not whole(step, 0, per_epoch - 1):
        raise UserError(f"checkpoint {path} is damaged: its position is step {step!r} of an "
                        f"epoch of {per_epoch} steps, expected 0 to {per_epoch - 1}")
    if taken != epoch * per_epoch + step:
        raise UserError(f"checkpoint {path} is damaged: its schedule has taken {taken!r} steps, "
                        f"but {epoch} epoch(s) of {per_epoch} steps and {step} more make "
                        f"{epoch * per_epoch + step}")


def restore(path: Path, run, model, optimizer, scheduler) -> dict:
    """Load a checkpoint into the model, optimizer and scheduler; return it (its "epoch",
    the number of finished epochs, is where to continue). Steps 00-06 continue at an epoch's
    start; one written in the middle of an epoch (by 07a-08) is refused unless the step can
    continue there (CONTINUES_MID_EPOCH): they would train the epoch's first steps again."""
    checkpoint = load(path)
    step = (checkpoint.get("position") or {}).get("step", 0)
    if step and not CONTINUES_MID_EPOCH:
        run = checkpoint.get("run")  # which step wrote it (07a on): the one that continues it
        wrote = run.get("step") if isinstance(run, dict) else None
        raise UserError(f"checkpoint {path} was written at step {step} of epoch "
                        f"{checkpoint['epoch'] + 1}, in the middle of it: this step continues "
                        f"only from the end of an epoch, and would train those {step} steps "
                        f"again. Resume it with {wrote or 'the step that wrote it (07a or later)'}"
                        f", or use a checkpoint written at the end of an epoch")
    try:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])  # moves state to the params' device
        scheduler.load_state_dict(checkpoint["scheduler"])
    except (KeyError, RuntimeError, ValueError, TypeError) as err:
        raise UserError(f"checkpoint {path} does not fit this model/optimizer "
                        f"({first_line(err)})") from None
    log(run, f"resumed from {path} after epoch {checkpoint['epoch']}")
    return checkpoint
