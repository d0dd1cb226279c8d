"""Start-up, checked: the process group with a check-in that names the ranks that never came
(around torch's init_process_group, which every step's setup calls), and the choice to compile
with the tools it needs checked first (in place of common.compile_choice).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist

import common
from common import UserError, log

from .ranks import join_group


TORCH_INIT_PROCESS_GROUP = dist.init_process_group  # (harness/__init__.py puts ours in place)


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, **kwargs):
    """torch's init_process_group, as the steps call it (env://: torchrun's or srun's variables),
    with a check-in that names the ranks that never came (ranks.join_group). Around the step's
    own setup, never in place of it: any other call goes to torch's unchanged."""
    if store is not None or init_method not in (None, "env://") or world_size < 0 or rank < 0:
        return TORCH_INIT_PROCESS_GROUP(backend, init_method, timeout, world_size, rank, store,
                                        **kwargs)
    join_group(backend, rank, world_size, (timeout or dist.default_pg_timeout).total_seconds(),
               **kwargs)


def compile_choice(args, run: common.Run) -> bool:
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
