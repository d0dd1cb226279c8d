"""train_template.py, copied alone into an empty folder as a user starts a project: it trains on
2 CPU ranks, ends with the uninterrupted run's weights bit for bit after a kill -9 or a SIGTERM
(and a requeue), and its --check passes on 2 and 3 ranks and names a planted DDP mistake. The
two ports in examples/ pass --check and resume bit for bit too; resnet18's plain BatchNorm fails
--check; on the CPU its every BatchNorm is step 11's all-reduced one."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from conftest import PORT_TAKEN_RERUNS, REPO, base_env, children, launch, start, torchrun_cmd

TEMPLATE = "train_template.py"
# 64 steps an epoch: long enough for a signal to land mid-run, a few seconds on 2 CPU ranks
SMALL = ["--epochs", "2", "--batch-size", "64", "--checkpoint-every", "5"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The template alone, and two copies with a planted mistake."""
    folder = tmp_path_factory.mktemp("template")
    text = (REPO / TEMPLATE).read_text()
    (folder / TEMPLATE).write_text(text)
    plain_bn = text.replace("nn.LayerNorm(128)", "nn.BatchNorm1d(128)")  # not synchronised
    no_sampler = text.replace("sampler=sampler, drop_last=True", "drop_last=True")
    backward = "            scaler.scale(loss).backward()  # (a disabled scaler: loss.backward())\n"
    clip_in_loop = text.replace(backward, backward + "            torch.nn.utils.clip_grad_norm_("
                                "model.parameters(), max_norm)\n")  # each rank's, in no_sync
    assert plain_bn != text and no_sampler != text and clip_in_loop != text  # (still planted)
    (folder / "plain_bn.py").write_text(plain_bn)
    (folder / "no_sampler.py").write_text(no_sampler)
    (folder / "clip_in_loop.py").write_text(clip_in_loop)
    return folder


def weights(out_dir, epochs=2) -> dict:
    saved = torch.load(out_dir / "checkpoint.pt", weights_only=True)
    assert (saved["epoch"], saved["step"]) == (epochs, 0), (saved["epoch"], saved["step"])
    return saved["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a), "not bit for bit"


@pytest.fixture(scope="module")
def uninterrupted(folder):
    out = folder / "uninterrupted"
    proc = launch(torchrun_cmd(2, TEMPLATE, *SMALL, "--out-dir", out), cwd=folder)
    assert proc.stdout.count("test accuracy") == 2, proc.stdout
    return weights(out)


def start_and_signal(folder, out, signum, *, torchrun_extra=(), worker=False, env=None,
                     script=TEMPLATE, args=SMALL):
    """Start the template; once its first checkpoint is written, send `signum` to torchrun (or,
    worker=True, to one of its worker processes). Returns the finished process."""
    cmd = torchrun_cmd(2, script, *args, "--out-dir", out, extra=torchrun_extra)
    with open(folder / f"{out.name}.log", "w+") as log:
        proc = start(cmd, log, env=env, cwd=folder)
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
        # a worker: a child of torchrun running the template (forked or not: conftest.children)
        os.kill(children(proc.pid)[-1] if worker else proc.pid, signum)
        proc.wait(timeout=300)
        log.seek(0)
        return proc.returncode, log.read()


@PORT_TAKEN_RERUNS
def test_kill_9_of_a_rank_resumes_to_the_same_weights(folder, uninterrupted):
    """torchrun --max-restarts 1 restarts the group after a kill -9 of one rank; the template
    resumes from its step checkpoint (sampler position and every rank's RNG state)."""
    out = folder / "killed"
    code, output = start_and_signal(folder, out, signal.SIGKILL, worker=True,
                                    torchrun_extra=("--max-restarts", "1"),
                                    env=base_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1))
    assert code == 0, output
    assert "resumed at step" in output, output
    assert_same_weights(weights(out), uninterrupted)


def test_sigterm_checkpoints_exits_75_and_a_requeue_ends_as_uninterrupted(folder, uninterrupted):
    """SIGTERM (a preemption) to torchrun: the ranks agree on a step, checkpoint there and exit
    75; the job started again as SLURM requeues it (SLURM_RESTART_COUNT=1) resumes there."""
    out = folder / "preempted"
    code, output = start_and_signal(folder, out, signal.SIGTERM)
    assert "stopping at step" in output, output
    assert code != 0, output  # torchrun reports its workers' 75 as a failure
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert saved["epoch"] < 2, "the run finished before the signal: nothing was proven"
    proc = launch(torchrun_cmd(2, TEMPLATE, *SMALL, "--out-dir", out), cwd=folder,
                  env=base_env(SLURM_RESTART_COUNT=1))
    assert "resumed at step" in proc.stdout, proc.stdout
    assert_same_weights(weights(out), uninterrupted)


def test_a_restart_does_not_adopt_another_runs_checkpoint(folder, uninterrupted, tmp_path):
    """A requeued run whose --out-dir holds a checkpoint written with other flags (another
    --seed) says so and starts afresh, instead of continuing someone else's training."""
    out = tmp_path / "reused"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes((folder / "uninterrupted" / "checkpoint.pt").read_bytes())
    proc = launch(torchrun_cmd(2, TEMPLATE, *SMALL, "--seed", 1, "--out-dir", out), cwd=folder,
                  env=base_env(SLURM_RESTART_COUNT=1))
    assert "not resuming from" in proc.stdout and "resumed at" not in proc.stdout, proc.stdout
    assert proc.stdout.count("test accuracy") == 2, proc.stdout  # both epochs trained


@pytest.mark.parametrize("nproc, flags", [(2, []), (3, ["--batch-size", "96",
                                                        "--accumulation", "2"])])
def test_check_passes_for_the_template(folder, nproc, flags):
    proc = launch(torchrun_cmd(nproc, TEMPLATE, "--check", *flags), cwd=folder)
    assert "check step 1, gradients: off by" in proc.stdout, proc.stdout
    assert f"diagnosis: DDP on {nproc} ranks computes what one process computes" in proc.stdout


@pytest.mark.parametrize("script, flags, diagnosis", [
    ("plain_bn.py", [], "BatchNorm"),
    ("no_sampler.py", [], "the ranks trained the same samples: use a DistributedSampler"),
    # (--max-norm 0.1: clipping bites at the first step; at 1.0 it does not, and --check passes)
    ("clip_in_loop.py", ["--accumulation", "2", "--max-norm", "0.1"],
     "gradients not as in one process at step 1")])
def test_check_names_a_planted_mistake(folder, script, flags, diagnosis):
    proc = launch(torchrun_cmd(2, script, "--check", *flags), cwd=folder, check=False)
    assert proc.returncode != 0, proc.stdout
    last = [line for line in proc.stdout.splitlines() if line.startswith("diagnosis:")]
    assert len(last) == 1 and diagnosis in last[0], proc.stdout


def test_max_restarts_without_a_fresh_store_is_one_line(folder):
    """A restarted group meeting at the dead group's store cannot connect: refused at once."""
    proc = launch(torchrun_cmd(2, TEMPLATE, extra=("--max-restarts", "1")), cwd=folder,
                  check=False)
    assert proc.returncode != 0 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in proc.stderr


def test_bad_flags_are_one_line_before_any_work(folder):
    proc = launch(torchrun_cmd(2, TEMPLATE, "--batch-size", "63"), cwd=folder, check=False)
    assert proc.returncode != 0
    assert "error: --batch-size 63 does not divide into 2 rank(s)" in proc.stderr, proc.stderr
    assert f'{TEMPLATE}", line' not in proc.stderr, proc.stderr  # no traceback through it


MID_EPOCH = re.compile(r"resumed at step [1-9]\d* of epoch 1")
PORT = REPO / "examples" / "char_transformer.py"
PORT_RUN = ["--chars", "20000", "--epochs", "1", "--checkpoint-every", "5"]


@pytest.mark.parametrize("nproc", [2, 3])
def test_the_transformer_port_passes_check(nproc, tmp_path):
    """AdamW, clipping and accumulation (2 micro-batches) on 2 and 3 ranks: within the
    control's rounding at the first step and after 3 steps."""
    proc = launch(torchrun_cmd(nproc, PORT, "--check", "--batch-size", 16 * nproc),
                  cwd=tmp_path)
    assert f"diagnosis: DDP on {nproc} ranks computes what one process computes" in proc.stdout


@PORT_TAKEN_RERUNS
def test_the_transformer_port_resumes_to_the_same_weights_after_kill_9(tmp_path):
    launch(torchrun_cmd(2, PORT, *PORT_RUN, "--out-dir", tmp_path / "whole"), cwd=tmp_path)
    out = tmp_path / "killed"
    code, output = start_and_signal(tmp_path, out, signal.SIGKILL, worker=True,
                                    torchrun_extra=("--max-restarts", "1"), script=PORT,
                                    args=PORT_RUN,
                                    env=base_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1))
    assert code == 0 and MID_EPOCH.search(output), output  # (not after the epoch's end)
    assert_same_weights(weights(out, epochs=1), weights(tmp_path / "whole", epochs=1))


RESNET = REPO / "examples" / "resnet18_digits.py"
# 8 steps of 32 digits at 3x32x32: a checkpoint every 2, so a kill lands mid-epoch
RESNET_RUN = ["--train-samples", "256", "--test-samples", "64", "--batch-size", "32",
              "--epochs", "1", "--checkpoint-every", "2"]


@pytest.mark.parametrize("nproc", [2, 3])
def test_the_resnet18_port_passes_check_with_synchronised_batchnorm(nproc, tmp_path):
    """--bn sync (the default): on the CPU every BatchNorm is step 11's AllReducedBatchNorm;
    outputs, gradients, running statistics and weights are one process's within rounding."""
    proc = launch(torchrun_cmd(nproc, RESNET, "--check", *RESNET_RUN[:4], "--batch-size",
                               16 * nproc), cwd=tmp_path)
    assert "check step 1, buffers: off by" in proc.stdout, proc.stdout  # BatchNorm's, compared
    assert f"diagnosis: DDP on {nproc} ranks computes what one process computes" in proc.stdout


def test_the_resnet18_port_with_plain_batchnorm_fails_check(tmp_path):
    proc = launch(torchrun_cmd(2, RESNET, "--check", "--bn", "plain", *RESNET_RUN[:6]),
                  cwd=tmp_path, check=False)
    assert proc.returncode != 0, proc.stdout
    last = [line for line in proc.stdout.splitlines() if line.startswith("diagnosis:")]
    assert len(last) == 1 and "BatchNorm" in last[0], proc.stdout


@PORT_TAKEN_RERUNS
def test_the_resnet18_port_resumes_to_the_same_weights_after_kill_9(tmp_path):
    launch(torchrun_cmd(2, RESNET, *RESNET_RUN, "--out-dir", tmp_path / "whole"), cwd=tmp_path)
    out = tmp_path / "killed"
    code, output = start_and_signal(tmp_path, out, signal.SIGKILL, worker=True,
                                    torchrun_extra=("--max-restarts", "1"), script=RESNET,
                                    args=RESNET_RUN,
                                    env=base_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1))
    assert code == 0 and MID_EPOCH.search(output), output  # (not after the epoch's end)
    assert_same_weights(weights(out, epochs=1), weights(tmp_path / "whole", epochs=1))


def resnet18_port():
    """examples/resnet18_digits.py as a module (its main() does not run)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("resnet18_digits", RESNET)
    port = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(port)
    return port


def test_the_resnet18_port_with_plain_batchnorm_prints_the_saved_models_test_loss(tmp_path):
    """--bn plain: each rank's running statistics follow its own samples, and a rank that
    evaluated with its own would print a mix of models. The template broadcasts rank 0's before
    evaluating: the printed test loss is what the saved model scores, in one process."""
    import argparse
    import torch.nn.functional as F

    out = tmp_path / "plain"
    proc = launch(torchrun_cmd(2, RESNET, *RESNET_RUN, "--bn", "plain", "--out-dir", out),
                  cwd=tmp_path)
    printed = float(re.search(r"test loss (\d+\.\d+)", proc.stdout).group(1))
    port = resnet18_port()
    args = argparse.Namespace(train_samples=256, test_samples=64, bn="plain")
    images, labels = port.build_datasets(args)[1].tensors
    model = port.build_model(args)
    model.load_state_dict(weights(out, epochs=1))
    with torch.no_grad():
        loss = F.cross_entropy(model.eval()(images), labels).item()
    assert abs(loss - printed) <= 6e-5, (loss, printed)  # (printed to 4 decimals)


def test_the_resnet18_ports_batchnorm_is_step_11s_on_the_cpu(monkeypatch):
    """--bn sync on the CPU: every BatchNorm of resnet18 (20) becomes step 11's
    AllReducedBatchNorm (test_your_model.py proves its numbers), with resnet18's state dict."""
    import argparse

    import torchvision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU machine
    model = resnet18_port().build_model(argparse.Namespace(bn="sync"))
    kinds = [type(m).__name__ for m in model.modules() if "BatchNorm" in type(m).__name__]
    assert kinds == ["AllReducedBatchNorm"] * 20, kinds
    plain = torchvision.models.resnet18(num_classes=10)
    assert model.state_dict().keys() == plain.state_dict().keys()
