"""Plumbing that every step of the tutorial shares.

Each numbered script teaches one DDP idea and keeps that idea in its own file. What every step
needs but none of them teaches lives here, once: command-line flags, device and backend choice,
process-group setup, seeding, the batch plan, data, the model, checkpoints, metrics and profiling.
Read a step first; come here when it calls something you want to see inside.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # pixel statistics of the MNIST training set
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


# --------------------------------------------------------------------------------------------
# Errors: bad input gets one clear line and a non-zero exit, never a traceback.
# --------------------------------------------------------------------------------------------
class UserError(Exception):
    """A problem with the input that we can explain in one line (missing data, bad flag, ...)."""


def _launcher_rank() -> int:
    """This process's global rank as the launcher set it (0 when started by plain python)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def run_main(main) -> None:
    """Run a script's `main()`, then tear the process group down.

    A `UserError` becomes one line on stderr (from rank 0 only, so N ranks do not print it N
    times) and exit code 2. A collective that fails because a peer died or stalled becomes one
    line from the rank that noticed, naming the likely cause, and exit code 3: without the
    timeout (--timeout) such a rank would wait forever. Tear-down happens after `main()` has
    returned, when its models are gone: destroying a gloo group while a DDP model still holds
    it has been seen to abort.
    """
    code = 0
    try:
        main()
    except UserError as err:
        if _launcher_rank() == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        code = 2
    except RuntimeError as err:
        explanation = explain_collective_failure(err)
        if explanation is None:
            raise
        print(f"error: rank {_launcher_rank()}: {explanation}", file=sys.stderr, flush=True)
        code = 3
    finally:
        gc.collect()
        if dist.is_available() and dist.is_initialized() and code != 3:
            dist.destroy_process_group()  # (a broken group cannot be torn down cleanly)
    if code:
        sys.exit(code)


def explain_collective_failure(err: RuntimeError) -> str | None:
    """A one-line reason for a collective that failed because of a peer, else None.

    gloo and NCCL report these as RuntimeErrors with transport-level messages ("Connection
    reset by peer", "Timed out waiting 600000ms ..."); what the user needs is which peer-side
    problem that means and where to look.
    """
    message = str(err)
    first_line = message.strip().splitlines()[0] if message.strip() else type(err).__name__
    detail = first_line.split("] ", 1)[-1][:160]  # drop gloo's "[/path/to/file.cc:123]"
    if "timed out" in message.lower() or "timeout" in message.lower():
        return (f"a collective timed out ({detail}): another rank stalled or died without "
                f"closing its connections; check the other ranks' output, or raise --timeout "
                f"if some ranks legitimately take longer (e.g. a slow first step)")
    if any(marker in message for marker in ("Connection reset", "Connection closed",
                                            "Connection refused", "Broken pipe", "NCCL error")):
        return (f"lost contact with a peer during a collective ({detail}): another rank "
                f"crashed or was killed; its own output above says why")
    return None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints the whole usage once per rank
        raise SystemExit(_print_usage_error(self.prog, message))


def _print_usage_error(prog: str, message: str) -> int:
    if _launcher_rank() == 0:
        print(f"error: {prog}: {message} (see --help)", file=sys.stderr, flush=True)
    return 2


# --------------------------------------------------------------------------------------------
# Command line: the flags every training script shares (the "script contract").
# --------------------------------------------------------------------------------------------
def argument_parser(doc: str, script: str) -> argparse.ArgumentParser:
    """The shared flags; a step adds its own (e.g. --compile) before calling parse_args()."""
    stem = Path(script).stem
    parser = _Parser(prog=Path(script).name, description=doc,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("data")
    data.add_argument("--data", choices=["auto", "mnist", "synthetic"], default="auto",
                      help="auto: MNIST if present or downloadable, else built-in synthetic digits")
    data.add_argument("--data-dir", type=Path, default=Path("data"))
    data.add_argument("--train-samples", type=int, help="use only the first N training samples")
    data.add_argument("--test-samples", type=int, help="use only the first N test samples")
    data.add_argument("--num-workers", type=int,
                      help="DataLoader worker processes per rank (default: 0 on CPU, where "
                           "workers compete with training for cores; 2 on GPU and from step 06)")
    train = parser.add_argument_group("training")
    train.add_argument("--epochs", type=int, default=2)
    train.add_argument("--batch-size", type=int, default=256,
                       help="GLOBAL batch: samples per optimizer step, summed over all ranks")
    train.add_argument("--max-device-batch", type=int,
                       help="most samples one device takes at once; larger per-rank batches "
                            "are split into micro-batches whose gradients accumulate")
    train.add_argument("--lr", type=float, default=0.05)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--no-dropout", dest="dropout", action="store_false",
                       help="turn dropout off (tests use it to compare runs weight for weight)")
    train.add_argument("--width", type=int, default=1,
                       help="multiply the hidden units (width 8: 8x the parameters, 2x the "
                            "compute; benchmarks use it to make communication matter)")
    system = parser.add_argument_group("system")
    system.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    system.add_argument("--amp", action="store_true", help="bf16 autocast on GPUs that support it")
    system.add_argument("--timeout", type=float, default=600,
                        help="seconds a collective may wait for a peer before failing")
    system.add_argument("--out-dir", type=Path, default=Path("runs") / stem)
    system.add_argument("--profile", action="store_true",
                        help="trace a few training steps per rank into <out-dir>/profile")
    system.add_argument("--resume", type=Path, metavar="PATH", help="continue from a checkpoint")
    return parser


# --------------------------------------------------------------------------------------------
# Device, backend and the process group.
# --------------------------------------------------------------------------------------------
@dataclass
class Run:
    """Who this process is and where it computes."""

    rank: int  # global rank: 0 .. world_size-1 over all nodes
    local_rank: int  # rank on this node: picks the GPU
    world_size: int
    local_world_size: int  # processes on this node
    device: torch.device
    backend: str | None  # "nccl" or "gloo"; None without a process group
    amp: bool
    hostname: str = socket.gethostname()

    @property
    def is_main(self) -> bool:
        """Rank 0 prints and saves for everyone (every rank holds the same weights)."""
        return self.rank == 0

    def autocast(self):
        """bf16 autocast when --amp was given and the GPU supports it; otherwise nothing."""
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.amp else nullcontext()


def choose_device(choice: str, local_rank: int, local_world_size: int) -> torch.device:
    """cuda:<local_rank> when GPUs are visible (or asked for), else the CPU.

    Apple's GPU (mps) is not used even when present: DDP has no backend for it, so on a Mac
    every step runs on the CPU with gloo.
    """
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("--device cuda, but no CUDA GPU is visible "
                        "(check nvidia-smi and CUDA_VISIBLE_DEVICES, or use --device cpu)")
    visible = torch.cuda.device_count()
    if local_world_size > visible:
        raise UserError(f"{local_world_size} processes on this node but only {visible} GPU(s) "
                        f"visible: start at most --nproc-per-node {visible} (NCCL needs one GPU "
                        f"per process)")
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """NCCL talks GPU to GPU directly; gloo moves CPU tensors (and is the only choice on CPU)."""
    return "nccl" if device.type == "cuda" else "gloo"


def launcher_ranks() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from whoever started this process.

    torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (and MASTER_ADDR/PORT).
    `srun python script.py` without torchrun sets SLURM_* instead: we translate them, taking the
    first node of the step as the meeting point. Plain `python script.py` is a world of one.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return (int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]),
                int(env.get("LOCAL_WORLD_SIZE", 1)))
    if "SLURM_PROCID" in env and int(env.get("SLURM_STEP_NUM_TASKS", 1)) > 1:
        env.setdefault("MASTER_ADDR", _slurm_head_address(env["SLURM_STEP_NODELIST"]))
        env.setdefault("MASTER_PORT", str(15000 + int(env["SLURM_JOB_ID"]) % 15000))
        per_node = _expand_slurm_counts(env["SLURM_STEP_TASKS_PER_NODE"])
        return (int(env["SLURM_PROCID"]), int(env["SLURM_LOCALID"]),
                int(env["SLURM_STEP_NUM_TASKS"]), per_node[int(env.get("SLURM_NODEID", 0))])
    return 0, 0, 1, 1


def _expand_slurm_counts(counts: str) -> list[int]:
    """SLURM's compressed per-node counts, e.g. "2(x3),1" -> [2, 2, 2, 1]."""
    expanded = []
    for part in counts.split(","):
        value, _, repeat = part.partition("(x")
        expanded += [int(value)] * int(repeat.rstrip(")") or 1)
    return expanded


def _slurm_head_address(nodelist: str) -> str:
    """The address SLURM itself uses for the step's first node (its NodeAddr)."""
    try:
        head = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                              capture_output=True, text=True).stdout.split()[0]
        node = subprocess.run(["scontrol", "show", "node", head], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError, IndexError) as err:
        raise UserError(f"started by srun, but could not find the first node of {nodelist!r} "
                        f"({err}); export MASTER_ADDR=<first node> before srun") from None
    return next((f.split("=", 1)[1] for f in node.split() if f.startswith("NodeAddr=")), head)


def setup(args, distributed: bool) -> Run:
    """Everything a step does before it touches data: device, defaults, process group, seeds.

    `distributed=False` (step 00) runs one process on one device and refuses a launcher that
    started several. With `distributed=True` the process joins the group its launcher set up;
    plain `python` makes a group of one, so the same script runs with or without torchrun.
    """
    rank, local_rank, world_size, local_world_size = launcher_ranks()
    if not distributed and world_size > 1:
        raise UserError(f"this step trains on one device; start it with plain python, not with "
                        f"{world_size} processes")
    device = choose_device(args.device, local_rank, local_world_size)
    amp = args.amp and device.type == "cuda" and torch.cuda.is_bf16_supported()
    if args.amp and not amp and rank == 0:
        print("note: --amp needs a GPU with bf16 support; training in float32", flush=True)
    set_performance_defaults(device, local_world_size)
    check_out_dir(args.out_dir)
    backend = None
    if distributed:
        backend = backend_for(device)
        init_process_group(backend, device, rank, world_size, args.timeout)
    seed_everything(args.seed + rank)  # different per rank: dropout masks; see build_model
    return Run(rank, local_rank, world_size, local_world_size, device, backend, amp)


def init_process_group(backend: str, device: torch.device, rank: int, world_size: int,
                       timeout_s: float) -> None:
    """Join the process group, with a store namespace of its own per restart attempt.

    Under torchrun every worker connects to the agent's TCP store, which outlives a restart
    (`--max-restarts`). Without a fresh namespace, a restarted worker can read the dead
    round's peer addresses and fail with gloo's "connectFullMesh ... Connection refused"
    (pytorch/pytorch#135712), so keys go under "attempt<TORCHELASTIC_RESTART_COUNT>/".
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds each rank to its own GPU
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        store = dist.HashStore()  # a group of one needs no network
    else:
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"attempt{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout,
                            # device_id lets NCCL connect eagerly; gloo (CPU) rejects it
                            device_id=device if device.type == "cuda" else None)


def set_performance_defaults(device: torch.device, local_world_size: int) -> None:
    """Settings most users do not know they need; each line says why."""
    if device.type == "cuda":
        # TF32 runs float32 matmuls/convs on tensor cores: several times faster, and the
        # 10-bit mantissa does not hurt training.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        # Our input shapes never change, so let cuDNN time its algorithms once and keep the best.
        torch.backends.cudnn.benchmark = True
    if "OMP_NUM_THREADS" not in os.environ:
        # N ranks on one machine each default to all its cores: N x oversubscription, which is
        # slower than no parallelism at all. Share the cores out instead (torchrun sets 1).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def check_out_dir(out_dir: Path) -> None:
    """Fail before training, not after an hour, when results could not be written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create --out-dir {out_dir}: {err.strerror}") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise UserError(f"--out-dir {out_dir} is not writable")


def barrier(run: Run) -> None:
    """Wait for every rank (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def all_ranks_agree(run: Run, flag: bool) -> bool:
    """True only if `flag` is true on every rank, so all ranks take the same branch."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)], device=run.device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


# --------------------------------------------------------------------------------------------
# Seeding: ranks agree where they must (model init, sampler order), differ where they must
# (dropout, augmentation), and every source of randomness is reproducible from --seed.
# --------------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices) in one call."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def loader_generator(seed: int) -> torch.Generator:
    """A DataLoader's own RNG. Without one, iterating a loader draws its worker seeds from the
    global RNG, which shifts every later dropout mask (and breaks exact resumes)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def init_worker(worker_id: int) -> None:
    """worker_init_fn, run in each DataLoader worker process when it starts.

    - Seeds: torch seeds each worker (base_seed + worker_id); seed python and numpy from it
      too, or every worker would repeat the same 'random' numbers.
    - SIGTERM: SLURM and torchrun send it to every process of a job, workers included, and a
      worker that dies of it makes the training process fail before it can save (step 07
      saves on SIGTERM). Workers ignore it and end when their training process does.
    """
    worker_seed = torch.initial_seed() % 2**32
    random.seed(worker_seed)
    np.random.seed(worker_seed)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


# --------------------------------------------------------------------------------------------
# Batch plan: --batch-size is the GLOBAL batch.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchPlan:
    global_batch: int  # samples per optimizer step, all ranks together
    per_rank: int  # samples each rank contributes per step
    micro_batch: int  # samples per forward/backward (<= --max-device-batch)
    accumulation_steps: int  # micro-batches per optimizer step


def plan_batches(global_batch: int, world_size: int, max_device_batch: int | None) -> BatchPlan:
    """Split the global batch over ranks, and over micro-batches when a device cannot hold it.

    Learning-rate rule: keeping the GLOBAL batch fixed while adding ranks keeps the optimisation
    identical (each step averages the same samples), so the LR stays as it is. If you instead
    keep the per-device batch fixed, the global batch grows with the world size and the usual
    starting point is to scale the LR linearly with it (Goyal et al., 2017), with a warm-up.
    """
    if global_batch < world_size or global_batch % world_size:
        raise UserError(f"--batch-size {global_batch} does not divide over {world_size} ranks; "
                        f"use a multiple of {world_size} (e.g. "
                        f"{max(1, round(global_batch / world_size)) * world_size})")
    per_rank = global_batch // world_size
    steps = 1
    if max_device_batch:
        steps = math.ceil(per_rank / max_device_batch)
        while per_rank % steps:  # equal micro-batches: every one weighs the same
            steps += 1
    return BatchPlan(global_batch, per_rank, per_rank // steps, steps)


# --------------------------------------------------------------------------------------------
# Data: MNIST through torchvision's real loader, or built-in synthetic digits when offline.
# --------------------------------------------------------------------------------------------
class Digits(Dataset):
    """28x28 digit images held in memory as uint8, normalised as they are fetched."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return normalize(self.images[index]).unsqueeze(0), self.labels[index]

    def __getitems__(self, indices):
        # The DataLoader asks for a whole batch at once: one indexing op instead of one per
        # sample keeps the loader far ahead of the GPU without worker processes.
        images = normalize(self.images[indices]).unsqueeze(1)
        return list(zip(images, self.labels[indices]))


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> zero-mean, unit-variance floats (MNIST's statistics)."""
    return (images.float() / 255 - MNIST_MEAN) / MNIST_STD


def load_datasets(args, run: Run, download: bool) -> tuple[Digits, Digits]:
    """(train, test) as chosen by --data; prefixes when --train/--test-samples are given.

    Only processes with `download=True` fetch MNIST (one per machine, or one in all); the others
    wait at a barrier and then read the files. Every rank then checks that all ranks found MNIST,
    so no two ranks ever train on different data.
    """
    mnist_dir = args.data_dir / "MNIST" / "raw"
    if args.data != "synthetic":
        if download and not mnist_present(mnist_dir):
            try_download_mnist(args.data_dir)
        barrier(run)
    use_mnist = args.data != "synthetic" and all_ranks_agree(run, mnist_present(mnist_dir))
    if args.data == "mnist" and not use_mnist:
        raise UserError(f"MNIST not found in {mnist_dir} on every rank, and it could not be "
                        f"downloaded (offline?): copy the four files {', '.join(MNIST_FILES)} "
                        f"there, or run with --data synthetic")
    if use_mnist:
        train, test = read_mnist(args.data_dir)
    else:
        if args.data == "auto" and run.is_main:
            print(f"warning: MNIST not in {mnist_dir} and not downloadable; using built-in "
                  f"synthetic digits (--data synthetic to silence this)", flush=True)
        from synthetic_digits import synthetic_digits

        train = Digits(*synthetic_digits(args.train_samples or 60_000, seed=1))
        test = Digits(*synthetic_digits(args.test_samples or 10_000, seed=2))
    return _prefix(train, args.train_samples), _prefix(test, args.test_samples)


def _prefix(data: Digits, count: int | None) -> Digits:
    if count is None:
        return data
    if not 0 < count <= len(data):
        raise UserError(f"asked for {count} samples, but the dataset has {len(data)}")
    return Digits(data.images[:count], data.labels[:count])


def mnist_present(mnist_dir: Path) -> bool:
    return all((mnist_dir / name).is_file() for name in MNIST_FILES)


def try_download_mnist(data_dir: Path) -> None:
    """Download MNIST with torchvision if its servers answer within seconds (no long retries
    when offline). Files land in a temporary folder and are renamed into place, so an
    interrupted download, or two nodes downloading into one shared folder, leave no half file."""
    from torchvision.datasets import MNIST  # imported here: torchvision costs ~3 s to import

    hosts = sorted({mirror.split("/")[2] for mirror in MNIST.mirrors})
    if not any(_reachable(host) for host in hosts):
        return
    tmp = data_dir / f".download-{socket.gethostname()}-{os.getpid()}"
    try:
        MNIST(tmp, train=True, download=True)
        MNIST(tmp, train=False, download=True)
        target = data_dir / "MNIST" / "raw"
        target.mkdir(parents=True, exist_ok=True)
        for name in MNIST_FILES:
            os.replace(tmp / "MNIST" / "raw" / name, target / name)
    except Exception as err:  # noqa: BLE001 -- any failure means "not downloadable"
        print(f"warning: MNIST download failed: {err}", file=sys.stderr, flush=True)
    finally:
        subprocess.run(["rm", "-rf", str(tmp)], check=False)


def _reachable(host: str, port: int = 443, timeout_s: float = 3.0) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def read_mnist(data_dir: Path) -> tuple[Digits, Digits]:
    """Read the four IDX files with torchvision's MNIST class (we keep its tensors, not its
    per-sample PIL conversion, which would make the loader the bottleneck)."""
    from torchvision.datasets import MNIST

    try:
        train = MNIST(data_dir, train=True, download=False)
        test = MNIST(data_dir, train=False, download=False)
    except Exception as err:  # noqa: BLE001 -- torchvision raises many kinds for bad files
        raise UserError(f"could not read MNIST in {data_dir / 'MNIST' / 'raw'} ({err}); "
                        f"delete the folder to download it again") from None
    for split in (train, test):
        if split.data.dtype != torch.uint8 or split.data.shape[1:] != (28, 28):
            raise UserError(f"MNIST files in {data_dir} hold {tuple(split.data.shape)} "
                            f"{split.data.dtype} images, expected N x 28 x 28 uint8")
    return Digits(train.data, train.targets), Digits(test.data, test.targets)


def write_digits_h5(path: Path, train_set: Digits, test_set: Digits, chunk: int,
                    compression: str | None) -> None:
    """Both sets into one HDF5 file for step 06, written under a temporary name and renamed
    when complete: an interrupted run leaves no half file, and no reader ever sees one."""
    import h5py  # imported on use: only step 06 reads HDF5

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(tmp, "w") as f:
            f.attrs.update(mean=MNIST_MEAN, std=MNIST_STD)  # see normalize
            for name, data in [("train", train_set), ("test", test_set)]:
                rows = min(chunk, len(data))
                group = f.create_group(name)
                group.attrs.update(count=len(data), shape=(28, 28))
                # No compression by default: an uncompressed chunk goes into the batch with no
                # CPU work in the workers. gzip shrinks MNIST ~4x for a little CPU per chunk,
                # worth it when the filesystem rather than the CPU is the bottleneck. fletcher32
                # stores a checksum per chunk: a damaged copy fails instead of training on garbage.
                group.create_dataset("images", data=data.images.numpy(), chunks=(rows, 28, 28),
                                     compression=compression, fletcher32=True)
                group.create_dataset("labels", data=data.labels.numpy(), chunks=(rows,),
                                     compression=compression, fletcher32=True)
        os.replace(tmp, path)
    except OSError as err:
        raise UserError(f"cannot write {path}: {err}") from None
    finally:
        tmp.unlink(missing_ok=True)


def open_digits_h5(path: Path, train_samples: int | None, test_samples: int | None,
                   verify_all: bool = False) -> tuple[int, int, Digits]:
    """Check a file that write_digits_h5 wrote and read what is small: (training samples to use,
    chunk size, the test set in memory). Runs before training, so a bad file is one clear line,
    not a crash mid-epoch. verify_all reads every chunk (checksums); otherwise only the last,
    where a cut-off copy ends."""
    import h5py  # imported on use: only step 06 reads HDF5

    try:
        with h5py.File(path, "r") as f:
            for name in ["train", "test"]:
                images, labels = f[name]["images"], f[name]["labels"]
                count = f[name].attrs["count"]
                if (images.dtype != np.uint8 or images.shape != (count, 28, 28)
                        or labels.shape != (count,) or labels.dtype.kind not in "iu"):
                    raise UserError(
                        f"{path}: {name} holds {images.dtype} images {images.shape} and "
                        f"{labels.dtype} labels {labels.shape}, expected uint8 {count} x 28 x 28 "
                        f"and {count} integers; delete it to prepare it again")
                rows = (images.chunks or [1024])[0]
                for a in range(0, count, rows) if verify_all else [count - 1]:
                    _ = images[a:a + rows], labels[a:a + rows]  # reading checks the checksums
            chunk = (f["train/images"].chunks or [1024])[0]
            train_count = train_samples or len(f["train/labels"])
            if not 0 < train_count <= len(f["train/labels"]):
                raise UserError(f"asked for {train_count} samples, but {path} holds "
                                f"{len(f['train/labels'])}")
            test_set = Digits(torch.from_numpy(f["test/images"][:]),
                              torch.from_numpy(f["test/labels"][:]).long())
    except (OSError, KeyError, ValueError) as err:
        raise UserError(f"{path} is not a readable digits file ({str(err)[:120]}); "
                        f"delete it to prepare it again") from None
    return train_count, chunk, _prefix(test_set, test_samples)


def make_loader(dataset: Dataset, batch_size: int, run: Run, args, seed: int, **kwargs):
    """A DataLoader with the settings that matter for speed and reproducibility.

    - its own generator (seeded per rank) and worker seeding: see loader_generator/init_worker;
    - pinned host memory on GPU, so `.to(device, non_blocking=True)` overlaps the copy;
    - persistent workers: they would otherwise be re-forked every epoch.
    """
    workers = args.num_workers
    if workers is None:
        workers = 2 if run.device.type == "cuda" else 0
    return DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                      pin_memory=run.device.type == "cuda", persistent_workers=workers > 0,
                      worker_init_fn=init_worker, generator=loader_generator(seed), **kwargs)


# --------------------------------------------------------------------------------------------
# The model: the classic MNIST CNN of pytorch/examples (about 99 % test accuracy on MNIST).
# --------------------------------------------------------------------------------------------
class Net(nn.Module):
    """The classic MNIST CNN: 1.2 M parameters, 1.1 M of them in fc1. `width` multiplies fc1's
    hidden units: more parameters to all-reduce for little more compute."""

    def __init__(self, dropout: bool = True, width: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(9216, 128 * width)
        self.fc2 = nn.Linear(128 * width, 10)
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)  # logits; cross_entropy applies log-softmax


def build_model(args, seed: int) -> Net:
    """The model initialised from `seed` alone, not from the (per-rank) global RNG.

    The same seed gives the same weights on every rank, whatever else ran before.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Net(dropout=args.dropout, width=getattr(args, "width", 1))


# --------------------------------------------------------------------------------------------
# Checkpoints: written atomically, loaded with weights_only=True.
# --------------------------------------------------------------------------------------------
def rng_state(generator: torch.Generator) -> dict:
    """This process's RNG states, as types that torch.load(weights_only=True) accepts."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
             "loader": generator.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, generator: torch.Generator) -> None:
    random.setstate(state["python"])
    keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    generator.set_state(state["loader"])
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])


def gather_rng_states(run: Run, generator: torch.Generator) -> list[dict]:
    """Every rank's RNG state, indexed by rank (each rank draws its own dropout masks)."""
    state = rng_state(generator)
    if not dist.is_initialized():
        return [state]
    states = [None] * run.world_size
    dist.all_gather_object(states, state)
    return [{k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()} for s in states]


def save_checkpoint(path: Path, model: nn.Module, optimizer, scheduler, epoch: int,
                    rng_states: list[dict], **extra) -> None:
    """Write `path` atomically: a temporary file, fsync, then rename over the old one.

    A crash mid-write leaves the previous checkpoint intact: rename is atomic on POSIX.
    """
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "epoch": epoch, "rng": rng_states, **extra}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def load_checkpoint(path: Path, device: torch.device) -> dict:
    """Load onto this rank's device, accepting plain tensors and containers only."""
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # noqa: BLE001 -- truncated zip, pickle error, ...
        raise UserError(f"checkpoint {path} is corrupt or not a checkpoint "
                        f"({type(err).__name__}: {str(err).splitlines()[0][:120]})") from None


def resume(path: Path, run: Run, model: nn.Module, optimizer, scheduler,
           generator: torch.Generator) -> dict:
    """Restore a checkpoint written by save_checkpoint and return it: its "epoch" (epochs
    completed) is the epoch to continue at."""
    checkpoint = load_checkpoint(path, run.device)
    try:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
    except (KeyError, RuntimeError, ValueError) as err:
        raise UserError(f"checkpoint {path} does not fit this model/optimizer "
                        f"({str(err).splitlines()[0][:160]})") from None
    states = checkpoint["rng"]
    if len(states) == run.world_size:
        set_rng_state(states[run.rank], generator)
    elif run.is_main:
        print(f"note: checkpoint was written by {len(states)} ranks, this run has "
              f"{run.world_size}: RNG streams restart from the seed", flush=True)
    log(run, f"resumed from {path} after epoch {checkpoint['epoch']}")
    return checkpoint


# --------------------------------------------------------------------------------------------
# Metrics, logging and the run summary.
# --------------------------------------------------------------------------------------------
def log(run: Run, message: str) -> None:
    """Print from rank 0 only: N ranks printing the same line is noise."""
    if run.is_main:
        print(message, flush=True)


def announce(run: Run, args, plan: BatchPlan, script: str) -> None:
    """One start-up line a user can check before waiting for an epoch."""
    threads = torch.get_num_threads()
    log(run, f"{Path(script).name}: device={run.device} backend={run.backend or '-'} "
             f"world_size={run.world_size} batch={plan.global_batch} (= {run.world_size} ranks "
             f"x {plan.per_rank}, {plan.accumulation_steps} micro-batch(es) of "
             f"{plan.micro_batch}) threads/rank={threads} amp={run.amp} seed={args.seed}")


class Throughput:
    """Samples per second over the steady state, with the first step timed on its own.

    The first step pays one-off costs (CUDA context, cuDNN autotuning, torch.compile), so it
    is reported as `first_step_seconds` and left out of `samples_per_sec`. The clock is read
    with the device synchronised only at those two points, never per step.
    """

    def __init__(self, run: Run):
        self.run = run
        self.first_step_seconds = None
        self.samples = 0
        self.seconds = 0.0
        self.train_seconds = 0.0  # wall time of the training epochs, first steps included

    def _now(self):
        if self.run.device.type == "cuda":
            torch.cuda.synchronize(self.run.device)
        return time.perf_counter()

    def start_epoch(self):
        self.steps, self.epoch_samples = 0, 0
        self.started = self.epoch_started = self._now()

    def step(self, samples: int):
        """Count one optimizer step of `samples` samples (per rank)."""
        self.steps += 1
        if self.steps == 1:
            now = self._now()
            if self.first_step_seconds is None:
                self.first_step_seconds = now - self.started
            self.started = now
        else:
            self.epoch_samples += samples

    def end_epoch(self) -> float:
        """Samples per second of this epoch (all ranks together), first step excluded."""
        now = self._now()
        seconds = now - self.started
        self.train_seconds += now - self.epoch_started
        self.samples += self.epoch_samples
        self.seconds += seconds
        return self.epoch_samples * self.run.world_size / max(seconds, 1e-9)

    @property
    def samples_per_sec(self) -> float:
        return self.samples * self.run.world_size / max(self.seconds, 1e-9)


class Metrics:
    """Console lines and TensorBoard scalars (rank 0), and summary.json at the end."""

    def __init__(self, run: Run, out_dir: Path):
        self.run, self.out_dir = run, out_dir
        self.writer = None
        if run.is_main:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=str(out_dir))
        self.train_losses = []

    def epoch(self, epoch: int, train_loss: float, test: dict, samples_per_sec: float,
              lr: float) -> None:
        self.train_losses.append(train_loss)
        log(self.run, f"epoch {epoch + 1}: train loss {train_loss:.4f}  test loss "
                      f"{test['loss']:.4f}  test accuracy {100 * test['accuracy']:.2f}% "
                      f"({test['correct']}/{test['samples']})  {samples_per_sec:,.0f} samples/s")
        if self.writer:
            for name, value in [("train/loss", train_loss), ("test/loss", test["loss"]),
                                ("test/accuracy", test["accuracy"]),
                                ("train/samples_per_sec", samples_per_sec), ("train/lr", lr)]:
                self.writer.add_scalar(name, value, epoch + 1)
            self.writer.flush()

    def summary(self, script: str, args, plan: BatchPlan, test: dict, meter: Throughput,
                **extra) -> dict:
        """Write <out-dir>/summary.json (rank 0) and return what was written."""
        summary = {
            "script": Path(script).name, "world_size": self.run.world_size,
            "device": str(self.run.device), "backend": self.run.backend,
            "global_batch_size": plan.global_batch, "per_rank_batch_size": plan.per_rank,
            "micro_batch_size": plan.micro_batch,
            "accumulation_steps": plan.accumulation_steps, "epochs": args.epochs,
            "seed": args.seed, "train_loss": self.train_losses[-1] if self.train_losses else None,
            "train_losses": self.train_losses, "test_loss": test["loss"],
            "test_accuracy": test["accuracy"], "test_correct": test["correct"],
            "test_samples": test["samples"], "samples_per_sec": meter.samples_per_sec,
            "first_step_seconds": meter.first_step_seconds,
            "train_seconds": meter.train_seconds, **extra}
        if meter.first_step_seconds is not None:
            log(self.run, f"first step {meter.first_step_seconds:.2f} s (one-off costs: "
                          f"warm-up, compile), then {meter.samples_per_sec:,.0f} samples/s")
        if self.run.is_main:
            write_json_atomic(self.out_dir / "summary.json", summary)
            if self.writer:
                self.writer.close()
        return summary


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Profiling lives in profiling.py; the steps call it through here like everything else.
# --------------------------------------------------------------------------------------------
def profiler(args, run: Run):
    """--profile: trace a few training steps per rank (see profiling.py); else a no-op."""
    from profiling import profiler as make_profiler  # imported on use: most runs never profile

    return make_profiler(args, run)
