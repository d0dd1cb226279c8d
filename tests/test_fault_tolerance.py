"""Issue 16: step 07 survives a killed rank and a SIGTERM, and the result equals a run that
was never interrupted, weight for weight (dropout on: the RNG states are restored too).

One uninterrupted run is the reference; a run with a rank killed mid-epoch under
`torchrun --max-restarts 1`, and a run stopped by SIGTERM then requeued, must both end equal.
"""

import os
import signal
import subprocess
import time

import pytest
import torch

import common
from conftest import (REPO, base_env, max_difference, rank_params, read_summary, run_step,
                      torchrun_cmd)

# 960 samples, global batch 48: 20 steps per epoch; a checkpoint every 4 steps.
ARGS = ["--no-compile", "--data", "mnist", "--train-samples", 960, "--test-samples", 100,
        "--batch-size", 48, "--epochs", 2, "--checkpoint-every", 4]


@pytest.fixture(scope="module")
def h5_args(mnist_root, tmp_path_factory):
    """Prepare the HDF5 file once, so the timed part of every run is training."""
    h5 = tmp_path_factory.mktemp("h5") / "digits.h5"
    run_step("07_fault_tolerance.py", ["prepare", *ARGS, "--data-dir", mnist_root, "--h5", h5,
                                       "--out-dir", h5.parent / "prepare"])
    return [*ARGS, "--data-dir", mnist_root, "--h5", h5]


@pytest.fixture(scope="module")
def uninterrupted(h5_args, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    run_step("07_fault_tolerance.py", [*h5_args, "--out-dir", out], nproc=2,
             probe_dir=out / "probe")
    return out


def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_nothing_happened(
        uninterrupted, h5_args, tmp_path):
    # Rank 1 dies after step 27 = step 7 of epoch 2; the last checkpoint is at step 4 of epoch 2.
    proc = run_step("07_fault_tolerance.py", [*h5_args, "--out-dir", tmp_path], nproc=2,
                    probe_dir=tmp_path / "probe", env_extra={"PROBE_KILL": "1:27"},
                    torchrun_extra=("--max-restarts", "1"))
    assert "resumed at step 4 of epoch 2" in proc.stdout
    assert max_difference(rank_params(uninterrupted / "probe"),
                          rank_params(tmp_path / "probe")) == 0.0
    assert read_summary(tmp_path)["test_correct"] == read_summary(uninterrupted)["test_correct"]


def test_sigterm_saves_stops_and_a_requeued_job_continues_exactly(uninterrupted, h5_args,
                                                                  tmp_path):
    """What SLURM does at preemption or near the time limit: SIGTERM, later a requeue."""
    cmd = torchrun_cmd(2, REPO / "tests" / "rank_probe.py", "07_fault_tolerance.py", *h5_args,
                       "--out-dir", tmp_path)
    env = base_env(PROBE_DIR=tmp_path / "probe_first")
    (tmp_path / "probe_first").mkdir()
    agent = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    checkpoint = tmp_path / "checkpoint.pt"
    while not checkpoint.exists() and agent.poll() is None:  # the first step checkpoint
        time.sleep(0.05)
    agent.send_signal(signal.SIGTERM)  # torchrun forwards it to every worker
    output = agent.communicate(timeout=120)[0]
    assert "stopping at step" in output and "(SIGTERM): checkpoint saved" in output, output
    assert not (tmp_path / "summary.json").exists()  # stopped, not finished
    stopped_at = torch.load(checkpoint, weights_only=True)["position"]
    assert stopped_at["step"] % 10 == 0

    requeued = run_step("07_fault_tolerance.py", [*h5_args, "--out-dir", tmp_path], nproc=2,
                        probe_dir=tmp_path / "probe", env_extra={"SLURM_RESTART_COUNT": 1})
    assert "resumed at step" in requeued.stdout
    assert max_difference(rank_params(uninterrupted / "probe"),
                          rank_params(tmp_path / "probe")) == 0.0


def test_a_fresh_run_ignores_an_old_checkpoint(uninterrupted, h5_args, tmp_path):
    """Without a restart count, the run starts from scratch (and overwrites the checkpoint)."""
    (tmp_path / "checkpoint.pt").write_bytes((uninterrupted / "checkpoint.pt").read_bytes())
    proc = run_step("07_fault_tolerance.py", [*h5_args, "--epochs", 1, "--out-dir", tmp_path])
    assert "resumed" not in proc.stdout
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["epoch"] == 1


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    model = common.Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    path = tmp_path / "checkpoint.pt"
    common.save_checkpoint(path, model, optimizer, scheduler, 1, [])

    def dies_halfway(state, f):
        f.write(b"PK\x03\x04 half a zip file")
        raise KeyboardInterrupt  # stands in for SIGKILL mid-write

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        common.save_checkpoint(path, model, optimizer, scheduler, 2, [])
    assert common.load_checkpoint(path, torch.device("cpu"))["epoch"] == 1
