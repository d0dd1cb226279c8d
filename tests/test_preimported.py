"""conftest.launch forks most runs from a process that has imported torch (tests/preimported.py).
A forked run must be what a fresh `python SCRIPT` is: the same exit status, stdout and stderr,
argv, sys.path[0], working directory, environment and __main__, and a run whose environment
differs where torch reads it at import must start fresh."""

import ast
import re
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import preimported
from conftest import (REPO, Preimported, base_env, children, descendants, end_left_running,
                      environment, forkable, launch, output, start, torchrun_cmd)

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
    # Python runs the atexit functions before it ends by SIGINT
    "ctrl_c_atexit": "import atexit\natexit.register(print, 'atexit first')\nraise KeyboardInterrupt\n",
    "killed": "import os, signal\nprint('bye', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n",
    # Python's exit first waits for threads that are not daemons, then runs atexit functions
    # (an exception there is printed, not an exit status), then flushes what is still buffered
    # (preimported.end): in that order, each once.
    "thread_atexit_buffered": textwrap.dedent("""
        import atexit, sys, threading, time
        atexit.register(print, "atexit, after the thread")
        atexit.register(lambda: 1 / 0)
        threading.Thread(target=lambda: (time.sleep(0.5), print("the thread, last"))).start()
        sys.stdout.write("buffered, no newline")
        sys.stdout = open(sys.stdout.fileno(), "w", buffering=1 << 20, closefd=False)
        """),
    # stdout that cannot be flushed at the exit: status 120 (a closed one is skipped: 0)
    "unflushable": "import os, sys\nsys.stdout = open(1, 'w', buffering=1 << 20, closefd=False)\n"
                   "print('lost')\nos.close(1)\n",
    "closed": "import sys\nsys.stdout.close()\n",
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


# `python -c CODE ARGS`: argv[0] "-c", the working directory ("") first on sys.path, a __main__
# with no __file__, and a traceback from "<string>"
SHOW_C = ("import os, sys\n"
          "print(sys.argv, repr(sys.path[0]), os.getcwd(), __name__, __loader__, __spec__,\n"
          "      sorted(globals()))\n"
          "raise ValueError('planted')\n")


def test_python_c_forked_is_python_c_fresh(tmp_path):
    args = [sys.executable, "-c", SHOW_C, "--flag", "x y"]
    assert forkable(args, base_env(), tmp_path) is not None
    fresh, forked = both(args, cwd=tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.stdout.startswith(f"['-c', '--flag', 'x y'] '' {tmp_path} __main__ ")
    assert "'__annotations__', '__builtins__', '__doc__'" in fresh.stdout
    assert fresh.returncode == 1 and 'File "<string>", line 4, in <module>' in fresh.stderr


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_forked_run_ends_as_a_fresh_one_does(tmp_path, ending):
    (tmp_path / "end.py").write_text(ENDINGS[ending])
    fresh, forked = both([sys.executable, str(tmp_path / "end.py")])
    address = re.compile(r" at 0x[0-9a-f]+")  # (a function's, in "Exception ignored in ...")
    assert (forked.returncode, forked.stdout, address.sub("", forked.stderr)) == \
        (fresh.returncode, fresh.stdout, address.sub("", fresh.stderr))
    assert fresh.returncode == {"traceback": 1, "exit_message": 1, "exit_code": 7,
                                "ctrl_c": -2, "ctrl_c_atexit": -2, "killed": -9, "thread_atexit_buffered": 0,
                                "unflushable": 120, "closed": 0}[ending]
    if ending == "ctrl_c_atexit":
        assert fresh.stdout == "atexit first\n" and "KeyboardInterrupt" in fresh.stderr
    if ending == "thread_atexit_buffered":
        assert fresh.stdout == "buffered, no newlinethe thread, last\natexit, after the thread\n"
        assert "ZeroDivisionError" in fresh.stderr


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
    assert forkable([sys.executable, "-m", "pytest"], here, REPO) is None
    assert forkable([sys.executable, "-X", "importtime", "00_single_gpu.py"], here, REPO) is None
    monkeypatch.setenv("FRESH_PROCESSES", "1")
    assert forkable(script, here, REPO) is None


def test_a_sitecustomize_hook_on_pythonpath_runs_forked_as_fresh(tmp_path):
    """PYTHONPATH holding only a sitecustomize.py (conftest.KILL_RANK_1_AT_STEP_27's way in):
    forked, the hook runs before the script, sees the run's environment, and its folder is on
    sys.path where PYTHONPATH puts it; an error in it is Python's one line. Anything else on
    that folder, and the run starts fresh."""
    hook, script = tmp_path / "hook", tmp_path / "show.py"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, sys\nprint('hook', os.environ.get('PROBE_WHAT'), sys.path.index(%r))\n"
        "if os.environ.get('PROBE_WHAT') == 'fail':\n    raise ValueError('planted')\n"
        % str(hook))
    script.write_text("import sys\nprint('script', sys.path.index(%r))\n" % str(hook))
    for what in ("late", "fail"):
        env = base_env(PYTHONPATH=hook, PROBE_WHAT=what)
        assert forkable([sys.executable, str(script)], env, tmp_path) is not None
        fresh, forked = both([sys.executable, str(script)], env=env, cwd=tmp_path)
        assert (forked.returncode, forked.stdout, forked.stderr) == \
            (fresh.returncode, fresh.stdout, fresh.stderr)
        assert fresh.stdout == f"hook {what} 0\nscript 1\n"  # (before the script's folder)
        assert fresh.stderr == ("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                                "ValueError: planted\n" if what == "fail" else "")
    # Under torchrun: the agent runs the hook, and so does each worker, forked too (the agent's
    # own import of the hook does not make it start them fresh)
    (tmp_path / "rank.py").write_text("import sys\nprint('torch loaded', 'torch' in sys.modules)\n")
    forked = launch(torchrun_cmd(2, "rank.py"), cwd=tmp_path,
                    env=base_env(PYTHONPATH=hook, PROBE_WHAT="late"))
    assert sorted(forked.stdout.splitlines()) == ["hook late 0"] * 3 + ["torch loaded True"] * 2
    (hook / "other.py").write_text("")
    assert forkable([sys.executable, str(script)], base_env(PYTHONPATH=hook), tmp_path) is None


WORKER = textwrap.dedent("""
    import sys
    lines = [f"torch loaded before the first line: {'torch' in sys.modules}"]
    import os, signal, torch
    late = ("RANK", "ROLE_RANK", "LOCAL_RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_ERROR_FILE")  # (this launch's own: they differ from any other's)
    lines += [
        str(sorted((k, v) for k, v in os.environ.items() if k not in late)),
        f"{sys.argv} {sys.path[0]} {os.getcwd()} {__name__} {__file__} {sys.stdout.write_through}",
        f"threads {torch.get_num_threads()} {torch.get_num_interop_threads()}",
        str([signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE,
                                           signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1)]),
        f"own session {os.getpid() == os.getpgid(0) == os.getsid(0)}",
        f"fds {sorted(os.listdir('/proc/self/fd'))} {os.isatty(0)}"]
    with open(f"rank{os.environ['RANK']}.txt", "w") as report:
        report.write("\\n".join(lines))
    print("rank", os.environ["RANK"], "to stdout")
    print("rank", os.environ["RANK"], "to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]) if os.environ["RANK"] == "1" else 0)
    """)


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("nproc", [2, 1])
def test_torchruns_forked_workers_see_and_end_as_fresh_ones(tmp_path, nproc):
    """A torchrun agent forked from a helper has its workers forked too (by the helper that
    imported torch with OMP_NUM_THREADS=1 where torchrun sets it): each sees what a fresh
    worker sees (environment, argv, threads, signal handlers, a session of its own, no file of
    the helper's left open, stdout and stderr), torchrun reports its exit as a fresh one's, and
    the helpers keep no child once the run has ended."""
    (tmp_path / "worker.py").write_text(WORKER)
    args, runs = torchrun_cmd(nproc, "worker.py", "3"), {}
    for fresh in (True, False):
        proc = launch(args, cwd=tmp_path, check=False, fresh=fresh)
        reports = [(tmp_path / f"rank{rank}.txt").read_text().splitlines() for rank in range(nproc)]
        runs[fresh] = proc, reports
        assert all(report[0].endswith(str(not fresh)) for report in reports), reports
        assert sorted(proc.stdout.splitlines()) == [f"rank {r} to stdout" for r in range(nproc)]
        assert all(f"rank {r} to stderr" in proc.stderr.splitlines() for r in range(nproc))
    (fresh, fresh_reports), (forked, forked_reports) = runs[True], runs[False]
    for forked_report, fresh_report in zip(forked_reports, fresh_reports):
        assert forked_report[1:] == fresh_report[1:], what_differs(forked_report, fresh_report)
    assert f"threads {1 if nproc > 1 else torch.get_num_threads()} " in forked_reports[0][3]
    assert forked_reports[0][5:] == ["own session True", "fds ['0', '1', '2', '3'] False"]
    assert forked.returncode == fresh.returncode == (1 if nproc > 1 else 0)
    if nproc > 1:  # rank 1 exited 3: torchrun names it, with its exit code
        for proc in (fresh, forked):
            assert re.search(r"rank\s*: 1 \(local_rank: 1\)\n\s*exitcode\s*: 3 ", proc.stderr)
    helpers = [str(p.pid) for p in Preimported.get().processes]
    deadline = time.monotonic() + 60  # (a helper reaps a worker within 0.05 s of its agent's end)
    while any(children_of(pid) for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(children_of(pid) for pid in helpers)


DISPOSITIONS = textwrap.dedent("""
    import signal, subprocess, sys
    if sys.argv[1:] == ["child"]:
        print([signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGHUP, signal.SIGINT,
                                             signal.SIGPIPE, signal.SIGTERM)])
        sys.exit()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # ignored: what it starts ignores it too
    signal.signal(signal.SIGHUP, lambda *args: None)  # caught: it starts at its default
    subprocess.Popen([sys.executable, sys.argv[0], "child"], start_new_session=True).wait()
    """)


def test_a_forked_run_starts_with_the_signals_a_started_program_has(tmp_path):
    """A program keeps across exec the signals its starter ignores and starts every other one
    at its default; a forked run is the helper's copy, with the helper's. The helper sets them
    as exec would from the one who asked (a forked torchrun agent catches SIGHUP; under nohup
    the helper ignored it, and forked workers kept ignoring it where fresh ones did not)."""
    (tmp_path / "dispositions.py").write_text(DISPOSITIONS)
    printed = [launch([sys.executable, "dispositions.py"], cwd=tmp_path, fresh=fresh).stdout
               for fresh in (True, False)]
    assert printed[0] == printed[1] == (
        "[<Handlers.SIG_IGN: 1>, <Handlers.SIG_DFL: 0>, <built-in function default_int_handler>,"
        " <Handlers.SIG_IGN: 1>, <Handlers.SIG_DFL: 0>]\n"), printed


def what_differs(forked: list[str], fresh: list[str]) -> str:
    """A worker's report lines that differ, forked against fresh; of its environment (line 1),
    only the variables that differ."""
    said = []
    for number, (one, other) in enumerate(zip(forked, fresh)):
        if number == 1:
            one, other = set(ast.literal_eval(one)), set(ast.literal_eval(other))
            said.append(f"environment, forked only: {sorted(one - other)}; "
                        f"fresh only: {sorted(other - one)}")
        elif one != other:
            said.append(f"line {number}, forked: {one!r}; fresh: {other!r}")
    return "\n".join(said)


def children_of(pid: str) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


PARENT = textwrap.dedent("""
    import subprocess, sys
    child = [sys.executable, "child.py"]
    with subprocess.Popen(child, start_new_session=True) as started:  # inherits stdout
        pass
    piped = subprocess.run(child, capture_output=True, text=True)  # pipes: Popen's own
    grouped = subprocess.Popen(child)  # in its asker's process group: Popen's own
    grouped.wait()
    print("exit codes", started.returncode, piped.returncode, type(started).__name__,
          type(piped).__name__, type(grouped).__name__, flush=True)
    print("piped said", piped.stdout.split()[-1])
    """)
CHILD = textwrap.dedent("""
    import os, sys
    print("torch loaded:", "torch" in sys.modules, "own session:", os.getsid(0) == os.getpid())
    sys.exit(5)
    """)


def test_a_forked_runs_children_are_forked_where_popen_can_be(tmp_path):
    """What a forked run starts with subprocess.Popen (the tour's steps, torchrun's workers) is
    forked too where it is asked for in a session of its own and needs no pipe: it prints and
    ends as a fresh child does; a child with pipes, or in its asker's process group, is Popen's
    own."""
    (tmp_path / "parent.py").write_text(PARENT)
    (tmp_path / "child.py").write_text(CHILD)
    fresh, forked = both([sys.executable, "parent.py"], cwd=tmp_path)
    assert fresh.stdout.splitlines() == [
        "torch loaded: False own session: True", "torch loaded: False own session: False",
        "exit codes 5 5 Popen CompletedProcess Popen",
        "piped said False"], fresh.stdout
    assert forked.stdout.splitlines() == [
        "torch loaded: True own session: True", "torch loaded: False own session: False",
        "exit codes 5 5 ForkedChild CompletedProcess Popen",
        "piped said False"], forked.stdout
    assert fresh.returncode == forked.returncode == 0 and fresh.stderr == forked.stderr == ""


WAITING_RANK = textwrap.dedent("""
    import os, sys, time
    with open(f"rank{os.environ['RANK']}.pid", "w") as f:
        f.write(str(os.getpid()))
    while not os.path.exists("go"):
        time.sleep(0.02)
    """)


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads /proc (Linux)")
def test_the_tests_find_a_runs_ranks_and_their_environment_forked_or_fresh(tmp_path):
    """What the signal tests read of a run they started with conftest.start: its children
    (torchrun's workers: the agent's own children when fresh, the helper's when forked) and each
    one's environment (its RANK: /proc/PID/environ shows a forked one's helper's). Both the
    same, fresh or forked; nothing is left recorded once the run has ended."""
    (tmp_path / "rank.py").write_text(WAITING_RANK)
    for fresh in (True, False):
        (tmp_path / "go").unlink(missing_ok=True)
        with open(tmp_path / f"log{fresh}.txt", "w+") as log:
            agent = start(torchrun_cmd(2, "rank.py"), log, cwd=tmp_path, fresh=fresh)
            assert type(agent).__name__ == ("Popen" if fresh else "ForkedChild")
            pids = [tmp_path / f"rank{rank}.pid" for rank in (0, 1)]
            deadline = time.monotonic() + 120
            while not all(p.exists() and p.read_text() for p in pids):
                assert agent.poll() is None and time.monotonic() < deadline, output(agent)
                time.sleep(0.02)
            ranks = {int(p.read_text()): str(rank) for rank, p in enumerate(pids)}
            assert sorted(children(agent.pid)) == sorted(ranks)
            assert sorted(descendants(agent.pid)) == sorted(ranks)
            assert {pid: environment(pid)["RANK"] for pid in ranks} == ranks
            (tmp_path / "go").write_text("")
            assert agent.wait(timeout=120) == 0, output(agent)
            for p in pids:
                p.unlink()
    folder = Preimported.get().folder
    deadline = time.monotonic() + 60  # (a helper reaps a worker within 0.05 s of its agent's end)
    while preimported.asked(str(folder)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert preimported.asked(str(folder)) == {}


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("fresh", [False, True])
def test_a_run_a_test_left_running_is_ended_with_its_ranks(tmp_path, fresh):
    """A test that fails while its run goes on (a timeout while it waits) left the run, and the
    ranks of a torchrun it started, running on for the rest of the suite (seen: a torchrun
    agent of a failed two-agent test still busy minutes after). The autouse fixture ends them
    with end_left_running, which this calls as the fixture does after every test."""
    (tmp_path / "rank.py").write_text(WAITING_RANK)  # (never told to go)
    log = open(tmp_path / "log.txt", "w+")
    agent = start(torchrun_cmd(2, "rank.py"), log, cwd=tmp_path, fresh=fresh)
    pids = [tmp_path / f"rank{rank}.pid" for rank in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(p.exists() and p.read_text() for p in pids):
        assert agent.poll() is None and time.monotonic() < deadline, output(agent)
        time.sleep(0.02)
    ranks = [int(p.read_text()) for p in pids]
    end_left_running()
    assert agent.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 60  # (the helper reaps a forked rank once its agent is gone)
    while any(Path(f"/proc/{pid}").exists() and "Z" not in state(pid) for pid in ranks):
        assert time.monotonic() < deadline, [state(pid) for pid in ranks]
        time.sleep(0.05)


def state(pid: int) -> str:
    """A process's state (R, S, Z...), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
