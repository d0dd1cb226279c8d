"""Step 11: every planted mistake ends non-zero with one diagnosis line, torch's own error quoted
where torch raises one, and all fixes together make N ranks equal one process over the global
batch: forward outputs, clipped gradients, BatchNorm running statistics and weights, within the
rounding that a control (the same steps, the ranks' samples in reverse order) measures.

Real torchrun processes, each launched once (module fixture): all fixes in one launch on 2 (from
MNIST's files, as a copied 11 reads them) and on 3 ranks; every bug on 2 ranks; the silent ones,
whose numbers depend on the world size (samples drawn N times, N ranks' BatchNorm statistics, N
ranks' clipping), on 3 ranks too. The raising ones fail the same way on any world size: each
rank raises on its own, before its next collective. Copied out with common.py, 11 runs without
harness/: a planted bug ends in torch's own error, and --fix trains as in the repository.
"""

from __future__ import annotations

import json
import runpy
import sys
from types import SimpleNamespace

import pytest
import torch

import common
from harness.step11_diagnosis import ABSOLUTE, CHECKS, TIMES, report

from conftest import (REPO, LazyRuns, assert_no_traceback, assert_normalises_as_batchnorm2d,
                      copy_out, launch, run_step, torchrun_cmd)

BUGS = ["sampler", "unused", "batchnorm", "clip", "checkpointing", "save"]
RUNS = [("fix", 2), ("fix", 3), *[(bug, 2) for bug in BUGS],
        ("sampler", 3), ("batchnorm", 3), ("clip", 3), ("clip-never-bites", 2)]
FLAGS = {"fix": ["--fix"], "clip-never-bites": ["--bug", "clip", "--max-norm", 10000]}
HANG_GUARD_SECONDS = 180  # a run that has not ended by then hangs (startup alone is ~10 s)
# N ranks vs one process, float32: the same sums in another order, rounded as the CPU's kernels
# round them (this VM: 1.2e-7 in the gradients; an Intel Xeon: 6.6e-4, issue 59). So the bound
# is the run's own, measured where it runs: TIMES x how far the control (the same steps with the
# ranks' samples joined in reverse order) lands from the one process, + ABSOLUTE
# (harness/step11_diagnosis.py), written into checks.json as "rounding" and "bound" per check.
# What the planted silent mistakes measured (docs/your-model.md): 1e-3 and more.
WRONG = 1e-3
DEFAULT_PER_RANK = 16 * 4  # --batch-per-rank 16 x --steps 4: the samples each rank draws
COPY_GUARD_SECONDS = 120  # issue 44: a copied 11 plants its bug and ends within two minutes


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mnist_root):
    """(the finished process, its checks.json or None) per (bug or "fix", world size); its
    --out-dir per (bug or "fix", world size, "out"). Each of RUNS launched once, when a test
    first reads it."""
    def start(key):
        if len(key) == 3:  # (name, nproc, "out"): the run's folder
            runs[key[:2]]
            return runs[key]
        name, nproc = key
        assert (name, nproc) in RUNS, key
        out = tmp_path_factory.mktemp(f"{name}{nproc}")
        args = FLAGS.get(name, ["--bug", name])
        if (name, nproc) == ("fix", 2):  # as a copied 11 trains: it has no synthetic digits
            args = [*args, "--data", "mnist", "--data-dir", mnist_root]
        proc = run_step("11_your_model.py", [*args, "--out-dir", out], nproc=nproc,
                        check=False, timeout=HANG_GUARD_SECONDS)
        checks = out / "checks.json"
        runs[name, nproc, "out"] = out
        return proc, json.loads(checks.read_text()) if checks.exists() else None

    runs = LazyRuns(start)
    return runs


def last_line(proc) -> str:
    """The run's own last line (torchrun's failure report goes to stderr)."""
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("nproc", [2, 3])
def test_all_fixes_equal_one_process(runs, nproc):
    proc, checks = runs["fix", nproc]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_no_traceback(proc)
    assert last_line(proc).startswith(f"all fixes hold: {nproc} ranks equal one process")
    for kind in CHECKS:
        assert checks[kind] <= checks["bound"][kind], (kind, checks)
        assert checks["bound"][kind] == TIMES * checks["rounding"][kind] + ABSOLUTE, checks
        assert f"check {kind}: {nproc} ranks vs one process over the global batch, 4 steps: " \
               f"largest difference {checks[kind]:.3g} (rounding {checks['rounding'][kind]:.3g}" \
               f", bound {checks['bound'][kind]:.3g})" in proc.stdout
    assert max(checks["rounding"].values()) > 0  # the control rounds otherwise: it measured
    assert checks["between ranks"] == 0.0  # every rank computed the same statistics, bit for bit
    assert max(checks["norms"]) > 1.0  # the clip (--max-norm 1) acted in every step
    assert checks["shared_by_rank_0"] == 0 and checks["distinct"] == DEFAULT_PER_RANK * nproc
    assert checks["reloaded"] == 0.0  # the saved model reloads bit for bit


@pytest.mark.parametrize("gradients, rounding, holds", [
    (6.6e-4, 1e-4, True),  # a CPU that rounds coarsely: its control rounds as coarsely
    (6.6e-4, 3.6e-8, False),  # as coarse where the control rounds finely: not rounding
    (9e-7, 0.0, True),  # the control rounded as the reference did: ABSOLUTE is the bound
    (1.2e-6, 0.0, False)])
def test_a_check_holds_within_ten_times_the_controls_rounding(gradients, rounding, holds,
                                                              tmp_path, capsys):
    """report() in this process, on made-up numbers: the verdict is the control's, not a fixed
    number's (issue 59: an Intel Xeon's gradients 6.6e-4 from one process's failed 1e-5)."""
    one_process = SimpleNamespace(
        found={**dict.fromkeys(CHECKS, 0.0), "gradients": gradients, "between ranks": 0.0},
        rounding={**dict.fromkeys(CHECKS, 0.0), "gradients": rounding}, norms=[2.0])
    sampled = {"per_rank": 64, "shared_by_rank_0": 0, "distinct": 128}
    args = SimpleNamespace(bug=None, steps=4, max_norm=1.0, out_dir=tmp_path)
    failed = report(one_process, sampled, 0.0, SimpleNamespace(world_size=2), args)
    printed, checks = capsys.readouterr().out, json.loads((tmp_path / "checks.json").read_text())
    assert failed is not holds and checks["unequal"] == ([] if holds else ["gradients"])
    bound = TIMES * rounding + ABSOLUTE
    assert checks["bound"]["gradients"] == bound and checks["rounding"]["gradients"] == rounding
    assert f"largest difference {gradients:.3g} (rounding {rounding:.3g}, bound {bound:.3g})" \
        in printed
    assert printed.splitlines()[-1].startswith("all fixes hold" if holds else (
        f"error: a fix did not hold: gradients {gradients:.3g} from one process's (bound "
        f"{bound:.3g})")), printed


@pytest.mark.parametrize("bug, nproc", [run for run in RUNS if run[0] in BUGS])
def test_every_bug_ends_nonzero_with_a_diagnosis(runs, bug, nproc):
    proc, _ = runs[bug, nproc]
    assert proc.returncode != 0
    assert_no_traceback(proc)
    assert last_line(proc).startswith("diagnosis: "), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "failed (exitcode: 4)" in proc.stderr  # the step's own code for "the mistake showed"


def test_a_planted_mistake_that_changes_nothing_is_not_diagnosed_as_one(runs):
    """--max-norm 10000: clipping inside the micro-batch loop never bites, so the gradients equal
    one process's. The diagnosis used to name the mistake anyway, quoting a difference below its
    own tolerance (issue 43); it must say what it measured, and the run ends 0."""
    proc, checks = runs["clip-never-bites", 2]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert checks["gradients"] <= checks["bound"]["gradients"] and checks["unequal"] == []
    assert last_line(proc).startswith("diagnosis: none measured: --bug clip is planted")
    assert "clipping never bit" in last_line(proc)


def test_unused_quotes_ddp_and_names_the_parameters(runs):
    """TORCH_DISTRIBUTED_DEBUG=INFO (the step's default) adds the parameters' names."""
    proc, _ = runs["unused", 2]
    assert ("Expected to have finished reduction in the prior iteration before starting a new "
            "one") in proc.stdout
    assert "Parameters which did not receive grad for rank 0: aux_head.bias, aux_head.weight" \
        in proc.stdout
    assert "find_unused_parameters=True" in last_line(proc)
    assert "aux_head.bias, aux_head.weight" in last_line(proc)


def test_reentrant_checkpointing_marks_a_parameter_ready_twice(runs):
    proc, _ = runs["checkpointing", 2]
    assert "Expected to mark a variable ready only once" in proc.stdout
    assert "with name block.0.weight has been marked as ready twice" in proc.stdout
    assert "use_reentrant=False" in last_line(proc)


def test_the_wrappers_state_dict_does_not_load_into_a_plain_model(runs):
    proc, _ = runs["save", 2]
    assert "Error(s) in loading state_dict for YourModel" in proc.stdout
    assert 'Unexpected key(s) in state_dict: "module.conv1.weight"' in proc.stdout
    assert "model.module.state_dict()" in last_line(proc)


@pytest.mark.parametrize("nproc", [2, 3])
def test_without_a_sampler_every_rank_draws_the_same_samples(runs, nproc):
    """Silent: the step computes correctly, on one rank's data N times."""
    proc, checks = runs["sampler", nproc]
    assert checks["shared_by_rank_0"] == checks["per_rank"] == DEFAULT_PER_RANK
    assert checks["distinct"] == DEFAULT_PER_RANK  # not N times as many
    assert checks["unequal"] == []  # every equality with one process still holds
    assert f"all {nproc} ranks trained on {DEFAULT_PER_RANK} distinct samples" in last_line(proc)


@pytest.mark.parametrize("nproc", [2, 3])
def test_per_rank_batchnorm_is_not_one_process(runs, nproc):
    """Outputs, gradients, running statistics and weights all differ from one process, and the
    ranks' running statistics differ from each other; the other fixes still hold."""
    proc, checks = runs["batchnorm", nproc]
    for kind in CHECKS:
        assert checks[kind] > max(WRONG, checks["bound"][kind]), (kind, checks)
    assert checks["between ranks"] > WRONG, checks
    assert checks["unequal"] == list(CHECKS)
    assert checks["shared_by_rank_0"] == 0 and checks["reloaded"] == 0.0
    assert "SyncBatchNorm" in last_line(proc)


@pytest.mark.parametrize("nproc", [2, 3])
def test_clipping_inside_the_micro_batch_loop_is_not_one_processs_clipped_step(runs, nproc):
    proc, checks = runs["clip", nproc]
    for kind in ("gradients", "weights"):
        assert checks[kind] > max(WRONG, checks["bound"][kind]), (kind, checks)
    assert checks["between ranks"] == 0.0  # BatchNorm is still synchronised
    assert "clip once, after the last backward" in last_line(proc)


@pytest.mark.parametrize("arguments, expected", [
    (["--fix"], "11 compares N ranks with one process: start 2 or more"),
    (["--fix", "--max-norm", "0"], "--max-norm must be a finite number above 0"),
    (["--bug", "clip", "--steps", "1"], "--steps must be from 2 to 1000"),
    (["--bug", "sampler", "--fix"], "not allowed with argument"),
    (["--bug", "everything"], "invalid choice: 'everything'"),
])
def test_bad_input_is_one_line_before_any_work(arguments, expected, tmp_path, monkeypatch,
                                               capsys):
    """In this process, as tests/test_bad_input.py checks the other steps: nothing may run."""
    def no_work(*args, **kwargs):
        raise AssertionError(f"{arguments} got past the checks")

    monkeypatch.setattr(torch.distributed, "init_process_group", no_work)
    monkeypatch.setattr(common, "load_datasets", no_work)
    monkeypatch.setattr(sys, "argv", ["11_your_model.py", *arguments, "--out-dir", str(tmp_path)])
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO / "11_your_model.py"), run_name="__main__")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and expected in err, err


def result_line(proc) -> str:
    """The step's own line on the trained model (printed with or without the harness)."""
    return next(line for line in proc.stdout.splitlines() if line.startswith("after "))


def test_a_copied_11_plants_its_bug_and_its_fix_trains_as_in_the_repository(runs, mnist_root,
                                                                             tmp_path):
    """11 and common.py in an empty folder, on 2 ranks without harness/ (no one-process replay,
    no diagnosis): --bug unused ends within two minutes in torch's own error, and --fix exits 0
    with the repository's result line and the model it saved, bit for bit."""
    folder = tmp_path / "copied"
    copy_out(["11_your_model.py"], folder)
    data = ["--data", "mnist", "--data-dir", mnist_root]
    bug = launch(torchrun_cmd(2, "11_your_model.py", "--bug", "unused", *data, "--out-dir",
                              tmp_path / "unused"), cwd=folder, check=False,
                 timeout=COPY_GUARD_SECONDS)
    assert bug.returncode != 0
    assert "RuntimeError: Expected to have finished reduction in the prior iteration" in \
        bug.stderr, bug.stderr[-3000:]
    assert "diagnosis:" not in bug.stdout and "check outputs" not in bug.stdout
    fixed = launch(torchrun_cmd(2, "11_your_model.py", "--fix", *data, "--out-dir",
                                tmp_path / "fix"), cwd=folder, timeout=COPY_GUARD_SECONDS)
    assert "all fixes hold" not in fixed.stdout  # (the harness's check)
    repository = runs["fix", 2][0]
    assert result_line(fixed) == result_line(repository), fixed.stdout[-2000:]
    saved = [torch.load(out / "your_model.pt", weights_only=True)
             for out in (tmp_path / "fix", runs["fix", 2, "out"])]
    assert saved[0].keys() == saved[1].keys()
    assert all(torch.equal(saved[0][key], saved[1][key]) for key in saved[0])


def test_11s_batchnorm_converter_computes_what_batchnorm2d_does(one_process_group):
    """11's convert_batchnorm makes every BatchNorm (2d and 1d alike) an AllReducedBatchNorm.
    Two passes (the global mean, then the squared deviations around it), as nn.BatchNorm2d
    computes them: where a channel's mean is 100 times its spread, outputs and input gradients
    within 1e-4 of it and the same running statistics; the one-pass E[x^2] - mean^2 misses that
    bound (issue 45 measured 4.9e-3 off in the outputs and 2.0e-2 in the gradients)."""
    import copy

    import torch.nn as nn

    step = runpy.run_path(str(REPO / "11_your_model.py"), run_name="step11")
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4, momentum=0.2)
    nn.init.uniform_(bn.weight, 0.5, 2)
    nn.init.uniform_(bn.bias, -1, 1)
    model = step["convert_batchnorm"](nn.Sequential(copy.deepcopy(bn), nn.BatchNorm1d(3)))
    assert [type(m).__name__ for m in model] == ["AllReducedBatchNorm"] * 2  # every kind
    x, y = assert_normalises_as_batchnorm2d(bn, model[0])
    x_ = x.clone().requires_grad_()  # the one-pass variance, as a hand-written BatchNorm might
    mean, square = x_.mean((0, 2, 3), keepdim=True), (x_ ** 2).mean((0, 2, 3), keepdim=True)
    y_one_pass = (x_ - mean) / torch.sqrt(square - mean ** 2 + bn.eps) * bn.weight.view(
        1, -1, 1, 1) + bn.bias.view(1, -1, 1, 1)
    assert (y - y_one_pass).abs().max() > 1e-4  # (the bound above is not loose)


# SIGTERM to a rank waiting in C (gloo) runs its handler at Python's next call, once the wait
# fails: under 11's old take_in, in run_main's handling. Here around() is a lock (C's __exit__).
PENDING = """import os, signal, threading, time
from harness import around, errors; import torch.distributed as dist  # noqa: E702
master = [dist.TCPStore("127.0.0.1", 0, 1, True)]
def main():  # SIGTERM blocked in the main thread: another thread notes it, as in gloo's wait
    store = dist.TCPStore("127.0.0.1", master[0].port, 1, False)
    errors.stop_signals_end_now(), signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Timer(0.5, lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.5),
                                  master.clear())).start()  # then the store goes: get fails
    store.get("never set")
around.around = lambda main: threading.Lock()
errors.run_main(main)"""


def test_a_sigterm_pending_when_a_wait_in_c_fails_is_one_line():
    proc = launch([sys.executable, "-c", PENDING], check=False, fresh=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 143 and "Traceback" not in proc.stderr and errors == [
        "error: SIGTERM received: stopped at once, without a checkpoint (the last one saved is "
        "kept)"], proc.stderr[-3000:]
