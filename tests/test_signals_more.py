"""Issue 43, section 2 (and the error-marker folder of section 3): signals that were swallowed or
ended in tracebacks, each sent for real to real processes.

- 09's export on SIGTERM (a shard that is a FIFO nobody writes): one line, exit 143 (was killed
  silently); a Ctrl-C during a slow checkpoint read ends 09 with 130.
- A Ctrl-C in run_main's teardown, after main() returned: one line, no traceback; a SIGTERM
  during Python's exit after that: silence.
- 11 on SIGTERM (a preemption): a line of its own, not only torchrun's traceback.
- Stopping the tour stops the step it started, with one line, exit 128 + the signal.
- A link planted where the error markers go is not followed.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, base_env, frames_of_ours, launch, torchrun_cmd
from test_interrupts import GUARD_S, alive, descendants, finish, one_error_line, read, start

STEP09 = "09_distributed_checkpoint.py"


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory) -> Path:
    """A complete DCP checkpoint of step 09 (one process, one short epoch)."""
    out = tmp_path_factory.mktemp("dcp")
    launch([sys.executable, STEP09, "--data", "synthetic", "--train-samples", "192",
            "--test-samples", "64", "--batch-size", "48", "--epochs", "1", "--quiet",
            "--out-dir", out], timeout=GUARD_S)
    return (out / "checkpoint").resolve()


def waits_on_a_fifo(proc) -> bool:
    """The process (or a child) is blocked opening a FIFO nobody writes."""
    return any(Path(f"/proc/{pid}/wchan").read_text() == "wait_for_partner"
               for pid in [proc.pid, *descendants(proc.pid)] if Path(f"/proc/{pid}").exists())


def test_sigterm_during_the_export_is_one_line(dcp_checkpoint, tmp_path):
    """The export installed no handler: SIGTERM's default action killed it, rc -15, silent."""
    stalled = tmp_path / "stalled"
    subprocess.run(["cp", "-r", dcp_checkpoint, stalled], check=True)
    (stalled / "__0_0.distcp").unlink()
    os.mkfifo(stalled / "__0_0.distcp")  # opening it blocks, as a hung network filesystem does
    proc = start([sys.executable, STEP09, "export", "--resume", stalled, "--out-dir",
                  tmp_path / "export"], tmp_path)
    deadline = time.monotonic() + GUARD_S
    while not waits_on_a_fifo(proc):
        assert proc.poll() is None and time.monotonic() < deadline, read(proc)
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output = finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert output.strip() == ("error: SIGTERM received: stopped at once, without a checkpoint "
                              "(the last one saved is kept)"), output[-3000:]


# Step 09 whose every checkpoint read takes 6 s, as on a slow filesystem (the recipe).
SLOW_READS = """
import runpy, sys, time
sys.path.insert(0, ".")
from torch.distributed.checkpoint import FileSystemReader
read_data = FileSystemReader.read_data
def slowly(self, plan, planner):
    print("reading slowly", flush=True)
    time.sleep(6)
    return read_data(self, plan, planner)
FileSystemReader.read_data = slowly
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ctrl_c_during_a_slow_checkpoint_read_ends_09(dcp_checkpoint, tmp_path):
    """Reported as swallowed: the run resumed and exited 0. That run had inherited SIGINT
    ignored (a command started with `&` by a non-interactive shell is, by POSIX, and Python
    keeps it so); a Ctrl-C that reaches the process ends the load as it ends everything."""
    proc = start([sys.executable, "-c", SLOW_READS, STEP09, "--data", "synthetic",
                  "--train-samples", "192", "--test-samples", "64", "--batch-size", "48",
                  "--epochs", "2", "--quiet", "--resume", dcp_checkpoint, "--out-dir",
                  tmp_path / "out"], tmp_path)
    deadline = time.monotonic() + GUARD_S
    while "reading slowly" not in read(proc):
        assert proc.poll() is None and time.monotonic() < deadline, read(proc)
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    output = finish(proc)
    assert proc.returncode == 130, output[-3000:]
    one_error_line(output, "interrupted (SIGINT)")
    assert "resumed from" not in output and "Traceback" not in output, output[-3000:]


# main() returns; run_main's teardown (a garbage collection, then the group's destruction) meets
# a real Ctrl-C, sent as the destruction starts so that it lands there every time. (The issue
# saw it by chance in the collection, on rank 1 of a torchrun run that got Ctrl-C as it ended.)
CTRL_C_IN_TEARDOWN = """
import os, signal
import torch.distributed as dist
from harness import errors

destroy = dist.destroy_process_group

def ctrl_c_then_destroy():
    os.kill(os.getpid(), signal.SIGINT)
    destroy()

def main():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group = ctrl_c_then_destroy  # (main() itself does not call it)

errors.run_main(main)
"""


def test_ctrl_c_in_the_teardown_after_main_is_one_line():
    done = launch([sys.executable, "-c", CTRL_C_IN_TEARDOWN], check=False, timeout=GUARD_S)
    assert done.returncode == 130, done.stderr[-3000:]
    one_error_line(done.stderr, "interrupted (SIGINT)")
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


# run_main is done; a real SIGTERM arrives while Python's exit runs its atexit callbacks, as
# torchrun's did to a rank of step 12 that had finished while its peer failed (CI, once: rank 0
# printed "Exception ignored in atexit callback" and a traceback through our handler). A step's
# script has its stop signals handled from the start (harness/startup.py); so does this one.
SIGTERM_IN_PYTHONS_EXIT = """
import atexit, os, signal, time
from harness import errors, startup

def main():
    atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(1)))

signal.signal(signal.SIGTERM, startup.stopped_while_starting)
errors.run_main(main)
"""


def test_a_sigterm_during_pythons_exit_after_main_ends_it_silently():
    done = launch([sys.executable, "-c", SIGTERM_IN_PYTHONS_EXIT], check=False, timeout=GUARD_S)
    assert done.returncode == 0, done.stderr[-3000:]  # main() succeeded: too late to stop it
    assert done.stdout == done.stderr == "", done.stderr[-3000:]


def test_sigterm_to_11_under_torchrun_is_said_by_the_step(tmp_path):
    """A preemption: SIGTERM to torchrun, which forwards it to every rank. The ranks ended by
    SIGTERM's default action, silently; only torchrun's SignalException traceback followed."""
    agent = start(torchrun_cmd(2, "11_your_model.py", "--fix", "--steps", 1000,
                               "--train-samples", 32000, "--out-dir", tmp_path / "out"),
                  tmp_path)
    deadline = time.monotonic() + GUARD_S
    while "11_your_model.py: device=" not in read(agent):  # both ranks are set up
        assert agent.poll() is None and time.monotonic() < deadline, read(agent)
        time.sleep(0.05)
    everyone = descendants(agent.pid)
    agent.send_signal(signal.SIGTERM)
    output = finish(agent)
    one_error_line(output, "SIGTERM received: stopped at once", "(rank ")
    assert "SIGKILL" not in output, output[-3000:]  # every rank ended by itself
    assert not frames_of_ours(output), output[-3000:]  # (torchrun's own traceback is its own)
    assert alive(everyone) == []


def ranks_running(tour) -> list[int]:
    """The pids below the tour once step 02's two ranks train (torchrun + 2), else []."""
    below = descendants(tour.pid)
    return below if len(below) >= 3 and "02_manual_ddp.py: device=" in read(tour) else []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stopping_the_tour_stops_its_step(tmp_path, signum):
    """SIGTERM to the tour (a job's end), or SIGINT to its process alone (an IDE's stop
    button): the tour used to die at once (SIGTERM) or with a traceback, leaving its step's
    torchrun and ranks running (both). Now the step gets the signal, ends, and so does the
    tour, with its line and exit 128 + the signal."""
    tour = start([sys.executable, "tour.py", "--data", "synthetic", "--samples", "256",
                  "--test-samples", "64", "--out-dir", tmp_path / "tour"], tmp_path)
    deadline = time.monotonic() + GUARD_S
    while not (everyone := ranks_running(tour)):
        assert tour.poll() is None and time.monotonic() < deadline, read(tour)
        time.sleep(0.05)
    tour.send_signal(signum)  # to the tour's process alone
    output = finish(tour)
    assert tour.returncode == 128 + signum, output[-3000:]
    tour_lines = [line for line in output.splitlines() if line.startswith("tour:")]
    assert len(tour_lines) == 1 and signal.Signals(signum).name in tour_lines[0], output[-3000:]
    assert "Traceback" not in output.split("$ torchrun")[0], output[-3000:]  # (the tour's)
    assert not frames_of_ours(output), output[-3000:]
    assert alive(everyone) == []


MARKER_PROBE = "from harness import errors; errors.report('the planted error')"


def report_from_two_ranks(tmp: Path) -> list[str]:
    """Both ranks of one 'launch' (WORLD_SIZE=2, the same parent) report the same error."""
    lines = []
    for rank in (0, 1):
        done = subprocess.run([sys.executable, "-c", MARKER_PROBE], cwd=REPO, timeout=GUARD_S,
                              env=base_env(TMPDIR=tmp, WORLD_SIZE=2, RANK=rank),
                              capture_output=True, text=True, check=True)
        lines += done.stderr.splitlines()
    return lines


def test_a_link_planted_as_the_error_marker_folder_is_not_followed(tmp_path):
    """Another user links the marker folder's name (under the shared temporary folder) to a
    folder of theirs: a launch that reported an error deleted an old file there and left its
    marker. Now the link is refused, and both ranks say their line (rather twice than never);
    a folder of our own still makes one line of two."""
    theirs, tmp = tmp_path / "theirs", tmp_path / "tmp"
    theirs.mkdir()
    tmp.mkdir()
    for name in ("old-file", "0123456789abcdef0123"):  # any name, and a name like a marker's
        (theirs / name).write_text("keep me")
        os.utime(theirs / name, (0, 0))  # from 1970: "a launch long gone"
    for name in ("ddp-tutorial-errors", f"ddp-tutorial-errors-{os.geteuid()}"):
        (tmp / name).symlink_to(theirs)  # wherever the markers may go
    lines = report_from_two_ranks(tmp)
    assert sorted(p.name for p in theirs.iterdir()) == ["0123456789abcdef0123", "old-file"]
    assert [line.split(" (rank")[0] for line in lines] == ["error: the planted error"] * 2
    ours = tmp_path / "ours"
    ours.mkdir()
    assert len(report_from_two_ranks(ours)) == 1
    folder = ours / f"ddp-tutorial-errors-{os.geteuid()}"
    assert folder.stat().st_mode & 0o777 == 0o700


# A rank whose main thread cannot take a signal (as one waiting in a collective for a stalled
# peer: Python runs no handler there), so that its watchdog ends it, 3 s after a Ctrl-C.
STUCK_RANK = """
import signal, time
from harness import errors

def main():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # the main thread only
    print("stuck", flush=True)
    time.sleep(120)

errors.run_main(main)
"""


def test_every_rank_the_watchdog_ends_says_its_line(tmp_path):
    """Two ranks of one launch, both stuck when Ctrl-C comes: each says that it did not stop by
    itself. The line was printed once per machine, so the second rank said nothing (rank 1 of
    test_ctrl_c_while_a_peer_is_stalled_ends_the_run_in_seconds[torchrun], on a busy machine:
    it resumed into a wait for its gone peer, and its watchdog said rank 0's words)."""
    ranks = []
    for rank in (0, 1):  # (each with its output in a folder of its own)
        (tmp_path / str(rank)).mkdir()
        ranks.append(start([sys.executable, "-c", STUCK_RANK], tmp_path / str(rank),
                           TMPDIR=tmp_path, WORLD_SIZE=2, RANK=rank))
    for rank in ranks:
        deadline = time.monotonic() + GUARD_S
        while "stuck" not in read(rank):
            assert rank.poll() is None and time.monotonic() < deadline, read(rank)
            time.sleep(0.05)
    for rank in ranks:
        rank.send_signal(signal.SIGINT)
    for number, rank in enumerate(ranks):
        output = finish(rank)
        assert rank.returncode == 130, output[-3000:]
        one_error_line(output, "interrupted (SIGINT)", "did not stop by itself within 3 s",
                       f"(rank {number} on ")


def loading_torch(pids) -> bool:
    """One of these processes is inside `import torch`: its C library is mapped (the import
    goes on for a second or more after that, through torch's Python modules)."""
    for pid in pids:
        try:
            if "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text():
                return True
        except (FileNotFoundError, ProcessLookupError):
            pass
    return False


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_ctrl_c_while_torch_loads_is_one_line(tmp_path, launcher):
    """A Ctrl-C in the first seconds, while the step imports torch: a 37-line KeyboardInterrupt
    traceback through importlib, from the step or from each of torchrun's workers. (Started
    fresh: a forked run has torch loaded before its first line.)"""
    args = ["--data", "synthetic", "--epochs", "1", "--out-dir", str(tmp_path / "out")]
    if launcher == "python":
        proc = start([sys.executable, "00_single_gpu.py", *args], tmp_path, fresh=True)
        loaders = lambda: [proc.pid]  # noqa: E731
    else:
        proc = start(torchrun_cmd(2, "02_manual_ddp.py", *args), tmp_path, fresh=True)
        loaders = lambda: descendants(proc.pid)  # noqa: E731 -- torchrun's workers
    deadline = time.monotonic() + GUARD_S
    while not loading_torch(loaders()):
        assert proc.poll() is None and time.monotonic() < deadline, read(proc)
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)  # (torchrun passes it to its workers)
    output = finish(proc)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors and all(line.startswith("error: interrupted (SIGINT): stopped at once, "
                                          "while starting") for line in errors), output[-3000:]
    assert not frames_of_ours(output) and "importlib" not in output, output[-3000:]
    if launcher == "python":
        assert proc.returncode == 130 and len(errors) == 1, output[-3000:]
