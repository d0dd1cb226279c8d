"""The command line every training step shares, and the checks on every flag.

Step 00 first needs it; every later step adds its own flags with the same checked types, so a
bad value (`--batch-size 0`, `--lr nan`, `--seed -1`) is one line and exit code 2 when the
command line is parsed, before any process group, data or model exists.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import stat
from pathlib import Path

import common

from .errors import launcher_rank, report

SEED_LIMIT = 2**32  # numpy's legacy seeding, the narrowest of the RNGs we seed, takes 0 .. 2**32-1
# The most samples --train-samples / --test-samples may ask for. The synthetic digits are drawn
# in memory (about 1.6 KB per sample at the peak, and some 4 minutes per million on one core);
# MNIST has 60,000 and 10,000, and 06's file is written from those same sets.
SAMPLES_LIMIT = 1_000_000
# Counts no run needs more of: a typo (an extra 000) is refused, not run for a year, and a
# number this size cannot overflow a float (a --warmup-steps of 10**400 did, in the schedule).
EPOCHS_LIMIT, STEPS_LIMIT = 100_000, 1_000_000_000
# --warmup-steps when --lr-scaling is on: twice the span SGD's momentum averages over (0.9: about
# 10 steps), short against an epoch; measured enough at x2 (docs/benchmarks.md).
WARMUP_STEPS = 20


class Parser(common.Parser):
    """argparse, but an error is one line, not the whole usage, printed by every rank that met
    it (once per machine: see errors.report): an --out-dir or --resume path may be missing on
    one node only."""

    def error(self, message):
        report(f"{self.prog}: {message} (see --help)")
        raise SystemExit(2)

    def parse_args(self, args=None, namespace=None):
        """argparse's with every flag's checked type (CHECKED), then the checks that involve
        two flags (the learning-rate scaling)."""
        for action in self._actions:
            checked = [CHECKED[o] for o in action.option_strings if o in CHECKED]
            if checked and action.type in (int, float, Path, common.whole, common.positive):  # (a step's own checked type stays)
                action.type = checked[0]
        args = argparse.ArgumentParser.parse_args(self, args, namespace)
        check_launcher_variables(self)
        if getattr(args, "lr_scaling", None) is not None:
            check_lr_scaling(self, args)
        return args


def check_lr_scaling(parser: Parser, args) -> None:
    """--lr-scaling scales --lr from one rank's batch to the global batch, so it needs
    --batch-per-rank; --warmup-steps ramps up to the scaled rate, so it needs a scaling."""
    if args.lr_scaling != "none" and args.batch_per_rank is None:
        parser.error(f"--lr-scaling {args.lr_scaling} needs --batch-per-rank: with --batch-size "
                     f"the global batch stays the same on any number of ranks, so there is "
                     f"nothing to scale --lr for")
    if args.warmup_steps is not None and args.lr_scaling == "none":
        parser.error("--warmup-steps ramps --lr up to the scaled rate: it needs --lr-scaling "
                     "linear or sqrt (with none there is nothing to ramp to)")
    if args.warmup_steps is None:
        args.warmup_steps = WARMUP_STEPS if args.lr_scaling != "none" else 0
    if args.batch_per_rank is not None:
        args.batch_size = None  # the global batch is B x the world size: see plan_batches


# The variables a launcher (torchrun, or 05's srun identity) sets for every process: a step reads
# them in setup() as whole numbers. Plain python sets none: a world of one.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_PORT")
# Counts SLURM and torchrun set, read as whole numbers too: the tasks of an srun (errors.report,
# 05-09's use_srun_identity), and the restarts (07b's restarted(run), common.restarted(run)).
COUNTS = ("SLURM_STEP_NUM_TASKS", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
# What use_srun_identity reads when srun started 2 tasks or more without torchrun (no RANK).
SRUN_IDENTITY = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID",
                 "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")


def check_launcher_variables(parser: Parser) -> None:
    """The launcher's variables are part of the command line: a RANK of "abc" (a traceback in
    int()), a RANK not below WORLD_SIZE or a MASTER_PORT above 65535 (a group that never forms)
    is one line and exit 2 here, before any work. Usually left over in a shell or a job script."""
    env = os.environ
    tasks = env.get("SLURM_STEP_NUM_TASKS", "1")
    srun = "RANK" not in env and tasks.isdigit() and int(tasks) > 1  # 05-09 read SRUN_IDENTITY
    numbers = {}
    for name in LAUNCHER_VARIABLES + COUNTS + (SRUN_IDENTITY[:4] if srun else ()):
        text = env.get(name)
        if text is None:
            continue
        try:
            numbers[name] = int(text)
        except ValueError:
            refuse(parser, f"{name}={text!r} is not a whole number", name)
    if srun and any(name not in env for name in SRUN_IDENTITY):
        missing = next(name for name in SRUN_IDENTITY if name not in env)
        refuse(parser, f"SLURM_STEP_NUM_TASKS={tasks} says srun started {tasks} tasks, but "
                       f"{missing} is not set (srun sets both)", "SLURM_STEP_NUM_TASKS")
    world = numbers.get("WORLD_SIZE", 1)
    local_world = numbers.get("LOCAL_WORLD_SIZE", 1)
    of_world, of_node = f" (WORLD_SIZE={world})", f" (LOCAL_WORLD_SIZE={local_world})"
    limits = [  # (name, lowest, highest or None, the variable the range comes from)
        ("WORLD_SIZE", 1, None, ""), ("RANK", 0, world - 1, of_world),
        ("LOCAL_WORLD_SIZE", 1, world, of_world), ("LOCAL_RANK", 0, local_world - 1, of_node),
        ("GROUP_RANK", 0, world - 1, of_world),  # the node's rank: fewer nodes than ranks
        ("MASTER_PORT", 0, 65535, "") if world == 1  # 0: any free port, for a world of one
        else ("MASTER_PORT", 1, 65535, of_world),
        *[(name, 0, None, "") for name in COUNTS],
        ("SLURM_PROCID", 0, numbers.get("SLURM_STEP_NUM_TASKS", 1) - 1,
         f" (SLURM_STEP_NUM_TASKS={tasks})")]
    for name, lowest, highest, source in limits:
        value = numbers.get(name)
        if value is None or (value >= lowest and (highest is None or value <= highest)):
            continue
        allowed = (f"at least {lowest}" if highest is None else f"{lowest}" if lowest == highest
                   else f"from {lowest} to {highest}")
        refuse(parser, f"{name}={value} is out of range: it must be {allowed}{source}", name)
    check_launched(parser, world, numbers)


def check_launched(parser: Parser, world: int, numbers: dict) -> None:
    """Without torchrun, WORLD_SIZE and RANK come from the shell. A WORLD_SIZE above 1 without
    MASTER_PORT cannot form a group (each rank would pick its own free port): left over, so
    refused at once, not after --timeout. And the process that hosts the group's store (rank 0
    without torchrun, whose agent hosts it) needs MASTER_PORT free."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return
    if world > 1 and "MASTER_PORT" not in os.environ:
        refuse(parser, f"WORLD_SIZE={world} asks for {world} processes, but no launcher started "
                       f"this one (torchrun sets MASTER_PORT with it): left over in the shell",
               "WORLD_SIZE")
    port = numbers.get("MASTER_PORT", 0)
    forms_group = parser.prog != "00_single_gpu.py"  # 00 trains alone: it never reads the port
    if port and forms_group and launcher_rank() == 0 and not port_is_free(port):  # srun: PROCID
        refuse(parser, f"MASTER_PORT={port} is in use on this machine: rank 0 hosts the "
                       f"group's store there; choose a free port", "MASTER_PORT")


def port_is_free(port: int) -> bool:
    """Whether a TCP server could listen on `port` on every address, as torch's store does."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def refuse(parser: Parser, problem: str, name: str = "") -> None:
    setter = ("SLURM sets it in a job" if name.startswith("SLURM_") else
              "torchrun sets it for each process")
    report(f"{parser.prog}: the launcher variable {problem} ({setter}; unset it to run with "
           f"plain python)")
    raise SystemExit(2)


# ---------------------------------------------------------------- checked types
def integer(lowest: int, highest: int | None = None, what: str = ""):
    """An argparse type: an integer in [lowest, highest], with an error that says which."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < lowest or (highest is not None and value > highest):
            limits = f"at least {lowest}" if highest is None else f"from {lowest} to {highest}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: {what or 'it'} must be "
                                             f"{limits}")
        return value

    return parse


def positive_float(what: str, highest: float = 1e4, lowest: float | None = None):
    """An argparse type: a finite number above zero (at least `lowest`, when given) and at most
    `highest`. A finite number can still be absurd: --timeout 0.0001 becomes 0 ms, --lr 1e308
    overflows the first update, --bucket-cap-mb 1e300 overflows the conversion to bytes."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{text} is not allowed: {what} must be a finite "
                                             f"number above 0")
        if value > highest or (lowest is not None and value < lowest):
            limits = (f"above 0 and at most {highest:g}" if lowest is None
                      else f"from {lowest:g} to {highest:g}")
            raise argparse.ArgumentTypeError(f"{text} is out of range: {what} must be {limits}")
        return value

    return parse


def writable_dir(text: str) -> Path:
    """A folder we can write to, created if missing: found now, not after an hour of training.
    An empty path is refused: Path("") is the current folder (the repository, say)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path is not a folder; name one")
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot create {text}: {err.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text} is not writable")
    return path


def writable_file(text: str) -> Path:
    """A file we can write at the end (a benchmark's table): its folder is checked now, so that
    half an hour of measurements is not lost to a typo in the path."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path is not a file; name one")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; name the file to write")
    writable_dir(str(path.parent))
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text} is not writable")
    return path


def existing_path(text: str) -> Path:
    """A file or folder that is there and that we may read (a checkpoint, or 09's folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path names nothing; name a checkpoint")
    path = Path(text)
    problem = unreadable(path)
    if problem:
        raise argparse.ArgumentTypeError(f"{text} {problem}")
    return path


def unreadable(path: Path) -> str | None:
    """Why `path` cannot be read as a file or a folder, in words, or None: missing, something
    else than a file (a FIFO would block the read forever, /dev/null reads as empty), or not
    ours to read (os.access: the real user's rights, which is who runs a step)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as err:  # a folder on the way we may not enter, a loop of links, ...
        return f"cannot be reached ({err.strerror})"
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
                "a character device" if stat.S_ISCHR(mode) else
                "a block device" if stat.S_ISBLK(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        return f"is {kind}, not a checkpoint file or folder"
    if not os.access(path, os.R_OK | (os.X_OK if stat.S_ISDIR(mode) else 0)):
        return "cannot be read (permission denied)"
    return None


# ---------------------------------------------------------------- the shared flags
def parser(doc: str, script: str) -> Parser:
    """common.parser's flags (every training step's), each parsed by its checked type below;
    a step adds its own before calling parse_args()."""
    return PLAIN_PARSER(doc, script, cls=Parser)


PLAIN_PARSER = common.parser  # (harness/__init__.py puts parser() in its place)


# The checked type of each flag a step may leave plain (common.parser's, 02b's, 03's, 11's):
# Parser.parse_args puts it in place of the plain int, float or Path before parsing.
CHECKED = {
    "--train-samples": integer(1, SAMPLES_LIMIT, "--train-samples"),
    "--test-samples": integer(1, SAMPLES_LIMIT, "--test-samples"),
    "--num-workers": integer(0, 64, "--num-workers"),
    "--epochs": integer(1, EPOCHS_LIMIT, "--epochs"),
    "--batch-size": integer(1, SAMPLES_LIMIT, "--batch-size"),
    "--batch-per-rank": integer(1, SAMPLES_LIMIT, "--batch-per-rank"),
    "--max-device-batch": integer(1, SAMPLES_LIMIT, "--max-device-batch"),
    "--lr": positive_float("--lr", highest=10),
    "--warmup-steps": integer(0, STEPS_LIMIT, "--warmup-steps"),
    "--seed": integer(0, SEED_LIMIT - 1, "--seed"),
    "--width": integer(1, 64, "--width"),
    "--timeout": positive_float("--timeout", lowest=1, highest=7 * 24 * 3600),
    "--out-dir": writable_dir,
    "--resume": existing_path,
    "--bucket-cap-mb": positive_float("--bucket-cap-mb"),
    "--max-mb": integer(1, 4096, "--max-mb"),  # 01's
    "--checkpoint-every": integer(0, what="--checkpoint-every"),  # 07-09's
    "--h5-chunk": integer(1, what="--h5-chunk"),  # 06's
    "--stop-at-loss": positive_float("--stop-at-loss"),  # 10's
    "--steps": integer(2, 1000, "--steps"),  # 11's: 2 at least, for a step with the aux head
    "--max-norm": positive_float("--max-norm"),  # 11's
    "--zero-stage": integer(1, 2, "--zero-stage"),  # 03b's
}
