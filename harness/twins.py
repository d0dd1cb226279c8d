"""The checked twins of a step's own functions, taken in when the step runs in the repository.

Steps 06-11 write out plain versions of what they need (a stop request, a hang report, ...), so a
copied step runs with torch alone. In the repository, common.run_main (errors.run_main) first
hands the step's namespace to its harness module, harness/stepNN_*.py: that module's
`take_in(step)` replaces some of the step's functions by checked ones, which train the same and
fail in one line. Each such module lists what it replaces in its docstring.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOIN_AS_02 = ("02", "02b", "03", "04")  # (10 and 11 write setups of their own)


def take_in(main) -> None:
    """Let harness/stepNN_*.py replace functions of step NN, whose main() this is; a step's
    setup() (02-04) becomes common.setup_distributed's checked twin (launcher.py)."""
    step = inspect.unwrap(main).__globals__  # the step's module namespace (@record wraps main)
    number = Path(step.get("__file__") or "").name.split("_", 1)[0]
    if number in JOIN_AS_02:  # they write out 02's setup(): the checked one joins with a
        from .launcher import setup_distributed  # check-in that names the ranks never came
        step["setup"] = setup_distributed
    for module in sorted(HERE.glob(f"step{number}_*.py")) if number else ():
        take = getattr(importlib.import_module(f"harness.{module.stem}"), "take_in", None)
        if take is not None:
            take(step)
