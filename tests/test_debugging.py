"""Step 10: every planted bug ends, non-zero, in seconds, with one line naming the rank that is
behind (or the shapes that differ), at 2 and at 3 ranks; --fix exits 0. One torchrun per bug and
world size, and one for --fix at 3 ranks (the harder split: 97 training samples padded to 99,
31 test samples in unequal counts; the 2-rank --fix runs in tests/test_gpu.py under NCCL).

A copied 10, without the harness, plants its bug and ends with torch's own words. The diagnosis
alone, on made-up states, is checked in tests/test_debugging_diagnosis.py.
"""

from __future__ import annotations

import logging
import os
import re
import runpy
import sys

import pytest
from conftest import (REPO, LazyRuns, assert_no_traceback, copy_out, launch, run_step,
                      torchrun_cmd)

BUG_TIMEOUT = 6  # seconds a collective waits: skip and uneven hang this long, then fail
HANG_GUARD_SECONDS = 180  # a run that has not ended by then hangs (startup alone is ~10 s)
BUGS = ("skip", "shape", "uneven")
WORLDS = (2, 3)


@pytest.fixture(scope="module")
def bug_runs(tmp_path_factory):
    """Each bug once at 2 and once at 3 ranks, with the step's defaults (sized for the world
    size: rank 0 gets one sample more) but a shorter timeout; launched when a test first reads
    it."""
    def start(key):
        bug, nproc = key
        assert bug in BUGS and nproc in WORLDS, key
        out = tmp_path_factory.mktemp(f"{bug}{nproc}")
        args = ["--bug", bug, "--timeout", BUG_TIMEOUT, "--out-dir", out]
        return out, run_step("10_debugging.py", args, nproc=nproc, check=False,
                             timeout=HANG_GUARD_SECONDS)

    return LazyRuns(start)


def diagnosis(proc) -> str:
    """The run's own last line (torchrun's failure report goes to stderr)."""
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("diagnosis: "), proc.stdout[-3000:] + proc.stderr[-3000:]
    return last


@pytest.mark.parametrize("nproc", WORLDS)
@pytest.mark.parametrize("bug", BUGS)
def test_bug_ends_nonzero_with_a_diagnosis(bug_runs, bug, nproc):
    out, proc = bug_runs[bug, nproc]
    assert proc.returncode != 0
    assert_no_traceback(proc)
    diagnosis(proc)
    assert "backend=gloo" in proc.stdout and "TORCH_FR_BUFFER_SIZE=2000 (set by 10)" in proc.stdout
    # Each tool is named with what it found, for every rank.
    assert "[TORCH_DISTRIBUTED_DEBUG=DETAIL] rank " in proc.stdout
    for rank in range(nproc):
        assert f"[Flight Recorder] rank {rank} (" in proc.stdout
        assert (out / "flight_recorder" / f"rank{rank}").is_file()
    assert "last collectives: none" not in proc.stdout


@pytest.mark.parametrize("nproc", WORLDS)
def test_skip_names_rank_0_behind(bug_runs, nproc):
    line = diagnosis(bug_runs["skip", nproc][1])
    # Rank 0 stopped after epoch 1; the others wait in epoch 2's first gradient all-reduce.
    assert "rank 0 is behind (5 training steps, rank 1 took 6)" in line
    assert "missed collective #" in line
    assert "which rank 1 waits in at 10_debugging.py" in line and "in train_one_epoch" in line


@pytest.mark.parametrize("nproc, behind", [(2, "rank 1 is"), (3, "ranks 1, 2 are")])
def test_uneven_names_the_ranks_with_one_batch_less(bug_runs, nproc, behind):
    line = diagnosis(bug_runs["uneven", nproc][1])
    # 32N+1 samples: 33 on rank 0 (5 batches of 8), 32 on each other rank (4).
    assert f"{behind} behind (4 training steps, rank 0 took 5)" in line
    assert "which rank 0 waits in at 10_debugging.py" in line


@pytest.mark.parametrize("nproc", WORLDS)
def test_shape_names_every_rank_s_shape(bug_runs, nproc):
    line = diagnosis(bug_runs["shape", nproc][1])
    # 10N+1 test samples: 11 on rank 0, 10 on each other rank.
    assert "got tensors of different shapes" in line and "rank 0 [11] Float" in line
    assert all(f"rank {r} [10] Float" in line for r in range(1, nproc))
    assert ("(rank 0 differs)" in line) == (nproc > 2)  # at 2 ranks, neither is the odd one


@pytest.mark.parametrize("nproc", WORLDS)
def test_flight_recorder_files_agree_with_fr_trace(bug_runs, caplog, nproc):
    """torch's own analyser reads the files the step wrote (DDP's group, keys renamed) and
    finds the same rank missing from the same collective. (It reports through logging.)"""
    fr_trace = pytest.importorskip("torch.distributed.flight_recorder.fr_trace").main  # not in 2.8

    caplog.set_level(logging.INFO)
    fr_trace([str(bug_runs["skip", nproc][0] / "flight_recorder")])
    report = caplog.text
    assert "Not all ranks joining collective" in report and "missing ranks: {0}" in report
    assert "missing ranks: {1" not in report


def test_the_sample_output_in_docs_is_what_the_step_prints(bug_runs):
    """docs/debugging.md shows a 2-rank `--bug skip --timeout 6` run, as run here: its Flight
    Recorder and diagnosis lines are this run's, and every `10_debugging.py:LINE` the page quotes
    is a line this run names (a line number that moved fails here, not in a reader's hands)."""
    page = (REPO / "docs" / "debugging.md").read_text()
    sample = next(block for block in page.split("```")
                  if "10_debugging.py: world_size=2 bug=skip timeout=6s" in block)
    printed = bug_runs["skip", 2][1].stdout
    for line in sample.strip().splitlines():
        if line.startswith(("[Flight Recorder] rank", "diagnosis: ")):
            assert line in printed, f"{line}\nnot in what the step printed:\n{printed}"
    quoted = set(re.findall(r"10_debugging\.py:(\d+)", page))
    assert quoted and all(f"10_debugging.py:{n} in " in printed for n in quoted), quoted


def test_a_copied_10_plants_its_bug_and_ends_within_two_minutes(mnist_root, tmp_path):
    """10 and common.py alone in an empty folder, as a learner copies them out: --bug shape
    (DETAIL fails it at once: no timeout to wait for) ends non-zero within the 120 s given, a
    rank that failed says so in torch's words, where it was and where its Flight Recorder record
    went, and nothing of the harness (its diagnosis) or of a traceback through the step."""
    folder, out = tmp_path / "copied", tmp_path / "out"
    copy_out(["10_debugging.py"], folder)
    proc = launch(torchrun_cmd(2, "10_debugging.py", "--bug", "shape", "--timeout", 5, "--data",
                               "mnist", "--data-dir", mnist_root, "--out-dir", out),
                  cwd=folder, check=False, timeout=120)
    assert proc.returncode != 0
    # Each rank leaves at once; torchrun may end the other before it has said it all.
    failed = [r for r in (0, 1) if f"rank {r}: Detected mismatch between collectives on ranks. "
              f"Rank {r} is running collective" in proc.stdout]
    assert failed, proc.stdout[-3000:] + proc.stderr[-3000:]
    rank, record = failed[0], out / "flight_recorder" / f"rank{failed[0]}"
    assert re.search(rf"rank {rank}: failed at 10_debugging\.py:\d+ in all_test_losses after 5 "
                     rf"training steps", proc.stdout), proc.stdout[-3000:]
    assert record.is_file() and (f"rank {rank}: Flight Recorder record: {record}; read every "
                                 f"rank's: python -m torch.distributed.flight_recorder.fr_trace "
                                 f"{record.parent}") in proc.stdout
    assert "diagnosis:" not in proc.stdout and "[Flight Recorder]" not in proc.stdout
    assert not [line for line in (proc.stdout + proc.stderr).splitlines()
                if line.strip().startswith("File ") and str(folder) in line], proc.stderr[-3000:]


def test_fix_exits_0_at_3_ranks(tmp_path):
    proc = run_step("10_debugging.py", ["--fix", "--out-dir", tmp_path], nproc=3,
                    timeout=HANG_GUARD_SECONDS)
    assert_no_traceback(proc)
    assert "stopping early" in proc.stdout  # the all-reduced flag stopped every rank
    assert "median test loss over 31 samples" in proc.stdout  # equal shapes gathered all


@pytest.mark.parametrize("args, env, message", [
    (["--bug", "skip"], {}, "the planted bugs need 2 or more processes, not 1: torchrun "
                            "--standalone --nproc-per-node 2 10_debugging.py --bug skip"),
    (["--fix"], {"TORCH_FR_BUFFER_SIZE": "abc"},
     "TORCH_FR_BUFFER_SIZE='abc': the Flight Recorder keeps that many collectives per rank; give "
     "a whole number from 0 (off) to 2147483647, or unset it (torch's default: 2000)"),
])
def test_refused_before_any_work(args, env, message):
    """One line, exit 2, before any process group exists. An unreadable TORCH_FR_BUFFER_SIZE
    is checked by every step (harness/errors.run_main): torch itself aborts on it with no
    message (SIGABRT) once a group is made, which 10 always does."""
    proc = run_step("10_debugging.py", args, env_extra=env, check=False, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {message}"


# ---------------------------------------------------------------- the step's own functions
def the_step(monkeypatch) -> dict:
    """The step's functions, as a module's namespace; main() does not run."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # (the step's import sets its own)
    return runpy.run_path(str(REPO / "10_debugging.py"))


def test_waiting_for_the_gpu_gives_up_after_the_timeout(monkeypatch):
    """The NCCL-only wait (a CUDA event's query()), with a stand-in event that never fires."""
    wait_until_done = the_step(monkeypatch)["wait_until_done"]

    class Never:
        def query(self):
            return False

    class Done:
        def query(self):
            return True

    wait_until_done(Done(), 0.1)
    with pytest.raises(RuntimeError, match="did not finish within 0.2 s"):
        wait_until_done(Never(), 0.2)


def test_the_step_turns_the_flight_recorder_on_where_torch_keeps_it_off(monkeypatch):
    """torch 2.8 to 2.10 keep no entries unless TORCH_FR_BUFFER_SIZE is set (gloo recorded
    nothing: "last collectives: none", .ci/every_torch.sh); 2.15 keeps 2000. Step 10 asks for
    2000, and leaves a value the user set alone."""
    step = the_step(monkeypatch)
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_DISTRIBUTED_DEBUG", "TORCH_NCCL_BLOCKING_WAIT"):
        # Restored after the test, also when unset now (delenv of an unset name records
        # nothing, and turn_on_tools' values then leaked into every later test's processes:
        # TORCH_DISTRIBUTED_DEBUG=DETAIL broke 07's restarts in the next module).
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    step["turn_on_tools"]()
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")
    step["turn_on_tools"]()
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "50"
