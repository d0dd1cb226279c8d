"""train_template.py, copied alone into an empty folder as a user starts a project: it trains on
2 CPU ranks, ends with the uninterrupted run's weights bit for bit after a kill -9 (at an epoch's
first step, mid-epoch, at its last step) or a SIGTERM (and a requeue), and its --check passes on
2 and 3 ranks and names a planted DDP mistake. It stops on a NaN before saving, acts on SIGTERM
at 4 steps an epoch, writes no checkpoint through a planted link, and says a branch unused on
one rank in one line. The ports in examples/ pass --check (the padded-token and contrastive
ones; their naive variants fail it, named) and resume bit for bit; resnet18's plain BatchNorm
fails --check; on the CPU its every BatchNorm is its own all-reduced one."""

from __future__ import annotations

import os
import re
import signal
import time

import sys

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
    # paced: 0.1 s a micro-batch, so that a kill lands in the step after a checkpoint; and 1 s
    # before an epoch's end is saved, so that a kill sent after the checkpoint of its last step
    # but one lands before it (with both cores busy, it once came only after: 2026-11-29)
    slow = text.replace("import tempfile\n", "import tempfile\nimport time\n")
    slow = slow.replace("    inputs, targets = batch  #",
                        "    time.sleep(0.1)\n    inputs, targets = batch  #")
    slow = slow.replace("        checkpoint(epoch + 1, 0)\n",
                        "        time.sleep(1)\n        checkpoint(epoch + 1, 0)\n")
    assert plain_bn != text and no_sampler != text and clip_in_loop != text  # (still planted)
    assert slow.count("time.sleep(0.1)") == 1 and "import time\n" in slow
    assert slow.count("time.sleep(1)\n        checkpoint(epoch + 1, 0)") == 1
    (folder / "plain_bn.py").write_text(plain_bn)
    (folder / "no_sampler.py").write_text(no_sampler)
    (folder / "clip_in_loop.py").write_text(clip_in_loop)
    (folder / "slow.py").write_text(slow)
    (folder / "two_experts.py").write_text(TWO_EXPERTS)
    return folder


# A port: a second expert that only rare inputs reach. At --check's first step rank 0's 48
# samples hold none of them and rank 1's some (the template's data, seed 0).
TWO_EXPERTS = """
import torch
import torch.nn as nn
import train_template as template

class TwoExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(32, 8) for _ in range(2))

    def forward(self, x):
        rare, out = x[:, 0] > 2.4, self.experts[0](x)
        return torch.where(rare[:, None], self.experts[1](x), out) if rare.any() else out

template.build_model = lambda args: TwoExperts()
template.run()
"""


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


# 16 steps an epoch; the kill tests run slow.py, paced, so that a kill lands where it should
KILL_RUN = ["--epochs", "2", "--batch-size", "256"]


EPOCH_LINE = re.compile(r"^epoch \d+: train loss .*$", re.M)


@pytest.fixture(scope="module")
def uninterrupted_16(folder):
    out = folder / "uninterrupted_16"
    proc = launch(torchrun_cmd(2, TEMPLATE, *KILL_RUN, "--out-dir", out), cwd=folder)
    return weights(out), EPOCH_LINE.findall(proc.stdout)


@PORT_TAKEN_RERUNS
@pytest.mark.parametrize("every, resumed", [
    (100, "resumed at step 0 of epoch 2"),  # the first checkpoint: epoch 1's end; killed in
    (5, "resumed at step 5 of epoch 1"),  # epoch 2's first step (the epoch-start resume)
    (15, "resumed at step 15 of epoch 1")])  # killed in the epoch's last step
def test_kill_9_of_a_rank_resumes_to_the_same_weights(folder, uninterrupted_16, every, resumed):
    """torchrun --max-restarts 1 restarts the group after a kill -9 of one rank, right after
    the first checkpoint; the template resumes from it (sampler position; every rank's RNG
    state mid-epoch, the epoch's own seed at its start) and ends bit for bit as uninterrupted,
    and each epoch's line is the one it printed: mid-epoch, the train loss adds up from the
    sums saved with the steps done (they restarted at 0: a resumed epoch printed another)."""
    out = folder / f"killed_{every}"
    code, output = start_and_signal(folder, out, signal.SIGKILL, worker=True,
                                    torchrun_extra=("--max-restarts", "1"), script="slow.py",
                                    args=[*KILL_RUN, "--checkpoint-every", every],
                                    env=base_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1))
    assert code == 0, output
    assert resumed in output, output
    assert_same_weights(weights(out), uninterrupted_16[0])
    printed, expected = EPOCH_LINE.findall(output), uninterrupted_16[1]
    if every == 100 and "epoch 1:" not in output:  # killed while epoch 1 was evaluated, after
        expected = expected[1:]  # its checkpoint: the restart begins at epoch 2, that line is lost
    assert printed == expected, output


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



def test_a_restart_over_a_fifo_at_the_checkpoints_name_does_not_wait(folder, tmp_path):
    """A FIFO planted at <out-dir>/checkpoint.pt: a restarted run read it with torch.load and
    waited for a writer for good (its SIGTERM handler only notes the signal). Not a file, so
    not a checkpoint: the run starts afresh, and its first save replaces the FIFO."""
    out = tmp_path / "fifo"
    out.mkdir()
    os.mkfifo(out / "checkpoint.pt")
    proc = launch([sys.executable, TEMPLATE, "--epochs", 1, "--out-dir", out], cwd=folder,
                  env=base_env(TORCHELASTIC_RESTART_COUNT=1), timeout=120)
    assert "resumed" not in proc.stdout and (out / "checkpoint.pt").is_file(), proc.stdout

@pytest.mark.parametrize("nproc, flags", [
    (3, []),  # the defaults; and uneven micro-batches (50 samples a rank: 16, 17, 17)
    (2, ["--batch-size", "100", "--accumulation", "3"])])
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
    """printed once (by rank 0), though every rank checks: the default batch on 3 ranks is
    checked by test_check_passes_for_the_template; 128 does not divide."""
    proc = launch(torchrun_cmd(3, TEMPLATE, "--batch-size", "128"), cwd=folder, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("error: --batch-size 128 does not divide into 3 rank(s)") == 1, \
        proc.stderr
    assert f'{TEMPLATE}", line' not in proc.stderr, proc.stderr  # no traceback through it
    proc = launch([sys.executable, TEMPLATE, "--epochs", "0"], cwd=folder, check=False)
    assert proc.returncode == 2 and proc.stderr == (  # (argparse's usage lines before it: gone)
        f"{TEMPLATE}: error: argument --epochs: '0' is not a whole number of at least 1\n")
    proc = launch([sys.executable, TEMPLATE, "--batch-size", "5000"], cwd=folder, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == "error: --batch-size 5000 > 4096 training samples\n", proc.stdout
    examples = [("--chars", "-5", PORT, "is not a whole number"),
                ("--train-samples", "-100", RESNET, "is not a whole number"),
                # (unfold raised a traceback; a huge count asked for terabytes: a helper's audit)
                ("--chars", "10", PORT, "is fewer than 33 characters"),
                ("--test-samples", "10000000", RESNET, "is more than 100000 samples")]
    for flag, value, port, why in examples:  # the ports' own flags: checked alike, in one line
        proc = launch([sys.executable, port, flag, value], cwd=folder, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"argument {flag}: '{value}' {why}" in proc.stderr, proc.stderr


def test_a_nan_loss_stops_the_run_before_it_saves(folder, tmp_path):
    """--lr 1e6: the gradients' norm is NaN at step 3 (the loss is all-reduced, the norm is
    the averaged gradients': every rank stops alike); the step-2 checkpoint stays finite."""
    out = tmp_path / "nan"
    proc = launch(torchrun_cmd(2, TEMPLATE, "--lr", "1e6", "--checkpoint-every", "1",
                               "--out-dir", out), cwd=folder, check=False)
    assert proc.returncode != 0, proc.stdout
    assert re.search(r"^error: the (loss|gradients' norm) is (nan|inf)", proc.stdout, re.M), \
        proc.stdout
    assert "test accuracy" not in proc.stdout, proc.stdout
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert all(t.isfinite().all() for t in saved["model"].values())


@pytest.fixture(scope="module")
def four_steps_an_epoch(folder):
    """40 epochs of 4 steps (--batch-size 1024), --amp, a link planted at the checkpoint's old
    temporary name pointing outside the run; SIGTERM once the first checkpoint is written."""
    out, outside = folder / "four_steps", folder / "outside.txt"
    out.mkdir()
    outside.write_text("a file of the user's")
    (out / "checkpoint.pt.tmp").symlink_to(outside)
    code, output = start_and_signal(folder, out, signal.SIGTERM, args=[
        "--epochs", "40", "--batch-size", "1024", "--checkpoint-every", "2", "--amp"])
    return code, output, out, outside


def test_sigterm_is_acted_on_at_4_steps_an_epoch(four_steps_an_epoch):
    code, output, out, _ = four_steps_an_epoch
    assert code != 0 and re.search(r"stopping (at step \d+ of|after) epoch", output), output
    # A stop at an epoch's end prints that epoch's evaluation first (it was skipped for good).
    after = re.search(r"^stopping after epoch (\d+)", output, re.M)
    assert not after or re.search(rf"^epoch {after[1]}: train loss", output, re.M), output
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert saved["epoch"] < 40, "the run finished before the signal: nothing was proven"


def test_a_planted_link_is_not_written_through(four_steps_an_epoch):
    _, output, out, outside = four_steps_an_epoch
    assert outside.read_text() == "a file of the user's"
    assert (out / "checkpoint.pt").is_file() and not (out / "checkpoint.pt").is_symlink()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "checkpoint.pt.tmp"]


def test_amp_on_the_cpu_is_bf16(four_steps_an_epoch):
    output = four_steps_an_epoch[1]  # (the template's first line says what it runs)
    assert re.search(r"^2 rank\(s\) on cpu, .* amp bf16$", output, re.M), output


def test_a_branch_unused_on_one_rank_is_one_line_under_check(folder):
    """Without --find-unused-parameters the rank that did not use the second expert says so
    and leaves; its peer, waiting in backward, says that a rank left (no abort inside gloo, no
    hang). With it, --check passes."""
    proc = launch(torchrun_cmd(2, "two_experts.py", "--check"), cwd=folder, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert re.search(r"^diagnosis: rank 0: no gradient for experts\.1\.weight, experts\.1\.bias"
                     r" .*--find-unused-parameters$", proc.stdout, re.M), output
    assert "[rank" not in output and "Received data size" not in output, output
    proc = launch(torchrun_cmd(2, "two_experts.py", "--check", "--find-unused-parameters"),
                  cwd=folder)
    assert "diagnosis: DDP on 2 ranks computes what one process computes" in proc.stdout


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
# 4 steps of 32 images at 3x32x32: a checkpoint every 2, so a kill lands mid-epoch; --check
# takes its 3 steps from 256 samples
RESNET_RUN = ["--train-samples", "128", "--test-samples", "64", "--batch-size", "32",
              "--epochs", "1", "--checkpoint-every", "2"]
RESNET_CHECK = ["--train-samples", "256", "--test-samples", "64"]


@pytest.mark.parametrize("nproc", [2, 3])
def test_the_resnet18_port_passes_check_with_synchronised_batchnorm(nproc, tmp_path):
    """--bn sync (the default): on the CPU every BatchNorm is its AllReducedBatchNorm (step
    11's); outputs, gradients, running statistics and weights are one process's within
    rounding. On 2 ranks the port and the template are copied out alone, as a user would."""
    if nproc == 2:
        for source in (RESNET, REPO / TEMPLATE):
            (tmp_path / source.name).write_text(source.read_text())
    port = tmp_path / RESNET.name if nproc == 2 else RESNET
    proc = launch(torchrun_cmd(nproc, port, "--check", *RESNET_CHECK, "--batch-size",
                               16 * nproc), cwd=tmp_path)
    assert "check step 1, buffers: off by" in proc.stdout, proc.stdout  # BatchNorm's, compared
    assert f"diagnosis: DDP on {nproc} ranks computes what one process computes" in proc.stdout


def test_the_resnet18_port_with_plain_batchnorm_fails_check(tmp_path):
    proc = launch(torchrun_cmd(2, RESNET, "--check", "--bn", "plain", *RESNET_CHECK,
                               "--batch-size", "32"),
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
    args = argparse.Namespace(train_samples=128, test_samples=64, bn="plain")
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


PADDED = REPO / "examples" / "padded_lm.py"
CONTRASTIVE = REPO / "examples" / "contrastive.py"


@pytest.mark.parametrize("port, flags, diagnosis", [
    # a model nobody here wrote (torch's GRU) on lines padded per batch, a token loss: the
    # ranks' and micro-batches' shapes and token counts differ; no collective of its own
    (PADDED, ["--accumulation", "2"], None),
    (PADDED, ["--loss", "mean"], "SUMMED .* count \\(tokens: a mean per rank\\?\\)"),
    (CONTRASTIVE, ["--accumulation", "2"], None),  # each micro-batch gathered over the ranks
    (CONTRASTIVE, ["--gather", "plain"], r"^diagnosis: gradients not as in one process at step 1"
     r" .*: the loss agreed, its gradients not: .*a gather without gradient in it")])
def test_the_token_and_contrastive_ports_pass_check_and_their_naive_variants_fail(
        port, flags, diagnosis, tmp_path):
    proc = launch(torchrun_cmd(2, port, "--check", *flags), cwd=tmp_path, check=False)
    last = [line for line in proc.stdout.splitlines() if line.startswith("diagnosis:")]
    assert len(last) == 1, proc.stdout + proc.stderr
    if diagnosis is None:
        assert proc.returncode == 0 and "what one process computes" in last[0], proc.stdout
    else:
        # (--loss mean: the loss at step 1 may agree within rounding, as every rank's mean is
        # near ln 256 before training; the gradients then differ: either hint names the count)
        assert proc.returncode != 0 and re.search(diagnosis, last[0]), proc.stdout
