"""Issue 27, items 2 and 7: nothing hangs on a signal. Real signals to real processes of step 07
with a DataLoader worker (the case that hung: its workers ignore SIGTERM, and Python's exit
joined them forever).

- Ctrl-C (SIGINT) to the main process only (`kill -INT`, an IDE's stop button): exit 130 in
  seconds, one line, no traceback, no worker left; under torchrun too, also while a peer is
  stalled and this rank waits in a collective (where Python runs no signal handler).
- A second run in the same --out-dir meanwhile is refused (issue 39).
- A stop signal before the first step, or a second one: the process ends at once (128 + signal).
- Every signal torchrun can forward (--signals-to-handle) that is not SIGINT is a stop request:
  a checkpoint, then exit 75.
"""

import importlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import checkpoint
import conftest
from conftest import REPO, base_env, children, descendants, environment, launch, torchrun_cmd

# 80 steps of 12 (a long epoch at this machine's pace), a checkpoint every 4, one worker per rank.
ARGS = ["--data", "synthetic", "--train-samples", 960, "--test-samples", 20, "--batch-size", 12,
        "--epochs", 1, "--checkpoint-every", 4, "--num-workers", 1, "--quiet", "--timeout", 30]
STEP = "07_fault_tolerance.py"
GUARD_S = 120  # a hang guard, not a speed bound: a hang is what these tests look for


def start(cmd, out_dir, *, fresh=False, **env):
    """Start `cmd` (forked where it can be: conftest.start) with its output in a file."""
    log = open(out_dir / "output.txt", "w+")
    proc = conftest.start(cmd, log, env=base_env(**env), fresh=fresh)
    proc.log = log
    return proc


def wait_for(path, proc, timeout=GUARD_S):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"exited {proc.returncode} early:\n{read(proc)}"
        assert time.monotonic() < deadline, f"{path} never appeared:\n{read(proc)}"
        time.sleep(0.05)


def read(proc) -> str:
    proc.log.seek(0)
    return proc.log.read()


def finish(proc) -> str:
    try:
        proc.wait(timeout=GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"still running {GUARD_S} s after the signal:\n{read(proc)}")
    return read(proc)


def alive(pids) -> list[int]:
    """Those still running (a zombie waiting to be reaped has ended)."""
    running = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    running.append(pid)
        except (FileNotFoundError, ProcessLookupError):  # gone (reaped between open and read)
            pass
    return running


def one_error_line(output, *fragments):
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def python_step(tmp_path, **env):
    """Step 07 as plain python under tests/rank_probe.py, with one DataLoader worker."""
    cmd = [sys.executable, REPO / "tests" / "rank_probe.py", STEP, *map(str, ARGS),
           "--out-dir", str(tmp_path)]
    return start(cmd, tmp_path, PROBE_DIR=tmp_path, **env)


def test_ctrl_c_to_the_main_process_ends_the_run_and_its_workers(tmp_path):
    proc = python_step(tmp_path)
    wait_for(tmp_path / "checkpoint.pt", proc)  # training, with its worker running
    # Meanwhile a second run in the same --out-dir is refused, before it trains or writes.
    saved = (tmp_path / "checkpoint.pt").stat().st_mtime_ns
    # The run is held mid-epoch meanwhile (SIGSTOP; its worker too): 80 steps take under 2 s
    # here, less than a second run needs to start, and its worker must still be there below.
    held = [proc.pid, *descendants(proc.pid)]
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        second = launch([sys.executable, STEP, *ARGS, "--out-dir", tmp_path], check=False,
                        timeout=GUARD_S)
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)
    assert second.returncode == 2, second.stderr[-3000:]
    one_error_line(second.stderr, f"--out-dir {tmp_path} is in use by another run (process "
                                  f"{proc.pid} on ")
    assert proc.poll() is None and (tmp_path / "checkpoint.pt").stat().st_mtime_ns >= saved
    workers = descendants(proc.pid)
    assert workers, "no DataLoader worker to test with"
    proc.send_signal(signal.SIGINT)  # to the main process alone, as `kill -INT` does
    output = finish(proc)
    assert proc.returncode == 130, output[-3000:]
    one_error_line(output, "interrupted (SIGINT)", "without a checkpoint")
    assert "Traceback" not in output, output[-3000:]
    assert alive(workers) == []
    checkpoint.load(tmp_path / "checkpoint.pt")  # the last one saved is whole


# A save whose file's third write() is where Ctrl-C arrives: a real SIGINT, sent from inside
# torch.save's write, so that it lands there every time (in a run it lands there by chance: CI
# once reported "could not write checkpoint ... unexpected pos", exit 2, for a Ctrl-C).
CTRL_C_MID_SAVE = """
import builtins, os, signal, sys
import torch
from harness import checkpoint, errors

class CtrlCOnThirdWrite:
    def __init__(self, f):
        self.f, self.writes = f, 0
    def write(self, data):
        self.writes += 1
        if self.writes == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return self.f.write(data)
    def __getattr__(self, name):
        return getattr(self.f, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

def main():
    model = torch.nn.Linear(200, 200)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    checkpoint.save(checkpoint.Path(sys.argv[1]), model, optimizer, scheduler, epoch=1)
    checkpoint.open = lambda *args: CtrlCOnThirdWrite(builtins.open(*args))
    checkpoint.save(checkpoint.Path(sys.argv[1]), model, optimizer, scheduler, epoch=2)

errors.run_main(main)
"""


def test_ctrl_c_inside_a_checkpoint_write_is_reported_as_ctrl_c(tmp_path):
    path = tmp_path / "checkpoint.pt"
    done = launch([sys.executable, "-c", CTRL_C_MID_SAVE, path], check=False, timeout=GUARD_S)
    assert done.returncode == 130, done.stderr[-3000:]
    one_error_line(done.stderr, "interrupted (SIGINT)", "without a checkpoint")
    assert checkpoint.load(path)["epoch"] == 1  # the one saved before is whole
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary file left


# main() fails with a UserError, and a real SIGTERM arrives while run_main reports it (from
# inside the error's __str__, so that it lands there every time), as torchrun's SIGTERM to
# every rank does when one rank failed. Then the report takes `sys.argv[1]` seconds more.
SIGTERM_WHILE_REPORTING = """
import os, signal, sys, time
from harness import errors

class SlowToSay(errors.UserError):
    def __str__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(float(sys.argv[1]))
        return "the planted error"

def main():
    raise SlowToSay()

errors.run_main(main)
"""


def report_under_sigterm(seconds: float) -> subprocess.CompletedProcess:
    return launch([sys.executable, "-c", SIGTERM_WHILE_REPORTING, seconds], check=False,
                  timeout=GUARD_S)


def test_a_sigterm_while_a_rank_reports_its_error_does_not_silence_it():
    """It used to end the rank by SIGTERM's default action, before its line."""
    done = report_under_sigterm(0.5)
    assert done.returncode == 2, done.stderr[-3000:]
    one_error_line(done.stderr, "the planted error")


def test_a_sigterm_while_a_rank_hangs_in_its_error_handling_ends_it():
    """The watchdog ends it GRACE_S after the signal, with a line saying why (a report that
    would take 90 s; the guard is a hang guard, not a speed bound)."""
    done = report_under_sigterm(90)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    one_error_line(done.stderr, "SIGTERM while ending after an error",
                   "did not stop by itself within 3 s")


def test_a_second_sigterm_ends_the_process_at_once(tmp_path):
    """The first SIGTERM is a stop request, taken at the next vote; this rank never gets there
    (it stalls in step 5, as a rank stuck in I/O would), so the second one must end it."""
    proc = python_step(tmp_path, PROBE_STALL="0:5")
    wait_for(tmp_path / "checkpoint.pt", proc)  # after step 4; the stall follows in step 5
    workers = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)
    assert proc.poll() is None, read(proc)  # the first one only took note
    proc.send_signal(signal.SIGTERM)  # a repeat within StopRequest.REPEAT_AFTER_S: the same one
    time.sleep(1)
    assert proc.poll() is None, read(proc)
    time.sleep(importlib.import_module("07_fault_tolerance").StopRequest.REPEAT_AFTER_S)
    proc.send_signal(signal.SIGTERM)
    output = finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    one_error_line(output, "a second stop signal (SIGTERM after SIGTERM)")
    assert "Traceback" not in output, output[-3000:]
    assert alive(workers) == []
    assert checkpoint.load(tmp_path / "checkpoint.pt")["position"]["step"] == 4


def test_a_stop_signal_before_the_first_step_ends_the_process_at_once(tmp_path):
    """No step trained yet: nothing to save, so no reason to wait (the rank stalls in its first
    step here, before the first vote could take the request)."""
    proc = python_step(tmp_path, PROBE_STALL="0:1")
    deadline = time.monotonic() + GUARD_S
    while "device=cpu" not in read(proc) or not descendants(proc.pid):  # setup done, training
        assert proc.poll() is None and time.monotonic() < deadline, read(proc)
        time.sleep(0.05)
    time.sleep(1)
    proc.send_signal(signal.SIGHUP)
    output = finish(proc)
    assert proc.returncode == 128 + signal.SIGHUP, output[-3000:]
    one_error_line(output, "SIGHUP before the first training step")
    assert "Traceback" not in output, output[-3000:]
    assert not (tmp_path / "checkpoint.pt").exists()


def rank_pids(agent) -> dict[int, int]:
    """{rank: pid} of torchrun's workers (their RANK variable)."""
    return {int(environment(pid)["RANK"]): pid for pid in children(agent.pid)}


@pytest.mark.parametrize("ctrl_c_to", ["rank 0", "torchrun"])
def test_ctrl_c_while_a_peer_is_stalled_ends_the_run_in_seconds(tmp_path, ctrl_c_to):
    """Rank 1 stalls (SIGSTOP: as a rank stuck in I/O or on a hung device would), so rank 0
    waits in a gloo collective, where Python runs no signal handler until --timeout (600 s
    here, the default). A Ctrl-C to rank 0 alone (`kill -INT`), or a terminal's Ctrl-C, which
    reaches torchrun (torch 2.15 starts every rank in a session of its own) and which torchrun
    forwards to every rank, must end rank 0 in seconds with its own line: its watchdog thread
    does (errors.watch_signals). Rank 1 then resumes and ends by itself, with its own line
    (exit 3: its peer is gone, or 130: its own Ctrl-C); nobody waits for torchrun's SIGKILL."""
    cmd = torchrun_cmd(2, STEP, *ARGS, "--timeout", 600, "--out-dir", tmp_path)
    agent = start(cmd, tmp_path)
    wait_for(tmp_path / "checkpoint.pt", agent)
    everyone = descendants(agent.pid)
    ranks = rank_pids(agent)
    os.kill(ranks[1], signal.SIGSTOP)
    # Rank 0 reaches its next collective and waits there, in C, on a futex: for good, where a
    # wait for the GIL or a lock is a futex for a moment (so the test waits for 2 s of it).
    waiting_since = None
    while waiting_since is None or time.monotonic() - waiting_since < 2:
        assert agent.poll() is None, read(agent)
        if "futex" not in Path(f"/proc/{ranks[0]}/wchan").read_text():
            waiting_since = None
        elif waiting_since is None:
            waiting_since = time.monotonic()
        time.sleep(0.05)
    os.kill(ranks[0] if ctrl_c_to == "rank 0" else agent.pid, signal.SIGINT)
    sent = time.monotonic()
    while alive([ranks[0]]):
        assert time.monotonic() - sent < GUARD_S, f"rank 0 still waits:\n{read(agent)}"
        time.sleep(0.05)
    seconds = time.monotonic() - sent
    os.kill(ranks[1], signal.SIGCONT)
    output = finish(agent)
    assert agent.returncode != 0
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert any(line.startswith("error: interrupted (SIGINT): stopped at once") and
               "did not stop by itself within 3 s" in line and  # the watchdog ended it
               "(rank 0 on " in line for line in errors), (seconds, output[-3000:])
    # Rank 1 says why it ended too ("rank 1: lost contact ..." or "... (rank 1 on ...)"), even
    # when torchrun's SIGTERM reaches it while it reports (errors.signals_end_the_process).
    assert any("rank 1" in line for line in errors), output[-3000:]
    assert "SIGKILL" not in output, output[-3000:]
    assert alive(everyone) == []
    checkpoint.load(tmp_path / "checkpoint.pt")


def test_any_signal_torchrun_forwards_is_a_stop_request(tmp_path):
    """torchrun --signals-to-handle SIGTERM,SIGUSR2: SIGUSR2 reaches the ranks, which agree on a
    step, checkpoint there and exit 75; their workers ignore it (before, it killed them)."""
    cmd = torchrun_cmd(2, STEP, *ARGS, "--out-dir", tmp_path,
                       extra=("--signals-to-handle", "SIGTERM,SIGUSR2"))
    agent = start(cmd, tmp_path)
    wait_for(tmp_path / "checkpoint.pt", agent)
    agent.send_signal(signal.SIGUSR2)
    output = finish(agent)
    assert "(SIGUSR2): checkpoint saved" in output, output[-3000:]
    assert "SIGKILL" not in output and "error:" not in output, output[-3000:]
    assert checkpoint.load(tmp_path / "checkpoint.pt")["position"]["step"] > 0


def test_an_unexpected_exception_ends_the_process_with_its_message_and_its_workers(tmp_path):
    """An exception no step expects (a bug; on a GPU, an out-of-memory error) used to leave
    the process waiting for its workers forever at exit."""
    proc = python_step(tmp_path, PROBE_RAISE="0:12")
    wait_for(tmp_path / "checkpoint.pt", proc)
    workers = descendants(proc.pid)
    output = finish(proc)
    assert proc.returncode == 1, output[-3000:]
    assert "RuntimeError: planted by tests/rank_probe.py" in output, output[-3000:]
    assert alive(workers) == []


def test_the_watchdog_is_started_once_per_process_and_sleeps():
    """Tests run several steps' main() in one process (tests/test_bad_input.py): each used to
    start another watchdog, whose predecessor's wake-up socket was then closed, and a thread
    waiting on a closed socket wakes at once, for ever. The pytest process spun ~60 of them,
    a whole core of CI's two, for the rest of the session."""
    probe = ("import threading, time\n"
             "from harness import errors\n"
             "errors.watch_signals(); errors.watch_signals()\n"
             "start = time.process_time(); time.sleep(1)\n"
             "print(sum(t.name == 'signal watchdog' for t in threading.enumerate()),\n"
             "      time.process_time() - start)\n")
    out = launch([sys.executable, "-c", probe]).stdout.split()
    assert int(out[0]) == 1
    assert float(out[1]) < 0.1  # CPU seconds in one second of sleep: a spinning thread takes ~1


def test_a_stop_signal_while_a_step_starts_is_one_line(tmp_path):
    """A SIGTERM while step 00 still imports torch (torchrun's or SLURM's, as a job is cancelled
    at its start) ended the process silently, by the signal's default action: now one line, and
    exit 128 + 15. Later, in training, it is one line too (run_main's handlers)."""
    for delay, says in [(0.5, "interrupted (SIGTERM): stopped at once, while starting"),
                        (None, "SIGTERM received: stopped at once")]:
        out_dir = tmp_path / str(delay)
        out_dir.mkdir()
        proc = start([sys.executable, "00_single_gpu.py", *map(str, ARGS[:8]),
                      "--out-dir", out_dir], out_dir, fresh=True)
        if delay is None:  # once training prints its first progress line
            deadline = time.monotonic() + GUARD_S
            while "epoch 1: step" not in Path(proc.log.name).read_text():
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        else:
            time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=GUARD_S) == 128 + signal.SIGTERM
        errors = [line for line in Path(proc.log.name).read_text().splitlines()
                  if line.startswith("error:") or "Traceback" in line]
        assert len(errors) == 1 and says in errors[0], errors


def ignores(pid: int, signum: int) -> bool:
    """Whether process `pid` ignores `signum` now (its SigIgn mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return bool(int(status.split("SigIgn:")[1].split()[0], 16) >> (signum - 1) & 1)


def test_a_stop_signal_to_the_whole_job_while_it_evaluates_reaches_no_worker(tmp_path):
    """SLURM signals every process of a job. While 07 evaluated, its test loader's workers took
    the SIGTERM too and died of it, and the rank ended in DataLoader's RuntimeError, without a
    checkpoint (a helper's audit, 2026-11-29). They ignore it, as the training loader's do: the
    rank notes it, and stops at a step of the next epoch, checkpointed, exit 75. (Not closed: in
    a worker's first milliseconds, before its worker_init_fn runs, torch's own SIGTERM handler
    in it still ends it, torch 2.14.1's _worker_loop: the signal is sent once it ignores it.)"""
    args = [*ARGS, "--epochs", 2, "--test-samples", 6000, "--out-dir", tmp_path]  # (the last win)
    proc = start([sys.executable, STEP, *map(str, args)], tmp_path)
    deadline, training_worker = time.monotonic() + GUARD_S, None
    while True:  # the epoch's training worker, then another: the test loader's
        assert proc.poll() is None and time.monotonic() < deadline, read(proc)[-3000:]
        workers = children(proc.pid)
        training_worker = training_worker or (workers[0] if workers else None)
        testing = [pid for pid in workers if pid != training_worker]
        if testing:
            break
        time.sleep(0.01)
    started = time.monotonic()  # (a worker that will never ignore it is signalled after 2 s)
    while not ignores(testing[0], signal.SIGTERM) and time.monotonic() < started + 2:
        time.sleep(0.005)
    assert "epoch 1:" not in read(proc), "evaluated already: nothing was proven"
    os.killpg(proc.pid, signal.SIGTERM)  # every process of the job, as SLURM sends it
    output = finish(proc)
    assert proc.returncode == 75, output[-3000:]
    assert "epoch 1: train loss" in output and "DataLoader worker" not in output, output[-3000:]
    assert re.search(r"stopping at step \d+ of epoch 2 \(SIGTERM\): checkpoint saved", output)
