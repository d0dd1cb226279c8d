"""Steps 07a, 07b and 07 survive a killed rank and a SIGTERM, and the result equals a run that was
never interrupted: the same weights (dropout on: the RNG states are restored too), the same
reported training losses, a real samples/s.

One uninterrupted run of 07 is the reference; 07a killed mid-epoch and resumed with --resume,
07b (and a copied 07) with a rank killed mid-epoch under `torchrun --max-restarts 1`, and 07
stopped by SIGTERM then requeued, must all end equal to it.
"""

import re
import signal
import socket
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import common
from harness import checkpoint
from harness import step09_dcp_checkpoint as dcp_checkpoint
from conftest import (PORT_TAKEN_RERUNS, REPO, RESTART_ARGS, base_env,
                      copied_run_killed_at_step_27, max_difference, rank_params, read_summary,
                      run_step, saved_checkpoint, start, torchrun_cmd)
from conftest import launch as launch_cmd

# Where torchrun runs with --max-restarts: a restarted group must meet at a fresh store.
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": 1}


@pytest.fixture(scope="module")
def args(mnist_root):
    return [*RESTART_ARGS, "--data-dir", mnist_root]


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_07):
    return uninterrupted_07


def ends_as_uninterrupted(uninterrupted, out, stdout: str) -> dict:
    """A run resumed at step 4 of epoch 2 ends with the uninterrupted run's weights on every rank
    and its test answers; it ran epoch 2 only, from step 4 on, and the loss it reports for it is
    the whole epoch's, over every rank's samples, as the uninterrupted run reported it."""
    assert "resumed at step 4 of epoch 2" in stdout
    assert max_difference(rank_params(uninterrupted / "probe"), rank_params(out / "probe")) == 0.0
    straight, resumed = read_summary(uninterrupted), read_summary(out)
    assert resumed["test_correct"] == straight["test_correct"]
    assert resumed["train_losses"] == pytest.approx(straight["train_losses"][1:], rel=1e-12)
    return resumed


@PORT_TAKEN_RERUNS
def test_07a_killed_mid_epoch_resumes_exactly_from_its_checkpoint(uninterrupted, args, tmp_path):
    """07a has no restarts: rank 1 dies after step 27 (step 7 of epoch 2), the run fails, and the
    user's --resume continues from the checkpoint of step 4 of epoch 2, to the same weights."""
    killed = run_step("07a_exact_resume.py", [*args, "--out-dir", tmp_path], nproc=2,
                      probe_dir=tmp_path / "probe_killed", env_extra={"PROBE_KILL": "1:27"},
                      check=False)
    assert killed.returncode != 0 and not (tmp_path / "summary.json").exists()
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["position"]["step"] == 4
    proc = run_step("07a_exact_resume.py", [*args, "--out-dir", tmp_path, "--resume",
                                            tmp_path / "checkpoint.pt"], nproc=2,
                    probe_dir=tmp_path / "probe")
    ends_as_uninterrupted(uninterrupted, tmp_path, proc.stdout)


@pytest.mark.quick
@PORT_TAKEN_RERUNS
def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_nothing_happened(
        uninterrupted, args, tmp_path):
    # Rank 1 dies after step 27 = step 7 of epoch 2; the last checkpoint is at step 4 of epoch 2.
    # 07b's restarts (07 runs the same code, read in `diff -u 07b_restarts.py 07_...`; a copied
    # 07 is killed and restarted below).
    proc = run_step("07b_restarts.py", [*args, "--out-dir", tmp_path], nproc=2,
                    probe_dir=tmp_path / "probe", env_extra={"PROBE_KILL": "1:27", **FRESH_STORE},
                    torchrun_extra=("--max-restarts", "1"))
    resumed = ends_as_uninterrupted(uninterrupted, tmp_path, proc.stdout)
    assert resumed["samples_per_sec"] > 0  # timed over the 16 steps it did


@PORT_TAKEN_RERUNS
def test_a_copied_07_killed_and_restarted_ends_as_the_uninterrupted_run(uninterrupted, args,
                                                                        tmp_path):
    """07 and common.py in an empty folder, run without harness/ (no FLOP rate printed): rank 1
    is killed at step 7 of epoch 2 under `torchrun --max-restarts 1`, the group restarts from
    the checkpoint at step 4, and the run ends with the repository's uninterrupted test loss
    and accuracy: the plain sampler position, RNG states and restart detection do it alone."""
    proc = copied_run_killed_at_step_27("07_fault_tolerance.py", args, tmp_path)
    assert "resumed at step 4 of epoch 2" in proc.stdout, proc.stdout
    assert "FLOP/s" not in proc.stdout and "test accuracy" in proc.stdout, proc.stdout
    copied, straight = read_summary(tmp_path / "out"), read_summary(uninterrupted)
    assert (copied["test_loss"], copied["test_accuracy"]) == (straight["test_loss"],
                                                              straight["test_accuracy"])


def test_sigterm_saves_stops_and_a_requeued_job_continues_exactly(uninterrupted, args,
                                                                  tmp_path):
    """What SLURM does at preemption or near the time limit: SIGTERM, later a requeue."""
    cmd = torchrun_cmd(2, REPO / "tests" / "rank_probe.py", "07_fault_tolerance.py", *args,
                       "--out-dir", tmp_path)
    env = base_env(PROBE_DIR=tmp_path / "probe_first")
    (tmp_path / "probe_first").mkdir()
    with open(tmp_path / "output.txt", "w+") as log:
        agent = start(cmd, log, env=env)
        saved = tmp_path / "checkpoint.pt"
        while not saved.exists() and agent.poll() is None:  # the first step checkpoint
            time.sleep(0.05)
        agent.send_signal(signal.SIGTERM)  # torchrun forwards it to every worker
        agent.wait(timeout=120)
        log.seek(0)
        output = log.read()
    assert "stopping at step" in output and "(SIGTERM): checkpoint saved" in output, output
    # The workers stopped by themselves, well before torchrun's --shutdown-timeout (30 s)
    # would have killed them.
    assert "closing signal SIGKILL" not in output, output
    assert not (tmp_path / "summary.json").exists()  # stopped, not finished
    stopped_at = torch.load(saved, weights_only=True)["position"]

    requeued = run_step("07_fault_tolerance.py", [*args, "--out-dir", tmp_path], nproc=2,
                        probe_dir=tmp_path / "probe", env_extra={"SLURM_RESTART_COUNT": 1})
    assert f"resumed at step {stopped_at['step']} of epoch" in requeued.stdout
    assert max_difference(rank_params(uninterrupted / "probe"),
                          rank_params(tmp_path / "probe")) == 0.0
    straight, resumed = read_summary(uninterrupted), read_summary(tmp_path)
    ran = len(resumed["train_losses"])  # the epochs the requeued job ran, the stopped one first
    assert ran >= 1
    assert resumed["train_losses"] == pytest.approx(straight["train_losses"][-ran:], rel=1e-12)


def test_a_fresh_run_ignores_an_old_checkpoint(uninterrupted, args, tmp_path):
    """Without a restart count, the run starts from scratch (and overwrites the checkpoint)."""
    (tmp_path / "checkpoint.pt").write_bytes((uninterrupted / "checkpoint.pt").read_bytes())
    proc = run_step("07_fault_tolerance.py", [*args, "--epochs", 1, "--out-dir", tmp_path])
    assert "resumed" not in proc.stdout
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["epoch"] == 1


def test_restarts_without_a_fresh_store_are_refused_before_training(args, tmp_path):
    """Refused in one line per attempt, also when the same command runs again: a static launch
    (no --standalone, a fixed port) sets the same TORCHELASTIC_RUN_ID ("none") and port each
    time, and the once-per-launch marker keyed on them kept every rank of the second launch
    silent (issue 39)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-port", str(port), "--max-restarts", "1", "07_fault_tolerance.py",
           *map(str, args), "--out-dir", str(tmp_path)]
    for launch in range(2):
        proc = launch_cmd(cmd, check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        # torchrun restarts a failed group whatever the cause: one line per attempt, the same
        # one (printed by whichever rank of the attempt was first to say it: errors.report).
        errors = [re.sub(r" \(rank \d+ on \S+\)$", "", line) for line in errors]
        assert len(errors) == 2 and errors[0] == errors[1], (launch, proc.stderr)
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in errors[0]
    assert not (tmp_path / "checkpoint.pt").exists()


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    path, state = saved_checkpoint(tmp_path)  # epoch 1

    def dies_halfway(state, f):
        f.write(b"PK\x03\x04 half a zip file")
        raise KeyboardInterrupt  # stands in for SIGKILL mid-write

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(path, *state, 2)
    assert checkpoint.load(path)["epoch"] == 1


def test_what_a_checkpoint_restores_lands_on_the_cpu_first(tmp_path, monkeypatch):
    """On a GPU, torch.load(map_location=<the run's device>) would put the saved RNG states on
    the GPU, and torch.set_rng_state (CPU tensors only) would then fail every resume. Here a
    loader that puts whatever is not asked for on the CPU on "meta" stands in for a GPU: 07's
    and 09's loads must still give RNG states that set."""
    path, state = saved_checkpoint(tmp_path)
    checkpoint.save(path, *state, 1, rng=[common.rng_state()])  # as 07 saves them
    torch.save(common.rng_state(), tmp_path / "rng-rank0.pt")  # as 09 saves them
    real_load = torch.load

    def elsewhere_unless_cpu(f, map_location=None, **kwargs):
        return real_load(f, map_location="cpu" if map_location == "cpu" else "meta", **kwargs)

    monkeypatch.setattr(torch, "load", elsewhere_unless_cpu)
    torch.set_rng_state(checkpoint.load(path)["rng"][0]["cpu"])
    torch.set_rng_state(dcp_checkpoint.rng_state(tmp_path, SimpleNamespace(
        world_size=1, rank=0, is_main=True))["cpu"])
    # ...and the loader does stand in: without map_location="cpu" the same state cannot be set.
    with pytest.raises(TypeError, match="RNG state must be a torch.ByteTensor"):
        torch.set_rng_state(torch.load(tmp_path / "rng-rank0.pt", weights_only=True)["cpu"])


def test_an_epoch_too_short_for_ddp_to_report_its_buckets_still_saves(tmp_path):
    """DDP reports its rebuilt buckets only after a few synchronised steps. 03 prints them after
    its first epoch, before its save: with 2 steps (the issue's default flags) reading the report
    raised KeyError and no checkpoint was written (issue 43)."""
    proc = run_step("03_ddp_wrapper.py", ["--data", "synthetic", "--train-samples", 512,
                                          "--test-samples", 128, "--epochs", 1,
                                          "--out-dir", tmp_path])
    assert "DDP's gradient buckets: not reported yet" in proc.stdout
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["epoch"] == 1


@PORT_TAKEN_RERUNS
def test_a_job_stopped_near_the_end_of_an_epoch_finishes_after_its_restart(mnist_root, tmp_path):
    """Checkpointed at step 7 of an 8-step epoch, then a rank dies: the restarted group trains
    one step, then saves the epoch's end. (When 07 printed DDP's bucket report, which a new DDP
    has not made after one step, that crashed before the save, so the checkpoint stayed at step
    7 and every restart crashed again; 03's report now says "not reported yet", tested above.)"""
    proc = run_step("07_fault_tolerance.py",
                    ["--data", "mnist", "--data-dir", mnist_root, "--train-samples", 512,
                     "--batch-size", 64, "--checkpoint-every", 7, "--epochs", 1,
                     "--out-dir", tmp_path], nproc=2,
                    probe_dir=tmp_path / "probe", env_extra={"PROBE_KILL": "1:8", **FRESH_STORE},
                    torchrun_extra=("--max-restarts", "1"))
    assert "resumed at step 7 of epoch 1" in proc.stdout
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["epoch"] == 1
    assert read_summary(tmp_path)["test_correct"] > 0


@pytest.mark.parametrize("script", ["07_fault_tolerance.py", "09_distributed_checkpoint.py"])
def test_a_resume_with_another_lr_trains_at_it_and_says_so(mnist_root, tmp_path, script):
    """`--resume CKPT --lr X` used the checkpoint's rate silently, while summary.json said X
    (issue 43). Now X applies from the next step on, with a note; the same --lr changes nothing
    (the exact-resume tests)."""
    common = ["--data", "mnist", "--data-dir", mnist_root, "--train-samples", 192,
              "--test-samples", 64, "--batch-size", 64, "--checkpoint-every", 0]
    run_step(script, [*common, "--epochs", 1, "--lr", 0.05, "--out-dir", tmp_path / "first"])
    saved = tmp_path / "first" / ("checkpoint.pt" if script.startswith("07") else "checkpoint")
    proc = run_step(script, [*common, "--epochs", 2, "--lr", 0.001, "--resume", saved,
                             "--out-dir", tmp_path / "second"])
    assert "note: --lr 0.001 replaces the --lr 0.05 the checkpoint was trained with" in proc.stdout
    summary = read_summary(tmp_path / "second")
    assert summary["lr"] == 0.001
    assert summary["lrs"] == [pytest.approx(0.001 * 0.7, rel=1e-12)]  # epoch 2's decay, new rate
