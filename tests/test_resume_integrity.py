"""Issue 27, item 4: a resume never silently trains the wrong samples, and a restart never adopts
another run's checkpoint.

Step 07 on 2 ranks is stopped in the middle of its epoch by a real SIGTERM; every rank's trained
sample indices are logged (tests/rank_probe.py). Resumed on 1 rank with the same global batch,
the two runs together train every sample of the epoch exactly once. Resumed with another batch
or seed (which would skip and repeat samples), it is refused in one line naming what differs.
A restart in an --out-dir holding another run's checkpoint starts afresh instead of adopting it.
Step 09 (DCP checkpoint folders, which record the settings in run.json) is held to the same.
"""

import json
import os
import re
import shutil

import pytest
import torch

from harness import checkpoint
from conftest import assert_no_traceback, run_step

SAMPLES, BATCH = 480, 24  # 20 steps of 24: every sample is trained once per epoch (no remainder)
STEP = "07_fault_tolerance.py"


@pytest.fixture(scope="module")
def args(mnist_root):
    return ["--data", "mnist", "--data-dir", mnist_root, "--train-samples", SAMPLES,
            "--test-samples", 20, "--batch-size", BATCH, "--epochs", 1, "--checkpoint-every", 0,
            "--quiet"]


def stop_mid_epoch(script, args, out):
    """2 ranks; rank 0 gets a real SIGTERM after its second step, and all stop at the next
    vote, saving a checkpoint there."""
    proc = run_step(script, [*args, "--out-dir", out], nproc=2, probe_dir=out / "probe",
                    env_extra={"PROBE_SIGNAL": "0:2:SIGTERM"}, check=False)
    assert "(SIGTERM): checkpoint saved" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def stopped(args, tmp_path_factory):
    """07, stopped mid-epoch (stop_mid_epoch)."""
    out = tmp_path_factory.mktemp("stopped")
    stop_mid_epoch(STEP, args, out)
    position = checkpoint.load(out / "checkpoint.pt")["position"]
    assert 2 <= position["step"] < SAMPLES // BATCH, position  # stopped mid-epoch
    return out


def trained(probe_dir, rank) -> list[int]:
    """The training-set indices that rank fetched (= trained on: no loader workers, no
    prefetch, on the CPU)."""
    fetched = torch.load(probe_dir / f"rank{rank}.pt", weights_only=True)["indices"]
    return [i for batch in fetched.get(SAMPLES, []) for i in batch]


def assert_refused_naming_seed_and_batch(proc) -> None:
    """A mid-epoch resume with --seed 1 and --batch-size 48 (the run had 0 and 24): one line,
    exit 2, naming both."""
    assert proc.returncode == 2
    assert_no_traceback(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "middle of an epoch" in errors[0] and "skip some samples" in errors[0]
    assert "seed 0 -> 1" in errors[0] and "global_batch 24 -> 48" in errors[0], errors[0]


def test_a_mid_epoch_resume_on_another_world_size_trains_every_sample_once(stopped, args,
                                                                            tmp_path):
    """Resumed as a requeued job would be (issue 39): started with --resume pointing at an
    older checkpoint (here the same run after epoch 0), it has saved the stopped checkpoint
    in its --out-dir since. --resume is for the first attempt: the requeue continues from its
    own newer checkpoint, not from --resume (which redid the work, on every requeue)."""
    shutil.copy(stopped / "checkpoint.pt", tmp_path / "checkpoint.pt")
    older = {key: value for key, value in checkpoint.load(stopped / "checkpoint.pt").items()
             if key not in ("position", "rng")}
    torch.save({**older, "epoch": 0}, tmp_path / "started-from.pt")
    proc = run_step(STEP, [*args, "--resume", tmp_path / "started-from.pt",
                           "--out-dir", tmp_path], probe_dir=tmp_path / "probe",
                    env_extra={"SLURM_RESTART_COUNT": 1})
    step = checkpoint.load(stopped / "checkpoint.pt")["position"]["step"]
    assert f"resumed at step {step} of epoch 1" in proc.stdout
    before = trained(stopped / "probe", 0) + trained(stopped / "probe", 1)
    after = trained(tmp_path / "probe", 0)
    assert len(before) == step * BATCH
    assert sorted(before + after) == list(range(SAMPLES))  # each once, none lost


def test_a_mid_epoch_resume_with_another_batch_or_seed_is_refused(stopped, args, tmp_path):
    saved = (stopped / "checkpoint.pt").read_bytes()
    proc = run_step(STEP, [*args, "--batch-size", 48, "--seed", 1, "--resume",
                           stopped / "checkpoint.pt", "--out-dir", tmp_path], check=False)
    assert_refused_naming_seed_and_batch(proc)
    assert (stopped / "checkpoint.pt").read_bytes() == saved
    assert not (tmp_path / "checkpoint.pt").exists() and not (tmp_path / "summary.json").exists()


def test_a_restart_does_not_adopt_another_runs_checkpoint(stopped, args, tmp_path):
    """A requeued job (SLURM_RESTART_COUNT=1) whose --out-dir holds a checkpoint of a run with
    another seed and size starts afresh, and its checkpoint then records its own settings."""
    shutil.copy(stopped / "checkpoint.pt", tmp_path / "checkpoint.pt")
    proc = run_step(STEP, [*args, "--seed", 1, "--train-samples", 240, "--out-dir", tmp_path],
                    env_extra={"SLURM_RESTART_COUNT": 1})
    assert "resumed" not in proc.stdout
    assert "another run wrote it" in proc.stdout and "seed 0 -> 1" in proc.stdout, proc.stdout
    assert "train_samples 480 -> 240" in proc.stdout
    assert "this run's first checkpoint replaces it" in proc.stdout, proc.stdout
    mine = checkpoint.load(tmp_path / "checkpoint.pt")
    assert mine["epoch"] == 1 and mine["run"]["seed"] == 1 and mine["run"]["train_samples"] == 240


# Step 09: the same promises for its DCP checkpoint folders (the settings are in run.json).
STEP_09 = "09_distributed_checkpoint.py"


@pytest.fixture(scope="module")
def stopped_09(args, tmp_path_factory):
    """09 on 2 ranks, stopped mid-epoch as 07 is above; its checkpoint is a DCP folder."""
    out = tmp_path_factory.mktemp("stopped_09")
    proc = stop_mid_epoch(STEP_09, args, out)
    step = int(re.search(r"stopping at step (\d+) of epoch 1", proc.stdout).group(1))
    assert 2 <= step < SAMPLES // BATCH, step  # stopped mid-epoch
    return out, step


def test_09_a_mid_epoch_resume_on_another_world_size_trains_every_sample_once(stopped_09, args,
                                                                               tmp_path):
    stopped, step = stopped_09
    proc = run_step(STEP_09, [*args, "--resume", stopped / "checkpoint", "--out-dir", tmp_path],
                    probe_dir=tmp_path / "probe")
    assert f"at step {step} of epoch 1" in proc.stdout, proc.stdout
    before = trained(stopped / "probe", 0) + trained(stopped / "probe", 1)
    assert len(before) == step * BATCH
    assert sorted(before + trained(tmp_path / "probe", 0)) == list(range(SAMPLES))


def test_09_a_mid_epoch_resume_with_another_batch_or_seed_is_refused(stopped_09, args, tmp_path):
    stopped, _ = stopped_09
    proc = run_step(STEP_09, [*args, "--batch-size", 48, "--seed", 1, "--resume",
                              stopped / "checkpoint", "--out-dir", tmp_path], check=False)
    assert_refused_naming_seed_and_batch(proc)
    assert not list(tmp_path.glob("checkpoint*")) and not (tmp_path / "summary.json").exists()


def test_09_a_restart_does_not_adopt_another_runs_checkpoint(stopped_09, args, tmp_path):
    """A requeued job whose --out-dir holds another run's DCP checkpoint (the folder and the
    link to it) starts afresh; its own checkpoint then records its settings."""
    stopped, _ = stopped_09
    folder = (stopped / "checkpoint").resolve()
    shutil.copytree(folder, tmp_path / folder.name)
    (tmp_path / "checkpoint").symlink_to(folder.name)
    proc = run_step(STEP_09, [*args, "--seed", 1, "--train-samples", 240,
                              "--out-dir", tmp_path], env_extra={"SLURM_RESTART_COUNT": 1})
    assert "resumed" not in proc.stdout
    assert "another run wrote it" in proc.stdout and "seed 0 -> 1" in proc.stdout, proc.stdout
    assert "train_samples 480 -> 240" in proc.stdout
    mine = json.loads((tmp_path / "checkpoint" / "run.json").read_text())
    assert mine["seed"] == 1 and mine["train_samples"] == 240
    assert os.readlink(tmp_path / "checkpoint") == "checkpoint-epoch1-end"


def test_09_a_damaged_random_state_of_one_rank_stops_every_rank(stopped_09, args, tmp_path):
    """Each rank reads its own rng-rank<R>.pt. Rank 1's was damaged: rank 1 stopped, and rank 0
    went on into the next collective and waited there until killed (issue 39). Now every rank
    learns it, and all stop with rank 1's line (once per machine), exit 2."""
    stopped, _ = stopped_09
    folder = shutil.copytree((stopped / "checkpoint").resolve(), tmp_path / "damaged")
    (folder / "rng-rank1.pt").write_bytes(b"")
    proc = run_step(STEP_09, [*args, "--resume", folder, "--out-dir", tmp_path / "out"],
                    nproc=2, check=False, timeout=120)  # (a hang guard: --timeout is 600 s)
    assert_no_traceback(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"{folder / 'rng-rank1.pt'} is damaged or is not a random state" in errors[0]
    assert "exitcode: 2" in proc.stderr and "SIGKILL" not in proc.stderr, proc.stderr[-3000:]
