"""The code a learner reads is the code that runs: in the repository, the harness checks around
a step's own code and may replace common.py's functions, but never a function or class that a
step defines (issue 60: no `take_in`, no twins)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import signal
import sys

import pytest

from conftest import REPO

STEPS = sorted(p.name for p in REPO.glob("[0-9][0-9]*_*.py"))
HARNESS = sorted((REPO / "harness").glob("*.py"))


def test_no_harness_module_reaches_into_a_steps_namespace():
    """No module of harness/ reads a step's globals (`__globals__`, `sys.modules["__main__"]`,
    `vars()`/`globals()` of another module), and none defines a take_in."""
    found = []
    for path in HARNESS:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("__globals__", "__dict__"):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Constant) and node.value == "__main__":
                found.append(f"{path.name}:{node.lineno} '__main__'")
            if isinstance(node, ast.FunctionDef) and node.name == "take_in":
                found.append(f"{path.name}:{node.lineno} def take_in")
    assert not found, found


def test_the_harness_around_a_step_is_given_its_path_only():
    """Each harness/stepNN_*.py's around() takes one argument, the step's path."""
    import harness  # noqa: F401 -- as a step's first line does
    for path in HARNESS:
        if not path.name.startswith("step"):
            continue
        module = importlib.import_module(f"harness.{path.stem}")
        hook = getattr(module, "around", None)
        if hook is not None:
            assert list(inspect.signature(hook).parameters) == ["script"], path.name


@pytest.mark.parametrize("script", STEPS)
def test_taking_in_the_harness_leaves_every_function_of_the_step_in_place(script):
    """A step loaded as its first line loads it (harness and all): every function and class
    it defines is still the step's own, and calls into common.py reach common.py's names. The
    harness's around(), entered and left as errors.run_main does around main(), changes none."""
    spec = importlib.util.spec_from_file_location(f"step_{script[:3]}", REPO / script)
    step = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = step
    try:
        spec.loader.exec_module(step)  # (its `if __name__ == "__main__"` does not run)
        own = {name: value for name, value in vars(step).items()
               if (inspect.isfunction(value) or inspect.isclass(value))
               and getattr(value, "__module__", None) == spec.name}
        codes = {name: value.__code__ for name, value in own.items() if inspect.isfunction(value)}
        from harness import around
        main = getattr(step, "main", None)
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if main is not None:
                with around.around(main):
                    pass
        except Exception:  # noqa: BLE001 -- 11's says its main() trained nothing: true here
            pass
        finally:
            for signum, handler in handlers.items():  # (11's around sets them for its run)
                signal.signal(signum, handler)
        after = {name: vars(step).get(name) for name in own}
        assert after == own, [name for name in own if after[name] is not own[name]]
        assert {n: f.__code__ for n, f in own.items() if n in codes} == codes
    finally:
        sys.modules.pop(spec.name, None)
