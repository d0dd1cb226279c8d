"""Step 10: every planted bug ends, non-zero, in seconds, with one line naming the rank that is
behind (or the shapes that differ); --fix exits 0. One torchrun per bug and one for --fix.

The diagnosis itself is also checked without processes, on made-up states, for the branches no
planted bug reaches (a rank in no collective, a rank that died).
"""

from __future__ import annotations

import logging

import pytest
from conftest import assert_no_traceback, run_step
from plumbing import step10_debugging as debug

BUG_TIMEOUT = 6  # seconds a collective waits: skip and uneven hang this long, then fail
HANG_GUARD_SECONDS = 180  # a run that has not ended by then hangs (startup alone is ~10 s)


def load_step():
    """Where step 10's diagnosis line is made (plumbing/step10_debugging.py)."""
    return debug


@pytest.fixture(scope="module")
def bug_runs(tmp_path_factory):
    """Each bug once, with the step's defaults (65 synthetic samples) but a shorter timeout."""
    runs = {}
    for bug in ("skip", "shape", "uneven"):
        out = tmp_path_factory.mktemp(bug)
        args = ["--bug", bug, "--timeout", BUG_TIMEOUT, "--out-dir", out]
        runs[bug] = (out, run_step("10_debugging.py", args, nproc=2, check=False,
                                   timeout=HANG_GUARD_SECONDS))
    return runs


def diagnosis(proc) -> str:
    """The run's own last line (torchrun's failure report goes to stderr)."""
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("diagnosis: "), proc.stdout[-3000:] + proc.stderr[-3000:]
    return last


@pytest.mark.parametrize("bug", ["skip", "shape", "uneven"])
def test_bug_ends_nonzero_with_a_diagnosis(bug_runs, bug):
    out, proc = bug_runs[bug]
    assert proc.returncode != 0
    assert_no_traceback(proc)
    diagnosis(proc)
    # Each tool is named with what it found, for every rank.
    assert "[TORCH_DISTRIBUTED_DEBUG=DETAIL] rank " in proc.stdout
    for rank in (0, 1):
        assert f"[Flight Recorder] rank {rank} (" in proc.stdout
        assert (out / "flight_recorder" / f"rank{rank}").is_file()


def test_skip_names_rank_0_behind(bug_runs):
    line = diagnosis(bug_runs["skip"][1])
    # Rank 0 stopped after epoch 1; rank 1 waits in epoch 2's first gradient all-reduce.
    assert "rank 0 is behind (5 training steps, rank 1 took 6)" in line
    assert "missed collective #" in line
    assert "which rank 1 waits in at 10_debugging.py" in line and "in train_one_epoch" in line


def test_uneven_names_rank_1_behind(bug_runs):
    line = diagnosis(bug_runs["uneven"][1])
    # 33 samples on rank 0 (5 batches of 8), 32 on rank 1 (4).
    assert "rank 1 is behind (4 training steps, rank 0 took 5)" in line
    assert "which rank 0 waits in at 10_debugging.py" in line


def test_shape_names_both_shapes(bug_runs):
    line = diagnosis(bug_runs["shape"][1])
    # 21 test samples: 11 on rank 0, 10 on rank 1.
    assert "got tensors of different shapes" in line
    assert "rank 0 [11] Float" in line and "rank 1 [10] Float" in line


def test_flight_recorder_files_agree_with_fr_trace(bug_runs, caplog):
    """torch's own analyser reads the files the step wrote (DDP's group, keys renamed) and
    finds the same rank missing from the same collective. (It reports through logging.)"""
    from torch.distributed.flight_recorder.fr_trace import main as fr_trace

    caplog.set_level(logging.INFO)
    fr_trace([str(bug_runs["skip"][0] / "flight_recorder")])
    report = caplog.text
    assert "Not all ranks joining collective" in report and "missing ranks: {0}" in report
    assert "missing ranks: {1}" not in report


def test_fix_exits_0(tmp_path):
    proc = run_step("10_debugging.py", ["--fix", "--out-dir", tmp_path], nproc=2,
                    timeout=HANG_GUARD_SECONDS)
    assert_no_traceback(proc)
    assert "stopping early" in proc.stdout  # the all-reduced flag stopped both ranks
    assert "median test loss over 21 samples" in proc.stdout  # equal shapes gathered all


# ---------------------------------------------------------------- the diagnosis alone
def state(rank, steps, last_seq, pending=None, absent=(), where="here"):
    """A rank's published state, as 10_debugging.rank_state makes it, without the record."""
    last = {"seq": last_seq, "op": "all_reduce", "shapes": [[4]], "dtypes": ["Float"],
            "done": pending is None}
    return {"rank": rank, "steps": steps, "last": {"DDP's group": last}, "pending": pending,
            "detail": None, "absent": list(absent), "where": where}


def test_diagnosis_names_a_rank_in_no_collective():
    """DETAIL's monitored barrier names the rank that never came (same steps, same record)."""
    step = load_step()
    states = {0: state(0, 3, 7, absent=[1], where="a.py:1 in f"), 1: state(1, 3, 7)}
    line = step.diagnose(states, 2)
    assert line.startswith("rank 1 is behind") and "rank 0 waits in at a.py:1 in f" in line


def test_diagnosis_without_detail_uses_the_flight_recorder_counts():
    """Without DETAIL, the waiting rank's record holds one collective more, not completed."""
    step = load_step()
    waiting = {"seq": 8, "op": "all_reduce", "shapes": [[4]], "dtypes": ["Float"], "done": False}
    states = {0: state(0, 3, 8, pending=waiting, where="a.py:9 in g"), 1: state(1, 3, 7)}
    line = step.diagnose(states, 2)
    assert line.startswith("rank 1 is behind: it missed collective #8 all_reduce of [4] Float")
    assert "which rank 0 waits in at a.py:9 in g" in line


def test_diagnosis_names_a_rank_that_died():
    step = load_step()
    assert step.diagnose({0: state(0, 3, 7)}, 2).startswith("rank 1 died")


def test_diagnosis_names_the_collectives_only_the_rank_ahead_holds():
    """gloo marked DDP's timed-out all-reduce as completed (seen here): the counts still tell."""
    step = load_step()
    states = {0: state(0, 5, 14, where="a.py:5 in h"), 1: state(1, 6, 16, where="a.py:7 in t")}
    assert step.diagnose(states, 2) == (
        "rank 0 is behind (5 training steps, rank 1 took 6): it missed collective #15-16 "
        "all_reduce of [4] Float on DDP's group, which rank 1 waits in at a.py:7 in t; rank 0 "
        "is at a.py:5 in h")


def test_a_bug_needs_two_processes():
    """Checked before any process group exists: one line, exit 2."""
    proc = run_step("10_debugging.py", ["--bug", "skip"], check=False, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: the planted bugs are sized for 2 processes, not 1: "
                                   "torchrun --standalone --nproc-per-node 2 10_debugging.py "
                                   "--bug skip")
