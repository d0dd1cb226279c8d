"""conftest.launch forks most runs from a process that has imported torch (tests/preimported.py).
A forked run must be what a fresh `python SCRIPT` is: the same exit status, stdout and stderr,
argv, sys.path[0], working directory, environment and __main__, and a run whose environment
differs where torch reads it at import must start fresh."""

import sys
import textwrap

import pytest

from conftest import REPO, Preimported, base_env, forkable, launch

SHOW = textwrap.dedent("""
    import os, sys
    print(sys.argv, sys.path[0], os.getcwd(), os.environ.get("PROBE_WHAT"), __name__, __file__)
    print("to stderr", file=sys.stderr)
    print("torch" in sys.modules)
    """)
ENDINGS = {
    "traceback": "def fail():\n    raise ValueError('planted')\nfail()\n",
    "exit_message": "import sys\nsys.exit('a message, not a code')\n",
    "exit_code": "raise SystemExit(7)\n",
    "ctrl_c": "raise KeyboardInterrupt\n",
    "killed": "import os, signal\nprint('bye', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n",
}


def both(args, **kwargs):
    fresh = launch(args, check=False, fresh=True, **kwargs)
    forked = launch(args, check=False, **kwargs)
    return fresh, forked


def test_a_forked_run_sees_what_a_fresh_one_sees(tmp_path):
    (tmp_path / "show.py").write_text(SHOW)
    args = [sys.executable, "show.py", "--flag", "x y"]
    env = base_env(PROBE_WHAT="late")
    assert forkable(args, env, tmp_path) is not None
    fresh, forked = both(args, cwd=tmp_path, env=env)
    seen, torch_loaded = forked.stdout.splitlines()
    assert seen == fresh.stdout.splitlines()[0] == \
        f"['show.py', '--flag', 'x y'] {tmp_path} {tmp_path} late __main__ {tmp_path / 'show.py'}"
    assert (fresh.returncode, fresh.stderr) == (forked.returncode, forked.stderr) == (0, "to stderr\n")
    # torch is the one thing a forked run finds loaded before its first line (its docstring)
    assert torch_loaded == "True" and fresh.stdout.splitlines()[1] == "False"


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_forked_run_ends_as_a_fresh_one_does(tmp_path, ending):
    (tmp_path / "end.py").write_text(ENDINGS[ending])
    fresh, forked = both([sys.executable, str(tmp_path / "end.py")])
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == {"traceback": 1, "exit_message": 1, "exit_code": 7,
                                "ctrl_c": -2, "killed": -9}[ending]


def test_a_step_with_a_bad_flag_says_the_same_forked(tmp_path):
    fresh, forked = both([sys.executable, "03_ddp_wrapper.py", "--epochz", "3"])
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == 2


def test_what_torch_reads_at_import_starts_a_run_fresh(tmp_path, monkeypatch):
    script = [sys.executable, str(REPO / "00_single_gpu.py")]
    here = Preimported.get().env
    assert forkable(script, base_env(PROBE_STALL=1, SLURM_RESTART_COUNT=1), REPO) is not None
    for changed in [{"OMP_NUM_THREADS": "3"}, {"PYTHONPATH": str(tmp_path)},
                    {"CUDA_VISIBLE_DEVICES": "0"}, {"TORCH_LOGS": "dynamo"},
                    {"TMPDIR": str(tmp_path)}]:  # (tempfile.tempdir is set while torch imports)
        assert forkable(script, {**here, **changed}, REPO) is None, changed
    assert forkable([sys.executable, "-c", "pass"], here, REPO) is None
    assert forkable([sys.executable, "-X", "importtime", "00_single_gpu.py"], here, REPO) is None
    monkeypatch.setenv("FRESH_PROCESSES", "1")
    assert forkable(script, here, REPO) is None
