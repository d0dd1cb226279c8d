"""The torch this runs on: a step that needs a newer torch than the oldest supported says so in
one line (require_torch), and an older torch than supported gets one warning line at start.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch

from .errors import report


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




def torch_needed_by(script) -> str | None:
    """The version a step asks for, or None (tour.py reads it): in its require_torch("X.Y", ...)
    line, or in a copyable step's own check, `torch.__version__ < "X.Y"` (10) or `< (X, Y)` (08)."""
    found = re.search(r'require_torch\("([\d.]+)"|torch\.__version__ < "([\d.]+)"'
                      r"|torch\.__version__ < \((\d+), (\d+)\)", Path(script).read_text())
    if not found:
        return None
    return found.group(1) or found.group(2) or f"{found.group(3)}.{found.group(4)}"
