"""What every step shares: who a process is, device choice, process-group setup, seeding,
the batch plan, the learning-rate schedule.

Step 00 first needs it. Each numbered step keeps its own idea in its own file; what all of
them need but none of them teaches lives here or, below it, in the harness/ package: the
command line (flags.py), errors.py, data.py, model.py, checkpoint.py, metrics.py,
profiling.py. common.py imports from harness/, never the other way round.
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from harness.errors import UserError, record, report, run_main  # noqa: F401 -- steps use them
from harness.ranks import all_ranks_agree, join_group, log  # noqa: F401 -- steps call log
from harness.schedule import LRSchedule


# ---------------------------------------------------------------- the torch this runs on
def require_torch(version: str, why: str) -> None:
    """Stop with one line (exit 2) when the installed torch is older than `version`.

    A step that needs a newer torch than requirements.txt's oldest calls this first, before the
    imports that only the newer torch has: it says which version it needs before any work,
    instead of failing later in a traceback. (Not a UserError: it may run before main().)"""
    if torch_older_than(version):
        report(f"{os.path.basename(sys.argv[0])} needs torch >= {version} ({why}); this is "
               f"torch {torch.__version__}: pip install 'torch>={version}' and its torchvision")
        sys.exit(2)


def torch_older_than(version: str) -> bool:
    """True when the installed torch is older than `version` ("2.8" or "2.8.1")."""
    def numbers(text):
        return tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3])
    return numbers(torch.__version__) < numbers(version)


SUPPORTED_FROM = "2.8"  # README, "Versions"; requirements.txt's floor


def warn_of_unsupported_torch() -> None:
    """One warning line at start (rank 0) on a torch older than the supported range, and the
    run goes on: the steps compute the same on 2.7, and what can go wrong, a hang in
    destroy_process_group, comes at the very end (README, "Versions"). A refusal would stop a
    learner whose cluster has nothing newer, for a hang that came in 2 of 6 runs."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))  # (srun: no RANK yet)
    if torch_older_than(SUPPORTED_FROM) and rank == "0":
        print(f"warning: torch {torch.__version__} is older than {SUPPORTED_FROM}, the oldest "
              f"supported: a step can hang at its very end, in destroy_process_group (README, "
              f"\"Versions\"); pip install 'torch>={SUPPORTED_FROM}' and its torchvision",
              file=sys.stderr, flush=True)


warn_of_unsupported_torch()  # at import: every step imports this file before its work starts


def torch_needed_by(script) -> str | None:
    """The version a step's require_torch(...) line asks for, or None (tour.py reads it)."""
    found = re.search(r'require_torch\("([\d.]+)"', Path(script).read_text())
    return found.group(1) if found else None


# ---------------------------------------------------------------- who and where
@dataclass
class Run:
    """Who this process is and where it computes."""

    device: torch.device
    rank: int = 0  # global rank: 0 .. world_size-1 over all nodes
    local_rank: int = 0  # rank on this node: picks the GPU
    world_size: int = 1
    amp: bool = False  # asked for; kept only where bf16 autocast is supported (see below)
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
    """cuda:<local_rank> when GPUs are visible (or asked for), else the CPU; then the settings
    that device wants. Apple's GPU (mps) is not used: DDP has no backend for it."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise UserError("--device cuda, but no CUDA GPU is visible "
                        "(check nvidia-smi and CUDA_VISIBLE_DEVICES, or use --device cpu)")
    elif local_world_size > torch.cuda.device_count():
        raise UserError(f"{local_world_size} processes on this node but only "
                        f"{torch.cuda.device_count()} GPU(s) visible: start at most "
                        f"--nproc-per-node {torch.cuda.device_count()} (NCCL needs one GPU per "
                        f"process)")
    else:
        device = torch.device("cuda", local_rank)
        # TF32: float32 matmuls on tensor cores (10-bit mantissa), several times faster and
        # harmless for training; cuDNN convolutions use it by default. (Not the newer
        # torch.backends.cuda.matmul.fp32_precision: once it is set, torch 2.14's
        # torch.get_float32_matmul_precision() raises, and inductor's autotuning calls it.)
        torch.set_float32_matmul_precision("high")
        # cuDNN: time the convolution algorithms once for our fixed shapes, keep the fastest.
        torch.backends.cudnn.benchmark = True
    if "OMP_NUM_THREADS" not in os.environ:
        # N processes on one machine would each use all its cores: N-fold oversubscription.
        # (torchrun sets OMP_NUM_THREADS=1 itself when it starts more than one process.)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    return device


def set_deterministic(on: bool) -> None:
    """--deterministic: the same seed gives the same bits on a GPU too. (On the CPU every kernel
    these steps use is deterministic already.) Without it, cuDNN runs the convolution algorithm
    its autotuner found fastest, and some CUDA kernels add with atomics, in whatever order the
    threads arrive: two runs, or a run and its resume, differ in the last bits."""
    if not on:
        return
    # cuBLAS repeats its results only with a fixed workspace, set before its first call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False  # the same convolution algorithm every run
    torch.backends.cudnn.deterministic = True
    # An op with no deterministic kernel warns, naming itself, rather than stopping the run.
    torch.use_deterministic_algorithms(True, warn_only=True)


# ---------------------------------------------------------------- the process group
def setup_distributed(args) -> Run:
    """Join the process group, as step 02's setup() writes out (steps 04 on call this)."""
    rank = int(os.environ.get("RANK", 0))  # 0 .. world_size-1
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # which process on this machine
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # processes on this machine
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # plain python: a world of one
    os.environ.setdefault("MASTER_PORT", "0")
    device = choose_device(args.device, local_rank, local_ranks)
    set_deterministic(args.deterministic)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this rank's GPU, before NCCL starts on it
    # init_process_group, plus a check-in that names the ranks that never came (see ranks.py)
    join_group(backend, rank, world_size, args.timeout,
               device_id=device if device.type == "cuda" else None)
    return Run(device, rank, local_rank, world_size, amp=args.amp, backend=backend)


def describe_buckets(model) -> str:
    """DDP's gradient buckets, as step 03 writes out (steps 04 on call this)."""
    info = model._get_ddp_logging_data() if hasattr(model, "_get_ddp_logging_data") else {}
    if "rebuilt_bucket_sizes" not in info:  # too few steps yet, or a torch without the report
        return "DDP's gradient buckets: not reported yet (DDP reports them after a few steps)"
    names = [name.removeprefix("_orig_mod.") for name, _ in model.module.named_parameters()]
    buckets = zip(info["rebuilt_bucket_sizes"].split(", "),
                  info["rebuilt_per_bucket_param_indices"].split(", "))
    return "DDP's gradient buckets, in the order they are all-reduced:\n" + "\n".join(
        f"  bucket {i}: {int(size) / 2**20:.3f} MiB: "
        f"{', '.join(names[int(p)] for p in indices.split())}"
        for i, (size, indices) in enumerate(buckets))


# ---------------------------------------------------------------- seeding
def seed_everything(seed: int, epoch: int = 0, rank: int = 0) -> None:
    """Seed python, numpy and torch (CPU and GPUs) from (seed, epoch, rank).

    Called at the start of every epoch, so an epoch's random draws (shuffle, dropout, the
    DataLoader's worker seeds) depend on nothing but these three numbers: a run resumed at
    an epoch draws exactly what the uninterrupted run drew. `rank` gives each rank its own
    dropout masks.
    """
    key = int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])
    random.seed(key)
    np.random.seed(key)
    torch.manual_seed(key)


# ---------------------------------------------------------------- the batch plan
@dataclass(frozen=True)
class BatchPlan:
    global_batch: int  # samples per optimizer step, all ranks together
    per_rank: int  # samples each rank contributes per step
    micro_batch: int  # samples per forward/backward (<= --max-device-batch)
    accumulation_steps: int  # micro-batches per optimizer step
    lr_batch: int  # the batch --lr is meant for: the global one, or with --batch-per-rank B, B


def plan_batches(args, world_size: int, train_samples: int | None = None) -> BatchPlan:
    """Split the global batch over ranks, and over micro-batches when a device cannot hold it.

    --batch-size G keeps the GLOBAL batch fixed while ranks are added (strong scaling): each
    step averages the same G samples, so N ranks compute what one process computes and the
    learning rate stays. --batch-per-rank B keeps each rank's batch instead (weak scaling): the
    global batch is B x world size, each epoch has fewer, larger steps, and --lr (meant for
    one rank's B) may be scaled with the global batch: --lr-scaling, see lr_schedule.
    """
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
    max_device_batch = args.max_device_batch
    steps = math.ceil(per_rank / max_device_batch) if max_device_batch else 1
    while per_rank % steps:  # equal micro-batches: every one weighs the same
        steps += 1
    return BatchPlan(global_batch, per_rank, per_rank // steps, steps, lr_batch)


# ---------------------------------------------------------------- the learning rate
def lr_scale(args, plan: BatchPlan) -> float:
    """What --lr-scaling multiplies --lr by once warmed up: k = global batch / the batch --lr is
    meant for (the world size, with --batch-per-rank), or its square root. Goyal et al. (2017)
    scale linearly: k times the batch averages the gradient over k times the samples, and k
    small steps of SGD move about as far as one step of k times the rate, while the gradient
    changes little between them. The square root keeps the update's noise the same instead
    (Krizhevsky, 2014; Hoffer et al., 2017). Both are starting points: bench/ measures them."""
    k = plan.global_batch / plan.lr_batch
    return {"none": 1.0, "linear": k, "sqrt": math.sqrt(k)}[args.lr_scaling]


def lr_schedule(optimizer, args, plan: BatchPlan, steps_per_epoch: int) -> LRSchedule:
    """The learning rate of every optimizer step (harness/schedule.py): --lr x lr_scale after
    a linear warm-up of --warmup-steps from --lr, times 0.7 per epoch. Step it after every
    optimizer.step(); without scaling it is the per-epoch 0.7 decay of step 00."""
    return LRSchedule(optimizer, lr_scale(args, plan), args.warmup_steps, steps_per_epoch)


# ---------------------------------------------------------------- torch.compile
def compile_choice(args, run: Run) -> bool:
    """--compile / --no-compile; by default on GPUs, off on the CPU (measured slower there for
    this model). Compiling builds native code on this node, so the tools it needs are checked
    now, not found as a traceback inside the first step: an explicit --compile without them is
    one error line; the default falls back to eager with one note."""
    wanted = args.compile if args.compile is not None else run.device.type == "cuda"
    missing = missing_compile_tools(run.device) if wanted else None
    if missing and args.compile:
        raise UserError(f"--compile needs {missing}; install it, or use --no-compile")
    if missing:
        log(run, f"note: not compiling: torch.compile needs {missing}; training eagerly")
        return False
    return wanted


def missing_compile_tools(device: torch.device) -> str | None:
    """What torch.compile lacks on this node to build its kernels, or None. Read in torch 2.15:
    on a GPU, Triton (triton/runtime/build.py: _find_compiler, _build) compiles each kernel's
    launcher with $CC, else gcc, else clang, against Python.h from sysconfig's include folder
    (scheme posix_prefix for Debian's posix_local); on the CPU, inductor
    (torch/_inductor/cpp_builder.py: get_cpp_compiler, _get_python_include_dirs; config.cpp.cxx)
    compiles C++ with $CXX, else g++, against sysconfig's include folder."""
    if device.type == "cuda":
        compiler = next(filter(None, (os.environ.get("CC"), shutil.which("gcc"),
                                      shutil.which("clang"))), None)
        what = "a C compiler (gcc or clang, or one named by $CC)"
        scheme = sysconfig.get_default_scheme()
        include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local"
                                      else scheme)["include"]
    else:
        compiler = os.environ.get("CXX", "g++")
        what = "a C++ compiler (g++, or one named by $CXX)"
        include = sysconfig.get_path("include")
    if not compiler or not shutil.which(compiler):
        return f"{what}, and none was found"
    if not (Path(include) / "Python.h").exists():
        return (f"Python's C headers (Python.h, not in {include}: e.g. apt install python3-dev, "
                f"or your cluster's python module)")
    return None


# ---------------------------------------------------------------- small helpers
def announce(run: Run, args, plan: BatchPlan, script: str, **extra) -> None:
    """The start-up line: what this run is, checkable before waiting for an epoch."""
    if args.amp and not run.amp:  # a CPU, or a GPU that only emulates bf16 (V100, T4)
        # Not fp16 instead: it needs a GradScaler (loss scaling, skipped steps, its state in
        # every checkpoint for an exact resume, a sharded one under FSDP2) in every step's loop,
        # for GPUs that are leaving clusters; bf16 has float32's range and needs none.
        where = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "a CPU"
        log(run, f"note: --amp computes in bf16, which {where} has no native support for "
                 f"(emulated, slower than float32): training in float32, amp=False")
    if args.lr_scaling != "none":  # what --lr becomes, and how fast
        extra = {"lr": f"{args.lr:g}x{lr_scale(args, plan):.3g} ({args.lr_scaling}, warm-up "
                       f"{args.warmup_steps} steps)", **extra}
    details = "".join(f" {key}={value}" for key, value in extra.items())
    log(run, f"{os.path.basename(script)}: device={run.device} world_size={run.world_size} "
             f"batch={plan.global_batch} (= {run.world_size} rank{'s' * (run.world_size > 1)} x "
             f"{plan.per_rank}, "
             f"{plan.accumulation_steps} micro-batch(es) of {plan.micro_batch}) "
             f"threads/rank={torch.get_num_threads()} amp={run.amp} seed={args.seed} "
             f"deterministic={'on' if args.deterministic else 'off'}{details}")


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
