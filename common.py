"""What every step shares, read once, in step order: who a process is, its device, the group,
seeding, the batch plan, the learning rate, the digits, the CNN, the flags, progress and
summary.json, checkpoints; then what 05 and 07a-07 write out, for the steps after them.

Copy a step and this file into an empty folder and the step runs there, with torch alone. In the
repository, a step's first line takes in harness/, which replaces some of these functions by
checked ones that train the same (harness/__init__.py lists them). This imports nothing of ours.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
# Imported before any process group exists: its functions take the default group as a default
# argument, evaluated at import. torchvision, torch.compile and the profiler import it (through
# torch._dynamo) after init_process_group, and then it keeps the group and gloo's threads alive
# past destroy_process_group, to be torn down during the interpreter's exit (docs/reliability.md).
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: F401 -- steps use it
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class UserError(Exception):
    """A mistake the user can fix (a flag, a file): one line and exit 2, no traceback."""


def run_main(main) -> None:
    """Run a step's main(): a UserError is one line and exit 2, a Ctrl-C exit 130."""
    try:
        main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted (SIGINT)", file=sys.stderr, flush=True)
        sys.exit(130)
    finally:
        gc.collect()  # main()'s models, freed before the interpreter's exit frees them in any
        if dist.is_initialized():  # order (an FSDP model then aborted the process, 2 of 6 runs)
            dist.destroy_process_group()


def log(run, message: str) -> None:
    """Print from rank 0 only: N ranks printing the same line is noise."""
    if run.is_main:
        print(message, flush=True)


def leave_at_once(code: int) -> None:
    """Exit now, skipping Python's teardown: a group whose collective failed cannot be ended."""
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------- who and where
@dataclass
class Run:
    """Who this process is and where it computes."""

    device: torch.device
    rank: int = 0  # global rank: 0 .. world_size-1 over all nodes
    local_rank: int = 0  # rank on this node: picks the GPU
    world_size: int = 1
    amp: bool = False  # asked for; kept only where the GPU computes bf16 natively
    backend: str | None = None  # "nccl" or "gloo"; None without a process group
    hostname: str = socket.gethostname()

    def __post_init__(self):
        self.amp = bool(self.amp and self.has_bf16)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if self.world_size == 1 and launched > 1:  # e.g. torchrun --nproc-per-node 2 00_...
            raise UserError(f"this step trains in one process; start it with plain python, "
                            f"not with {launched} processes")

    @property
    def has_bf16(self) -> bool:
        """A GPU that computes in bf16 natively. A V100 or T4 "supports" bf16 only by emulating
        it, slower than float32: not counted."""
        return (self.device.type == "cuda"
                and torch.cuda.is_bf16_supported(including_emulation=False))

    @property
    def is_main(self) -> bool:
        """Rank 0 prints and saves for everyone (every rank holds the same weights)."""
        return self.rank == 0

    def autocast(self):
        """bf16 autocast when --amp was given and the GPU supports it; otherwise nothing."""
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.amp else nullcontext()


def choose_device(choice: str, local_rank: int = 0, local_world_size: int = 1) -> torch.device:
    """cuda:<local_rank> when GPUs are visible (or asked for), else the CPU. (Apple's GPU, mps,
    is not used: DDP has no backend for it.)"""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise UserError("--device cuda, but no CUDA GPU is visible (see nvidia-smi)")
    else:
        device = torch.device("cuda", local_rank)
        torch.set_float32_matmul_precision("high")  # TF32 tensor cores for float32 matmuls
        torch.backends.cudnn.benchmark = True  # time the convolution algorithms once
    if "OMP_NUM_THREADS" not in os.environ:  # (torchrun sets it to 1 for several processes)
        # N processes on one machine would each use all its cores: N-fold oversubscription.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    return device


def set_deterministic(on: bool) -> None:
    """--deterministic: the same bits on a GPU too (the CPU kernels used here are already)."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS's first call
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)


def setup_distributed(args) -> Run:
    """Join the process group, as step 02's setup() writes out (steps 05 on call this)."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # plain python: a world of one
    os.environ.setdefault("MASTER_PORT", "0")
    device = choose_device(args.device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    set_deterministic(args.deterministic)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this rank's GPU, before NCCL starts on it
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)
    return Run(device, rank, local_rank, world_size, amp=args.amp, backend=backend)


def compile_choice(args, run: Run) -> bool:
    """--compile / --no-compile; by default on GPUs, off on the CPU (measured slower there for
    this model: docs/benchmarks.md)."""
    return args.compile if args.compile is not None else run.device.type == "cuda"


def slurm_tasks_on_this_node() -> int:
    """How many tasks of this srun step run on this node. SLURM compresses the per-node
    counts, e.g. SLURM_STEP_TASKS_PER_NODE="2(x3),1" means 2, 2, 2, 1."""
    counts = []
    for part in os.environ["SLURM_STEP_TASKS_PER_NODE"].split(","):
        value, _, repeat = part.partition("(x")
        counts += [int(value)] * int(repeat.rstrip(")") or 1)
    return counts[int(os.environ.get("SLURM_NODEID", 0))]


def slurm_head_address(nodelist: str) -> str:
    """The address SLURM itself uses for the first node of `nodelist` (its NodeAddr): a node's
    SLURM name need not be a name the other nodes can resolve."""
    try:
        head = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                              capture_output=True, text=True).stdout.split()[0]
        node = subprocess.run(["scontrol", "show", "node", head], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError, IndexError) as err:
        raise UserError(f"started by srun, but could not find the first node of {nodelist!r} "
                        f"({err}); export MASTER_ADDR=<first node> before srun") from None
    return next((f.split("=", 1)[1] for f in node.split() if f.startswith("NodeAddr=")), head)


def seed_everything(seed: int, epoch: int = 0, rank: int = 0) -> None:
    """Seed python, numpy and torch from (seed, epoch, rank), at every epoch's start: an epoch's
    draws (shuffle, dropout) then depend on these alone, so a resumed run draws what an
    uninterrupted one drew. `rank` gives each rank its own dropout masks."""
    key = int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])
    random.seed(key)
    np.random.seed(key)
    torch.manual_seed(key)


# ---------------------------------------------------------------- batches and learning rate
@dataclass(frozen=True)
class BatchPlan:
    global_batch: int  # samples per optimizer step, all ranks together
    per_rank: int  # samples each rank contributes per step
    micro_batch: int  # samples per forward/backward (<= --max-device-batch)
    accumulation_steps: int  # micro-batches per optimizer step
    lr_batch: int  # the batch --lr is meant for: the global one, or with --batch-per-rank B, B


def plan_batches(args, world_size: int, train_samples: int | None = None) -> BatchPlan:
    """--batch-size G: the GLOBAL batch, fixed as ranks are added (strong scaling), so N ranks
    compute what one process computes. --batch-per-rank B: B per rank, a global B x N (weak
    scaling). A per-rank batch over --max-device-batch runs as equal micro-batches."""
    if args.batch_per_rank is not None:
        global_batch, lr_batch, flag = args.batch_per_rank * world_size, args.batch_per_rank, (
            f"--batch-per-rank {args.batch_per_rank} x {world_size} ranks = ")
    else:
        global_batch, lr_batch, flag = args.batch_size, args.batch_size, "--batch-size "
    if global_batch % world_size:
        nearest = max(1, round(global_batch / world_size)) * world_size
        raise UserError(f"--batch-size {global_batch} does not divide over {world_size} ranks; "
                        f"use a multiple of {world_size} (e.g. {nearest})")
    if train_samples is not None and global_batch > train_samples:
        raise UserError(f"{flag}{global_batch} is larger than the {train_samples} "
                        f"training samples: an epoch would not fill one step")
    per_rank = global_batch // world_size
    steps = math.ceil(per_rank / args.max_device_batch) if args.max_device_batch else 1
    while per_rank % steps:  # equal micro-batches: every one weighs the same
        steps += 1
    return BatchPlan(global_batch, per_rank, per_rank // steps, steps, lr_batch)


def lr_scale(args, plan: BatchPlan) -> float:
    """What --lr-scaling multiplies --lr by: k = global batch / the batch --lr is meant for
    (linear, Goyal et al. 2017), or its square root (docs/running.md)."""
    k = plan.global_batch / plan.lr_batch
    return {"none": 1.0, "linear": k, "sqrt": math.sqrt(k)}[args.lr_scaling]


class LRSchedule(torch.optim.lr_scheduler.LambdaLR):
    """--lr x a linear warm-up to `scale` over `warmup_steps`, x 0.7 per epoch; stepped after
    every optimizer step (with scale 1: the per-epoch StepLR(gamma=0.7) of pytorch/examples)."""

    def __init__(self, optimizer, scale: float = 1.0, warmup_steps: int = 0,
                 steps_per_epoch: int = 1):
        self.steps_per_epoch = steps_per_epoch

        def factor(step: int) -> float:
            ramp = 1 + (scale - 1) * step / warmup_steps if step < warmup_steps else scale
            return ramp * 0.7 ** (step // self.steps_per_epoch)
        super().__init__(optimizer, factor)

    def last_step_lr(self) -> float:
        """The rate of the last step taken (get_last_lr() is already the next step's)."""
        return self.base_lrs[0] * self.lr_lambdas[0](max(0, self.last_epoch - 1))


def lr_schedule(optimizer, args, plan: BatchPlan, steps_per_epoch: int) -> LRSchedule:
    return LRSchedule(optimizer, lr_scale(args, plan), args.warmup_steps or 0, steps_per_epoch)


# ---------------------------------------------------------------- the digits and the CNN
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # pixel statistics of the MNIST training set


class Digits(Dataset):
    """28x28 digit images held in memory as uint8, normalised as they are fetched."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices):  # a whole batch in one indexing op: no workers needed
        images = (self.images[indices].float() / 255 - MNIST_MEAN) / MNIST_STD
        return list(zip(images.unsqueeze(1), self.labels[indices]))


def _arc(cx, cy, rx, ry, start, stop, n):
    """n+1 points on an elliptical arc (degrees; 0 = right, 90 = down), rounded so the table
    is the same whatever libm computed cos and sin."""
    angles = [math.radians(start + (stop - start) * i / n) for i in range(n + 1)]
    return [(round(cx + rx * math.cos(a), 4), round(cy + ry * math.sin(a), 4)) for a in angles]


DIGIT_STROKES = [  # a pen path per digit: 1-2 polylines in a unit box (y downwards)
    [_arc(.5, .5, .3, .5, 0, 360, 12)], [[(.3, .2), (.55, 0), (.55, 1)]],
    [_arc(.5, .28, .28, .28, 170, 400, 6) + [(.2, 1), (.82, 1)]],
    [_arc(.47, .25, .26, .25, 200, 450, 6) + _arc(.47, .75, .3, .25, 270, 520, 6)],
    [[(.62, 0), (.18, .66), (.85, .66)], [(.64, .35), (.64, 1)]],
    [[(.78, 0), (.3, 0), (.26, .44)] + _arc(.5, .7, .3, .3, 235, 510, 7)],
    [[(.7, 0), (.38, .3)] + _arc(.5, .72, .26, .28, 200, -160, 9)], [[(.18, 0), (.82, 0), (.4, 1)]],
    [_arc(.5, .24, .22, .24, 90, 450, 8), _arc(.5, .73, .27, .27, -90, 270, 8)],
    [_arc(.5, .3, .26, .3, 0, 360, 9) + [(.72, 1)]]]


def _segment_distance(px, py, x0, y0, x1, y1):
    """Distance from points (px, py) to segments (x0, y0)-(x1, y1); all arguments broadcast."""
    ux, uy, ax, ay = x1 - x0, y1 - y0, px - x0, py - y0
    t = ((ax * ux + ay * uy) / (ux * ux + uy * uy).clamp_min(1e-9)).clamp(0, 1)
    return ((ax - t * ux) ** 2 + (ay - t * uy) ** 2).sqrt()


def synthetic_digits(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Offline MNIST stand-ins, drawn like handwriting: each digit's pen path through a random
    shift, scale, shear, bend and rotation, inked at a random width, 30 % with a stray stroke.
    uint8 [count, 28, 28] and labels; chunks of 250 seeded from (seed, chunk), so the first k
    of any call are a call with count=k. Only rand and + - * / sqrt: the same bits on any CPU."""
    grid, lo, cell = 64, -0.5, 2 / 63  # each digit's distance to its path, on a 64 x 64 grid
    g64 = lo + cell * torch.arange(grid)
    field = torch.stack([_segment_distance(g64, g64[:, None], *torch.tensor(
        [(*p, *q) for line in strokes for p, q in zip(line, line[1:])]).T[..., None, None]
    ).amin(0) for strokes in DIGIT_STROKES]).flatten()
    chunk, images, labels, pix = 250, [], [], torch.arange(28.0)
    for c in range(0, count, chunk):
        g = torch.Generator().manual_seed(seed * 1_000_003 + c // chunk)

        def uniform(lo, hi, *shape):  # by default one value per sample: [n, 1, 1]
            return lo + (hi - lo) * torch.rand(shape or (chunk, 1, 1), generator=g)
        y = torch.randint(0, 10, (chunk,), generator=g)
        size = uniform(17, 22)  # pixel -> unit box: shift, scale (x narrower), shear, bend
        x = (pix - uniform(11.5, 15.5)) / (size * uniform(.75, 1.05))
        z = (pix[:, None] - uniform(11.5, 15.5)) / size
        x = x + uniform(-.3, .3) * z
        x, z = x + uniform(-.4, .4) * z * z, z + uniform(-.4, .4) * x * x
        t = uniform(-.13, .13)  # a rotation by up to ~15 degrees, from t = tan(angle / 2)
        cos, sin = (1 - t * t) / (1 + t * t), 2 * t / (1 + t * t)
        u, v = (cos * x - sin * z + .5 - lo) / cell, (sin * x + cos * z + .5 - lo) / cell
        u, v = u.clamp(0, grid - 1.001), v.clamp(0, grid - 1.001)  # bilinear lookup
        iu, iv = u.floor(), v.floor()
        fu, fv = u - iu, v - iv
        i = ((y[:, None, None] * grid + iv) * grid + iu).long()
        d00, d01, d10, d11 = (field.take(i + o) for o in (0, 1, grid, grid + 1))
        dist = ((d00 + fu * (d01 - d00)) * (1 - fv) + (d10 + fu * (d11 - d10)) * fv) * size
        stray = uniform(0, 1) < 0.3  # else parked far off the canvas
        sx, sy = uniform(0, 28).where(stray, -1e3), uniform(0, 28).where(stray, -1e3)
        dist = dist.minimum(_segment_distance(pix, pix[:, None], sx, sy,
                                              sx + uniform(-8, 8), sy + uniform(-8, 8)))
        radius, soft, bright = uniform(.6, 1.8), uniform(.8, 1.6), uniform(.7, 1)
        ink = ((radius - dist) / soft + 0.5).clamp(0, 1) * bright
        ink = (ink + uniform(0, .15, chunk, 28, 28) * uniform(0, 1)).clamp(0, 1)  # background
        images.append((ink * 255).round().to(torch.uint8))
        labels.append(y)
    return torch.cat(images)[:count], torch.cat(labels)[:count]


def load_datasets(args, run, download: bool) -> tuple[Digits, Digits]:
    """(train, test), cut to --train/--test-samples: MNIST in --data-dir through torchvision's
    reader (downloaded there by the processes given download=True while the others wait), or
    the synthetic digits above: --data synthetic, or --data auto where MNIST cannot be had."""
    why, sets, wanted = None, None, args.data != "synthetic"
    if wanted:  # (offline, no need to pay torchvision's ~3 s import)
        from torchvision.datasets import MNIST
    try:
        for train in (True, False) if download and wanted else ():
            MNIST(args.data_dir, train=train, download=True)  # (nothing, if the files are there)
    except Exception as err:  # noqa: BLE001 -- offline, a mirror down, a full disk ...
        why = err
    if dist.is_initialized():
        dist.barrier()  # the others read only once the files are complete
    if wanted:
        try:
            sets = [MNIST(args.data_dir, train=train) for train in (True, False)]
        except RuntimeError as err:  # "Dataset not found"
            why = why or err
    found = torch.tensor(float(sets is not None), device=run.device)
    if dist.is_initialized():  # every rank trains on the same data, or none trains
        dist.all_reduce(found, op=dist.ReduceOp.MIN)
    if not found and args.data == "mnist":
        raise UserError(f"MNIST is not in {args.data_dir} and could not be had ({why})")
    if not found and args.data == "auto":
        log(run, f"warning: MNIST not in {args.data_dir / 'MNIST' / 'raw'} and not downloadable"
                 f"; using built-in synthetic digits (--data synthetic to silence this)")
    if not found:
        return (Digits(*synthetic_digits(args.train_samples or 60_000, seed=1)),
                Digits(*synthetic_digits(args.test_samples or 10_000, seed=2)))
    train, test = sets
    return (Digits(train.data[:args.train_samples], train.targets[:args.train_samples]),
            Digits(test.data[:args.test_samples], test.targets[:args.test_samples]))


def make_loader(dataset, batch_size: int | None, run, args, worker_init_fn=None,
                **kwargs) -> DataLoader:
    """No worker processes by default: the data is in memory. Shuffling and the workers'
    seeds come from the global RNG, which seed_everything seeds each epoch (exact resume)."""
    kwargs.setdefault("num_workers", args.num_workers or 0)
    return DataLoader(dataset, batch_size=batch_size, pin_memory=run.device.type == "cuda",
                      worker_init_fn=worker_init_fn or seed_worker, **kwargs)


def seed_worker(worker_id: int) -> None:
    """In each DataLoader worker: python and numpy from torch's per-worker seed."""
    random.seed(torch.initial_seed() % 2**32)
    np.random.seed(torch.initial_seed() % 2**32)


class Net(nn.Module):
    """pytorch/examples' MNIST CNN: two convolutions, dropout, two linear layers (1.2 M
    parameters). `width` multiplies fc1's hidden units (benchmarks: more to communicate)."""

    def __init__(self, dropout: bool = True, width: int = 1):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 3), nn.Conv2d(32, 64, 3)
        self.fc1, self.fc2 = nn.Linear(9216, 128 * width), nn.Linear(128 * width, 10)
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout2(F.relu(self.fc1(torch.flatten(self.dropout1(x), 1))))
        return self.fc2(x)  # logits; cross_entropy applies log-softmax


def build_model(args, seed: int) -> Net:
    """Initialised from `seed` alone: the same seed, the same weights, whatever ran before."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Net(dropout=args.dropout, width=getattr(args, "width", 1))


# ---------------------------------------------------------------- 06's file
def write_h5(path: Path, train_set: Digits, test_set: Digits, chunk: int, compression) -> None:
    """Both sets as uint8 in chunks with a checksum each (fletcher32), built in memory (on a full
    disk HDF5 crashed closing the file), then renamed into place whole: never half a file."""
    import io, h5py  # noqa: E401 -- here: only step 06 needs h5py
    image = io.BytesIO()
    with h5py.File(image, "w") as f:
        f.attrs.update(mean=MNIST_MEAN, std=MNIST_STD)
        for name, digits in [("train", train_set), ("test", test_set)]:
            for part, data in [("images", digits.images), ("labels", digits.labels)]:
                f.create_dataset(f"{name}/{part}", data=data.numpy(), compression=compression,
                                 chunks=(min(chunk, len(data)), *data.shape[1:]), fletcher32=True)
            f[name].attrs.update(count=len(digits), shape=(28, 28))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomically(path, lambda file: file.write(image.getbuffer()))


def open_h5(args) -> tuple[int, int, Digits]:
    """(training samples to use, chunk size, the test set in memory) from write_h5's file."""
    import h5py
    try:
        with h5py.File(args.h5, "r") as f:
            test = Digits(torch.from_numpy(f["test/images"][:args.test_samples]),
                          torch.from_numpy(f["test/labels"][:args.test_samples]).long())
            return args.train_samples or len(f["train/labels"]), f["train/images"].chunks[0], test
    except (OSError, KeyError, ValueError, TypeError) as err:  # one line; h5py runs nothing read
        raise UserError(f"{args.h5} is not a readable digits file ({err}); delete it to prepare "
                        f"it again") from None


# ---------------------------------------------------------------- the flags
def whole(text: str) -> int:
    """A count of at least 1 (an argparse type): 0 epochs or 0 samples are refused, not run."""
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text}")
    return int(text)


def positive(text: str) -> float:
    """A finite number above 0 (an argparse type): a --lr or --timeout of 0 or nan is refused."""
    if not 0 < float(text) < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number above 0, not {text}")
    return float(text)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the whole usage
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")

    def parse_args(self, args=None, namespace=None):
        args = super().parse_args(args, namespace)
        if getattr(args, "lr_scaling", None) and args.warmup_steps is None:  # (docs/running.md)
            args.warmup_steps = 20 if args.lr_scaling != "none" else 0
        return args


def parser(doc: str, script: str, cls=Parser) -> argparse.ArgumentParser:
    """The flags every training step takes; a step adds its own before parse_args()."""
    p = cls(prog=Path(script).name, description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--data", choices=["auto", "mnist", "synthetic"], default="auto",
        help="auto: MNIST if present or downloadable, else built-in synthetic digits")
    add("--data-dir", type=Path, default=Path("data"))
    add("--train-samples", type=whole, metavar="N", help="only the first N training samples")
    add("--test-samples", type=whole, metavar="N", help="only the first N test samples")
    add("--num-workers", type=int, metavar="N", help="DataLoader workers per rank (default 0)")
    add("--epochs", type=whole, default=2)
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--batch-size", type=whole, default=256,
                       help="GLOBAL batch: samples per optimizer step, summed over all ranks")
    batch.add_argument("--batch-per-rank", type=whole, metavar="B",
                       help="instead: B samples per rank per step (a global B x world size)")
    add("--max-device-batch", type=whole, metavar="M",
        help="most samples one device takes at once; more run as accumulated micro-batches")
    add("--lr", type=positive, default=0.05, help="learning rate (for one rank's B with "
        "--batch-per-rank)")
    add("--lr-scaling", choices=["none", "linear", "sqrt"], default="none",
        help="with --batch-per-rank: multiply --lr by the world size, or its square root")
    add("--warmup-steps", type=int, metavar="N", help="steps of warm-up to the scaled --lr")
    add("--seed", type=int, default=0)
    add("--deterministic", action="store_true", help="the same bits on GPUs too")
    add("--no-dropout", dest="dropout", action="store_false", help="turn dropout off")
    add("--width", type=int, default=1, help=argparse.SUPPRESS)  # benchmarks: a wider fc1
    add("--device", choices=["auto", "cpu", "cuda"], default="auto")
    add("--amp", action="store_true", help="bf16 autocast on GPUs that support it")
    add("--timeout", type=positive, default=600, metavar="SECONDS",
        help="how long a collective waits for a peer before failing")
    add("--out-dir", type=Path, default=f"runs/{Path(script).stem}")
    add("--profile", action="store_true", help="trace a few steps per rank into <out-dir>/profile")
    add("--resume", type=Path, metavar="PATH", help="continue from a checkpoint")
    add("--quiet", action="store_true", help="one line per epoch, no progress lines")
    return p


def announce(run: Run, args, plan: BatchPlan, script: str, **extra) -> None:
    """The start-up line: what this run is, checkable before waiting for an epoch."""
    if args.amp and not run.amp:  # a CPU, or a GPU that only emulates bf16 (V100, T4)
        where = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "a CPU"
        log(run, f"note: --amp computes in bf16, which {where} has no native support for "
                 f"(emulated, slower than float32): training in float32, amp=False")
    if args.lr_scaling != "none":  # what --lr becomes, and how fast
        extra = {"lr": f"{args.lr:g}x{lr_scale(args, plan):.3g} ({args.lr_scaling}, warm-up "
                       f"{args.warmup_steps} steps)", **extra}
    details = "".join(f" {key}={value}" for key, value in extra.items())
    log(run, f"{os.path.basename(script)}: device={run.device} world_size={run.world_size} "
             f"batch={plan.global_batch} (= {run.world_size} rank{'s' * (run.world_size > 1)} x "
             f"{plan.per_rank}, {plan.accumulation_steps} micro-batch(es) of {plan.micro_batch}) "
             f"threads/rank={torch.get_num_threads()} amp={run.amp} seed={args.seed} "
             f"deterministic={'on' if args.deterministic else 'off'}{details}")


# ---------------------------------------------------------------- progress, results, files
class Progress:
    """In the training loop: samples/s of each epoch (all ranks, first step excluded: it pays
    one-off costs), and with --profile a trace of steps 3-5 per rank for TensorBoard."""

    def __init__(self, run, args, steps_per_epoch: int):
        self.run, self.args, self.steps_per_epoch = run, args, steps_per_epoch
        self.samples, self.seconds, self.profiler = 0, 0.0, nullcontext()
        self.first_step_seconds = None  # the run's first step: one-off costs (compile, cuDNN)
        if args.profile and (args.out_dir / "profile").is_symlink():  # its target is not ours
            raise UserError(f"{args.out_dir / 'profile'} is a symbolic link: not writing into it")
        if args.profile:
            self.profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    str(args.out_dir / "profile"), worker_name=f"rank{run.rank}"))

    def __enter__(self):
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        return self.profiler.__exit__(*exc)

    def start_epoch(self, epoch: int, steps_done: int = 0) -> None:
        self.epoch, self.step_index, self.epoch_samples = epoch, steps_done, 0
        self.started, self.timing = self._now(), False

    def step(self, loss_sum: torch.Tensor, samples: int, samples_so_far: int) -> None:
        """After every optimizer step, on every rank (the epoch's sums so far on this rank)."""
        self.step_index += 1
        if not self.timing:  # the clock starts after the epoch's first step
            now = self._now()
            self.first_step_seconds = self.first_step_seconds or now - self.started  # the run's
            self.started, self.timing = now, True
        else:
            self.epoch_samples += samples
        done, total = self.step_index, self.steps_per_epoch  # a line per tenth of the epoch
        if self.run.is_main and not self.args.quiet and self.epoch_samples and done < total and (
                done % math.ceil(total / 10) == 0):  # (.item() waits for the device: rarely)
            rate = self.epoch_samples * self.run.world_size / max(self._now() - self.started, 1e-9)
            print(f"epoch {self.epoch + 1}: step {done}/{total} ({100 * done / total:.0f}%), "
                  f"{rate:,.0f} samples/s, loss {loss_sum.item() / samples_so_far:.4f}", flush=True)
        if self.args.profile:
            self.profiler.step()

    def _now(self) -> float:
        if self.run.device.type == "cuda":
            torch.cuda.synchronize(self.run.device)  # GPU work is asynchronous
        return time.perf_counter()

    def end_epoch(self) -> float | None:
        """This epoch's samples/s, all ranks together (None: too few steps to time)."""
        if not self.epoch_samples:
            return None
        seconds = self._now() - self.started
        self.samples, self.seconds = self.samples + self.epoch_samples, self.seconds + seconds
        return self.epoch_samples * self.run.world_size / seconds

    @property
    def samples_per_sec(self) -> float | None:
        return self.samples * self.run.world_size / self.seconds if self.seconds else None


@torch.no_grad()
def test_sums(model, loader, run) -> torch.Tensor:
    """[loss sum, correct answers, samples] over every batch of `loader`, on the device."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=run.device)
    for images, labels in loader:
        images, labels = images.to(run.device), labels.to(run.device)
        with run.autocast():
            logits = model(images)
        sums[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        sums[1] += (logits.argmax(dim=1) == labels).sum()
        sums[2] += len(labels)
    return sums


def test_results(sums: torch.Tensor) -> dict:
    """Loss and accuracy from test_sums (added up over ranks, where there are several)."""
    loss_sum, correct, count = sums.tolist()
    return {"loss": loss_sum / count, "accuracy": correct / count,
            "correct": int(correct), "samples": int(count)}


class Metrics:
    """One line per epoch (rank 0) and <out-dir>/summary.json at the end."""

    def __init__(self, run, args):
        self.run, self.out_dir, self.train_losses, self.lrs = run, args.out_dir, [], []
        args.out_dir.mkdir(parents=True, exist_ok=True)

    def epoch(self, epoch: int, train_loss: float, test: dict, samples_per_sec, lr) -> None:
        self.train_losses.append(train_loss)
        self.lrs.append(lr)
        rate = "n/a" if samples_per_sec is None else f"{samples_per_sec:,.0f}"
        log(self.run, f"epoch {epoch + 1}: train loss {train_loss:.4f}  test loss "
                      f"{test['loss']:.4f}  test accuracy {100 * test['accuracy']:.2f}% "
                      f"({test['correct']}/{test['samples']})  {rate} samples/s")

    def summary(self, script: str, args, plan: BatchPlan, test: dict, progress: Progress,
                **extra) -> dict:
        summary = {"script": Path(script).name, "world_size": self.run.world_size,
                   "device": str(self.run.device), "global_batch_size": plan.global_batch,
                   "epochs": args.epochs, "seed": args.seed, "lr": args.lr, "lrs": self.lrs,
                   "train_losses": self.train_losses, "test_loss": test["loss"],
                   "test_accuracy": test["accuracy"], "samples_per_sec": progress.samples_per_sec,
                   **extra}
        if self.run.is_main:
            save_atomically(self.out_dir / "summary.json",
                            lambda file: file.write(json.dumps(summary, indent=2).encode()))
        return summary


def save_atomically(path: Path, write) -> None:
    """write(file) into a new temporary file, then rename it over `path`: a crash mid-write keeps
    the old file. mkstemp makes it under a random name, and it is written through the descriptor
    mkstemp opened, never reopened by name: no link planted or swapped in sends it elsewhere."""
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with open(handle, "wb") as file:
            write(file)
            if not os.path.samestat(os.fstat(file.fileno()), os.lstat(temporary)):
                raise OSError(f"{temporary} was replaced by another file while it was written")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def save_torch(path: Path, state) -> None:
    """torch.save, atomically. A full disk raises the file's OSError or, when the file's last
    flush fits, torch's RuntimeError "unexpected pos ..." over it (torch 2.14.1)."""
    save_atomically(path, lambda file: torch.save(state, file))


def save_checkpoint(path: Path, model, optimizer, scheduler, epoch: int, **extra) -> None:
    save_torch(path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                      "scheduler": scheduler.state_dict(), "epoch": epoch, **extra})


def restore_checkpoint(path: Path, run, model, optimizer, scheduler) -> dict:
    """Load a checkpoint into the model, optimizer and scheduler; return it ("epoch": the
    finished epochs). weights_only: reading a file runs no code from it."""
    saved = torch.load(path, map_location=run.device, weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    log(run, f"resumed from {path} after epoch {saved['epoch']}")
    return saved


# ---------------------------------------------------------------- 05's who-is-who, for 07b-09
def use_srun_identity() -> None:
    """As in step 05: under `srun` without torchrun, SLURM's variables say who a process is."""
    env = os.environ
    if "RANK" in env or int(env.get("SLURM_STEP_NUM_TASKS", 1)) < 2:
        return  # started by torchrun, or by plain python
    env.update(RANK=env["SLURM_PROCID"], LOCAL_RANK=env["SLURM_LOCALID"],
               WORLD_SIZE=env["SLURM_STEP_NUM_TASKS"], GROUP_RANK=env["SLURM_NODEID"],
               LOCAL_WORLD_SIZE=str(slurm_tasks_on_this_node()))
    env.setdefault("MASTER_ADDR", slurm_head_address(env["SLURM_STEP_NODELIST"]))
    env.setdefault("MASTER_PORT", str(15000 + int(env["SLURM_JOB_ID"]) % 15000))


def report_topology(run) -> int:
    """As in step 05: rank 0 prints where every rank runs; returns the node count."""
    node_rank = int(os.environ.get("GROUP_RANK", 0))  # torchrun's name for the node rank
    steering = " ".join(f"{name}={value}" for name, value in sorted(os.environ.items())
                        if name == "NODE_RANK" or name.startswith("NCCL_")
                        or name.endswith("_SOCKET_IFNAME"))
    me = (node_rank, run.hostname, run.rank, run.local_rank, str(run.device), steering)
    everyone = [None] * run.world_size
    dist.all_gather_object(everyone, me)  # a collective: every rank must call it
    for node, host, rank, local_rank, device, steering in everyone:
        log(run, f"[node {node} {host}] rank {rank}/{run.world_size} local rank {local_rank} "
                 f"on {device}" + (f" ({steering})" if steering else ""))
    return len({node for node, *_ in everyone})


# ---------------------------------------------------------------- 07a-07's mechanics, for 08a-09
EXIT_STOPPED = 75  # "temporary failure, try again" (sysexits.h): stopped early, resumable
# SLURM's SIGTERM (USR1/USR2 with --signal) and what else torchrun forwards to its workers.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
EPOCH_START = {"step": 0, "loss_sum": 0.0, "samples": 0}  # steps done, and their sums


class ResumableSampler(DistributedSampler):
    """As in step 07a: skips the `skip` samples (of the same order) that a checkpoint covers."""
    skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self):
        return super().__len__() - self.skip


class StopRequest:
    """As in step 07: the ranks vote about once a second, all save at the same step; a signal
    before the first step, or a second one (not a repeat within 5 s), ends at once (end_now)."""

    def __init__(self):
        self.requested, self.at, self.steps, self.next_vote = None, 0.0, 0, 1
        self.started = time.monotonic()
        for signum in STOP_SIGNALS:
            signal.signal(signum, self.note)

    def note(self, signum, frame):
        name, now = signal.Signals(signum).name, time.monotonic()
        if not self.steps or (self.requested and now - self.at >= 5):
            end_now(signum, f"a second stop signal ({name} after {self.requested})"
                    if self.requested else f"{name} before the first training step")
        self.requested, self.at = self.requested or name, self.at or now

    def agreed(self, run) -> bool:
        self.steps += 1
        if self.steps < self.next_vote:
            return False
        pace = self.steps / (time.monotonic() - self.started)  # steps per second so far
        votes = torch.tensor([float(self.requested is not None), pace], device=run.device)
        dist.all_reduce(votes)  # any request stops all; the mean pace times the next vote
        self.next_vote = self.steps + max(1, int(votes[1] / run.world_size))  # in ~1 s
        return bool(votes[0] > 0)


def end_now(signum: int, why: str) -> None:
    """A stop signal that cannot wait for a checkpoint: one line, exit 128 + its number."""
    print(f"error: {why}: stopped at once, without a checkpoint", file=sys.stderr, flush=True)
    os._exit(128 + signum)  # (from a signal handler, mid-step: nothing is worth finishing)


def ignore_stop_signals(worker_id):
    """As in step 07: DataLoader workers ignore the stop signals and Ctrl-C."""
    seed_worker(worker_id)
    for signum in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(signum, signal.SIG_IGN)


def rng_state() -> dict:  # what this rank's dropout draws next, on the CPU and the GPU
    return {"cpu": torch.get_rng_state(),
            **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_initialized() else {})}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"].cpu())  # (.cpu(): a checkpoint may load to the GPU)
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def restarted(run) -> bool:
    """As in step 07b: True on every rank if torchrun or SLURM restarted any (a collective)."""
    votes = torch.tensor(float(any(int(os.environ.get(name, 0)) > 0 for name in (
        "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))), device=run.device)
    dist.all_reduce(votes)
    return bool(votes > 0)


def run_settings(script, args, plan, train_set) -> dict:
    """What makes a run the same run, saved with each checkpoint (07a-09): the step, the data (a
    fingerprint of its labels), the flags that order an epoch's samples or shape the training
    (not the world size: with the same global batch, any trains the same samples per step)."""
    labels = train_set.labels.long()
    return {"step": Path(script).name, "data": int((labels * torch.arange(len(labels))).sum()),
            "train_samples": len(train_set), "seed": args.seed, "global_batch": plan.global_batch,
            **{key: vars(args)[key] for key in ("width", "dropout", "lr", "lr_scaling",
                                                "warmup_steps")}}


def differences(saved, settings: dict, keys=()) -> str:
    """`seed 0 -> 1, ...` for each setting that `saved` records otherwise."""
    saved = saved if isinstance(saved, dict) else {}
    return ", ".join(f"{key} {saved.get(key)!r} -> {settings[key]!r}"
                     for key in keys or settings if saved.get(key) != settings[key])


def adopted(latest, saved, settings: dict, run):
    """`latest` if this run's settings wrote it (`saved`), else None, and a line saying why."""
    differ = differences(saved, settings)
    if differ:
        log(run, f"not resuming from {latest}: another run wrote it ({differ}); starting "
                 f"afresh: this run's first checkpoint replaces it")
    return None if differ else latest


def check_same_sample_order(saved, position: dict, settings: dict, path) -> None:
    """Mid-epoch, only the settings that ordered the epoch (`saved`) continue it: others would
    skip some samples and train others twice (refused, naming what differs)."""
    differ = differences(saved, settings, ("step", "data", "train_samples", "seed",
                                           "global_batch")) if position["step"] else ""
    if differ:
        raise UserError(f"checkpoint {path} was written in the middle of an epoch, by a run with "
                        f"other settings ({differ}): continuing it would skip some samples and "
                        f"repeat others. Resume with that run's settings, or from an epoch's end")

