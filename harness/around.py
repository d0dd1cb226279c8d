"""What the harness does around a step's main(): checks before it and after it, never in place
of a function the step defines (the code a learner reads is the code that runs).

harness/stepNN_*.py may define `around(script)`, a context manager that errors.run_main enters
before step NN's main() and leaves after it, with main()'s exception, if any. It is given the
step's path only, never its namespace. What a step needs checked inside its own code it gets
from common.py, whose functions the harness may replace (harness/__init__.py lists them).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from pathlib import Path

HERE = Path(__file__).resolve().parent


def around(main) -> contextlib.ExitStack:
    """Enter every harness/stepNN_*.py's around(script) for step NN, whose main() this is."""
    script = Path(inspect.unwrap(main).__code__.co_filename)
    number = script.name.split("_", 1)[0].rstrip("ab")  # 07a and 07b: step 07's checks too
    stack = contextlib.ExitStack()
    with contextlib.ExitStack() as entering:  # one that fails to enter leaves the others
        entering.enter_context(stack)
        for module in sorted(HERE.glob(f"step{number}_*.py")) if number[:1].isdigit() else ():
            hook = getattr(importlib.import_module(f"harness.{module.stem}"), "around", None)
            if hook is not None:
                stack.enter_context(hook(script))
        entering.pop_all()
    return stack
