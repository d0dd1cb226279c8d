"""Step 12: every planted mistake ends non-zero within 120 s with exactly one diagnosis line that
names it, and --fix makes N ranks equal one process for each part, with 1 and 2 micro-batches.

Real torchrun processes, each launched once (module fixture), 10 in all: --fix on 2 ranks copied
out with common.py alone (no harness/: the step proves its claims itself) and on 3 ranks in the
repository, each with 1 then 2 micro-batches in the one run (the step's default); every bug on 2
and on 3 ranks (the numbers of the silent ones depend on the world size: how many tokens each
rank holds, whose gradients a gather drops, how many samples the sampler pads; the uneven one
waits out --timeout, 5 s here instead of its 10, idle). The rule that decides (10x a control's
rounding + 1e-6) and bad input are checked in this process.
"""

from __future__ import annotations

import re
import runpy
import sys
import time

import pytest
import torch

import common
from conftest import REPO, LazyRuns, assert_no_traceback, copy_out, launch, torchrun_cmd

STEP = "12_what_to_reduce.py"
BUGS = ["tokens", "gather", "uneven", "outputs"]
RUNS = [("fix", 2), ("fix", 3), *[(bug, nproc) for bug in BUGS for nproc in (2, 3)]]
DIAGNOSIS_SECONDS = 120  # issue 59: each planted mistake is diagnosed within two minutes
CHECK = re.compile(r"^check (?P<kind>.+?): (?P<note>.*)off by (?P<off>\S+) from one process "
                   r"\(rounding (?P<rounding>\S+)\)$", re.M)
# What the silent mistakes measured (torch 2.14.1 and 2.8.0, this VM; docs/what-to-reduce.md):
# 0.0062 to 0.28 in the gradients, 0.013 to 0.021 in the AUROC; the fixes, 1.2e-7 at most.
WRONG = 1e-3
NAMED = {"tokens": "token means", "gather": "drops the gradient", "outputs": "counted twice",
         "uneven": "model.join()"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the finished process, its seconds, the folder it ran in) per (bug or "fix", world size),
    each of RUNS launched once, when a test first reads it. ("fix", 2) runs copied out: 12 and
    common.py alone in a folder."""
    def start(key):
        assert key in RUNS, key
        name, nproc = key
        cwd = REPO
        if key == ("fix", 2):
            cwd = tmp_path_factory.mktemp("fix2") / "copied"
            copy_out([STEP], cwd)
        started = time.monotonic()
        flags = ["--fix"] if name == "fix" else ["--bug", name]
        if name == "uneven":  # (the suite's time: the hang waits 5 s, not the default 10)
            flags += ["--timeout", "5"]
        proc = launch(torchrun_cmd(nproc, STEP, *flags), cwd=cwd, check=False,
                      timeout=DIAGNOSIS_SECONDS + 60)
        return proc, time.monotonic() - started, cwd

    return LazyRuns(start)


def checks(proc) -> list[dict]:
    return [match.groupdict() for match in CHECK.finditer(proc.stdout)]


@pytest.mark.parametrize("nproc", [2, 3])
def test_every_fix_makes_n_ranks_one_process_with_1_and_2_micro_batches(runs, nproc):
    proc, _, _ = runs["fix", nproc]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_no_traceback(proc)
    assert proc.stdout.strip().splitlines()[-1].startswith(
        f"all four hold: {nproc} ranks equal one process with 1 then 2 micro-batch(es)")
    found = checks(proc)
    assert [c["kind"] for c in found] == [f"{part}, {micro} micro-batch(es)" for micro in (1, 2)
                                          for part in ("tokens", "gather", "uneven")] + ["outputs"]
    for check in found:  # the step's own rule, on the numbers it printed
        assert float(check["off"]) <= 10 * float(check["rounding"]) + 1e-6, check
        assert float(check["off"]) < WRONG, check
    stream = 4 * (3 * nproc + 1)  # 4 samples a batch, one batch more than 3 per rank
    assert f"trained {stream} of the stream's {stream} samples" in proc.stdout
    size = 10 * nproc + 1
    assert f"{size} outputs for {size} test samples (0 counted twice)" in proc.stdout


def test_a_copied_12_proves_its_fixes_with_common_alone(runs):
    """Without harness/ (no checked flags, no one-line errors of its own): the replay, the checks
    and the diagnosis are the step's, so a copy proves what the repository proves."""
    proc, _, folder = runs["fix", 2]
    assert folder != REPO and sorted(p.name for p in folder.glob("*.py")) == [STEP, "common.py"]
    assert proc.returncode == 0 and "all four hold" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("bug, nproc", [run for run in RUNS if run[0] in BUGS])
def test_every_bug_ends_nonzero_within_120_s_with_one_diagnosis(runs, bug, nproc):
    proc, seconds, _ = runs[bug, nproc]
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert seconds < DIAGNOSIS_SECONDS, seconds
    assert_no_traceback(proc)
    diagnoses = [line for line in proc.stdout.splitlines() if "diagnosis:" in line]
    assert len(diagnoses) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == diagnoses[0]
    assert diagnoses[0].startswith(f"diagnosis: {bug}") and NAMED[bug] in diagnoses[0]
    assert "failed (exitcode: 4)" in proc.stderr  # the step's code for "the mistake showed"


@pytest.mark.parametrize("bug, nproc", [run for run in RUNS if run[0] in ("tokens", "gather",
                                                                             "outputs")])
def test_a_silent_mistake_is_measured_far_beyond_the_rounding(runs, bug, nproc):
    """The run trains on, without an error: only the comparison with one process shows it."""
    proc, _, _ = runs[bug, nproc]
    planted = [c for c in checks(proc) if c["kind"].startswith(bug)]
    assert planted, proc.stdout[-3000:]
    for check in planted:
        assert float(check["off"]) > max(WRONG, 1000 * float(check["rounding"])), check


@pytest.mark.parametrize("nproc", [2, 3])
def test_distributed_sampler_padding_counts_samples_twice(runs, nproc):
    proc, _, _ = runs["outputs", nproc]
    size, padded = 10 * nproc + 1, -(-(10 * nproc + 1) // nproc) * nproc
    assert f"{padded} outputs for {size} test samples ({padded - size} counted twice)" \
        in proc.stdout, proc.stdout[-2000:]


def test_uneven_batches_hang_until_the_timeout_which_torch_names(runs):
    """Rank 0's fourth step waits in DDP's all-reduce; gloo raises after --timeout (5 s here)."""
    proc, seconds, _ = runs["uneven", 2]
    assert "rank 0: Timed out waiting 5000ms" in proc.stdout, proc.stdout[-2000:]
    assert "rank 0 held 4 batches, the others 3" in proc.stdout
    assert seconds > 5  # it waited out the timeout: a hang, not an error at once


def test_the_rule_decides_on_made_up_numbers(capsys):
    """DDP is off when more than 10x the control's rounding, + 1e-6, from one process."""
    step = runpy.run_path(str(REPO / STEP), run_name="step12")
    one = torch.tensor([1.0])

    def replay(control_off):
        return lambda reverse: [one + control_off if reverse else one]
    verdict = step["verdict"]
    assert verdict("a", [one + 1e-5], replay(1e-6), "", "advice") == ""  # within 1.1e-5
    assert verdict("b", [one + 2e-5], replay(1e-6), "", "advice").startswith("b: off by 2e-05")
    assert verdict("c", [one + 5e-7], replay(0.0), "", "advice") == ""  # the floor, 1e-6
    assert verdict("d", [one + 3e-6], replay(0.0), "", "advice").endswith("(rounding 0): advice")
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed] == [f"check {k}" for k in "abcd"]


@pytest.mark.parametrize("arguments, expected", [
    (["--fix"], "12 compares N ranks with one process: start 2 or more"),
    (["--fix", "--micro-batches", "3"], "invalid choice: 3 (choose from 1, 2, 4)"),
    (["--bug", "everything"], "invalid choice: 'everything'"),
    (["--bug", "tokens", "--fix"], "not allowed with argument"),
    (["--fix", "--timeout", "0"], "--timeout must be a finite number above 0"),
])
def test_bad_input_is_one_line_before_any_work(arguments, expected, monkeypatch, capsys):
    def no_work(*args, **kwargs):
        raise AssertionError(f"{arguments} got past the checks")

    monkeypatch.setattr(torch.distributed, "init_process_group", no_work)
    monkeypatch.setattr(common, "setup_distributed", no_work)
    monkeypatch.setattr(sys, "argv", [STEP, *arguments])
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO / STEP), run_name="__main__")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and expected in err, err
