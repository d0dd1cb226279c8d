"""Issue 11: common.py, step 00 and step 01, run as real processes on the CPU."""

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import common
from harness import launcher
from conftest import (REPO, TRAIN_SAMPLES, assert_no_traceback, base_env, launch, read_summary,
                      run_step, torchrun_cmd)
from harness import flops
from harness.model import Net
from common import synthetic_digits

SMALL = ["--train-samples", 512, "--test-samples", 200, "--batch-size", 64]


# ---------------------------------------------------------------- step 00 on MNIST-format files
def test_00_trains_on_mnist_files_through_torchvision(mnist_root, tmp_path):
    out = tmp_path / "run"
    run_step("00_single_gpu.py", ["--data", "mnist", "--data-dir", mnist_root, "--epochs", 2,
                                  "--batch-size", 64, "--out-dir", out])
    summary = read_summary(out)
    for key in ["script", "world_size", "global_batch_size", "per_rank_batch_size", "epochs",
                "train_loss", "test_loss", "test_accuracy", "test_samples", "samples_per_sec"]:
        assert key in summary, key
    assert summary["world_size"] == 1 and summary["epochs"] == 2
    assert summary["test_samples"] == 299  # the whole test file, read by torchvision
    assert summary["test_accuracy"] > 0.5  # 10 classes: chance is 0.1
    assert summary["train_losses"][1] < summary["train_losses"][0]

    checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
    assert checkpoint["epoch"] == 2
    assert set(checkpoint["model"]) == set(Net().state_dict())
    # (Exact resumes come from seeding every epoch; every rank's RNG state is step 07's.)
    assert set(checkpoint) == {"model", "optimizer", "scheduler", "epoch"}
    assert list(out.glob("events.out.tfevents.*")), "no TensorBoard event file"


# ---------------------------------------------------------------- seeding and synthetic digits
@pytest.fixture(scope="module")
def synthetic_runs(tmp_path_factory):
    """Three short runs of step 00: auto falling back offline, explicit synthetic (with
    --deterministic, which on the CPU must change nothing), other seed."""
    root = tmp_path_factory.mktemp("synthetic")
    empty_data_dir = root / "no-data"
    runs = {}
    for name, args in [("auto", ["--data", "auto", "--data-dir", empty_data_dir]),
                       ("synthetic", ["--data", "synthetic", "--deterministic"]),
                       ("seed1", ["--data", "synthetic", "--seed", 1])]:
        out = root / name
        proc = run_step("00_single_gpu.py", [*args, *SMALL, "--train-samples", 1024,
                                             "--epochs", 2, "--out-dir", out])
        runs[name] = (proc, read_summary(out), torch.load(out / "checkpoint.pt",
                                                          weights_only=True)["model"])
    return runs


def test_auto_falls_back_to_synthetic_digits_with_one_warning(synthetic_runs):
    proc, _, _ = synthetic_runs["auto"]
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "synthetic" in warnings[0], proc.stdout


def test_same_seed_gives_the_same_run(synthetic_runs):
    auto_run, auto, auto_weights = synthetic_runs["auto"]
    synthetic_run, synthetic, synthetic_weights = synthetic_runs["synthetic"]
    # The start-up line says which mode runs; on the CPU both give the same bits.
    assert "deterministic=off" in auto_run.stdout and "deterministic=on" in synthetic_run.stdout
    _, other, other_weights = synthetic_runs["seed1"]
    assert auto["train_losses"] == synthetic["train_losses"]  # exactly, not approximately
    assert auto["test_loss"] == synthetic["test_loss"]
    assert all(torch.equal(auto_weights[k], synthetic_weights[k]) for k in auto_weights)
    # ...and the comparison can fail: another seed gives another run.
    assert other["train_losses"] != synthetic["train_losses"]
    assert not torch.equal(other_weights["fc2.weight"], synthetic_weights["fc2.weight"])


def test_synthetic_digits_are_learnable(synthetic_runs):
    _, summary, _ = synthetic_runs["synthetic"]
    assert summary["test_accuracy"] > 0.6, summary  # chance is 0.1


def test_synthetic_digits_are_deterministic_and_balanced():
    images, labels = synthetic_digits(2000, seed=3)
    again, again_labels = synthetic_digits(2000, seed=3)
    assert images.dtype == torch.uint8 and images.shape == (2000, 28, 28)
    assert torch.equal(images, again) and torch.equal(labels, again_labels)
    assert not torch.equal(images, synthetic_digits(2000, seed=4)[0])
    counts = torch.bincount(labels, minlength=10)
    assert counts.min() > 120, counts  # about 200 each


def test_mnist_required_but_missing_fails_clearly(tmp_path):
    proc = run_step("00_single_gpu.py", ["--data", "mnist", "--data-dir", tmp_path / "nowhere",
                                         "--out-dir", tmp_path / "out"], check=False)
    assert proc.returncode == 2
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: MNIST not found"), proc.stderr
    assert str(tmp_path / "nowhere" / "MNIST" / "raw") in errors[0]
    assert_no_traceback(proc)
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_download_lands_whole_and_writes_through_no_planted_link(mnist_root, tmp_path,
                                                                    monkeypatch, capsys):
    """torchvision's download, from a mirror on loopback that serves the test files gzipped,
    lands in --data-dir/MNIST/raw. It downloads into a folder of a new, random name (mkdtemp):
    a link planted at the old, predictable one (.download-<host>-<pid>) receives nothing.
    A mirror that fails leaves one warning line, and no folder behind."""
    import gzip
    import hashlib
    import http.server
    import os
    import socket
    import threading
    from functools import partial

    from torchvision.datasets import MNIST

    from harness import data

    served = tmp_path / "served"
    served.mkdir()
    resources = []
    for name in data.MNIST_FILES:
        packed = gzip.compress((mnist_root / "MNIST" / "raw" / name).read_bytes())
        (served / f"{name}.gz").write_bytes(packed)
        resources.append((f"{name}.gz", hashlib.md5(packed).hexdigest()))
    quiet = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": print})
    server = type("Server", (http.server.ThreadingHTTPServer,), {"handle_error": print})(
        ("127.0.0.1", 0), partial(quiet, directory=served))  # (torchvision hangs up early)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(MNIST, "mirrors", [f"http://127.0.0.1:{server.server_port}/"])
    monkeypatch.setattr(MNIST, "resources", resources)
    data_dir, outside = tmp_path / "data", tmp_path / "outside"
    data_dir.mkdir(), outside.mkdir()
    planted = data_dir / f".download-{socket.gethostname()}-{os.getpid()}"
    planted.symlink_to(outside)
    try:
        data.try_download_mnist(data_dir)
        for name in data.MNIST_FILES:
            raw = data_dir / "MNIST" / "raw" / name
            assert raw.read_bytes() == (mnist_root / "MNIST" / "raw" / name).read_bytes()
        assert sorted(p.name for p in data_dir.iterdir()) == [planted.name, "MNIST"]
        assert list(outside.iterdir()) == []

        monkeypatch.setattr(MNIST, "resources", [("missing.gz", "0" * 32)])  # 404
        data.try_download_mnist(tmp_path / "second")
    finally:
        server.shutdown(), server.server_close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: MNIST download failed: ")
    assert list((tmp_path / "second").iterdir()) == []
    assert not data._reachable(f"http://127.0.0.1:{server.server_port}/")  # (shut down)


# ---------------------------------------------------------------- batch plan
def batch_flags(batch_size=None, per_rank=None, max_device_batch=None, scaling="none",
                warmup=0, lr=0.05):
    """What flags.parser() hands plan_batches and lr_schedule."""
    return SimpleNamespace(batch_size=batch_size, batch_per_rank=per_rank, lr=lr,
                           max_device_batch=max_device_batch, lr_scaling=scaling,
                           warmup_steps=warmup)


def test_batch_plan_splits_the_global_batch():
    plan = common.plan_batches(batch_flags(256), 4)
    assert (plan.per_rank, plan.micro_batch, plan.accumulation_steps) == (64, 64, 1)
    plan = common.plan_batches(batch_flags(96, max_device_batch=20), 2)  # 48 per rank, <= 20
    assert (plan.per_rank, plan.micro_batch, plan.accumulation_steps) == (48, 16, 3)
    plan = common.plan_batches(batch_flags(14, max_device_batch=3), 2)  # 7 is prime: 7 x 1
    assert (plan.micro_batch, plan.accumulation_steps) == (1, 7)


@pytest.mark.parametrize("batch, world", [(100, 3), (2, 4)])
def test_batch_plan_rejects_a_batch_that_does_not_divide(batch, world):
    with pytest.raises(common.UserError, match="does not divide"):
        common.plan_batches(batch_flags(batch), world)


def test_batch_per_rank_makes_the_global_batch_grow_with_the_world_size():
    for world in (1, 2, 3):
        plan = common.plan_batches(batch_flags(per_rank=48, max_device_batch=20), world)
        assert (plan.global_batch, plan.per_rank, plan.lr_batch) == (48 * world, 48, 48)
        assert (plan.micro_batch, plan.accumulation_steps) == (16, 3)
    with pytest.raises(common.UserError, match=r"--batch-per-rank 64 x 4 ranks = 256 is larger "
                                               r"than the 200 training samples"):
        common.plan_batches(batch_flags(per_rank=64), 4, 200)


# ---------------------------------------------------------------- the learning rate
def step_lrs(schedule, optimizer, steps: int) -> list[float]:
    """The rate of each of `steps` optimizer steps, stepping the schedule after each."""
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return lrs


def sgd(lr=0.05):
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=lr, momentum=0.9)


def test_without_scaling_the_schedule_is_the_old_per_epoch_step_lr():
    """Without --lr-scaling, the per-step schedule gives every step of epoch e the rate that
    StepLR(step_size=1, gamma=0.7), stepped once per epoch, gave it: up to the last bit (StepLR
    multiplies by 0.7 once per epoch, the schedule computes 0.7 ** e)."""
    flags = batch_flags(256)
    plan, optimizer, old_optimizer = common.plan_batches(flags, 2), sgd(), sgd()
    schedule = common.lr_schedule(optimizer, flags, plan, steps_per_epoch=5)
    old = torch.optim.lr_scheduler.StepLR(old_optimizer, step_size=1, gamma=0.7)
    expected = []
    for _ in range(4):
        expected += [old.get_last_lr()[0]] * 5
        old_optimizer.step()  # (a scheduler steps after its optimizer)
        old.step()
    assert step_lrs(schedule, optimizer, 20) == pytest.approx(expected, rel=1e-14, abs=0)
    assert schedule.last_step_lr() == pytest.approx(0.05 * 0.7**3, rel=1e-14)


@pytest.mark.parametrize("scaling, scale", [("linear", 4.0), ("sqrt", 2.0)])
def test_scaling_multiplies_the_rate_after_a_linear_warm_up(scaling, scale):
    """4 ranks x 64: --lr (meant for 64) x4 (linear) or x2 (sqrt), reached over 8 steps from
    --lr itself; then 0.7 per epoch of 10 steps (Goyal et al.'s gradual warm-up)."""
    flags = batch_flags(per_rank=64, scaling=scaling, warmup=8)
    plan, optimizer = common.plan_batches(flags, 4), sgd()
    assert common.lr_scale(flags, plan) == scale
    lrs = step_lrs(common.lr_schedule(optimizer, flags, plan, steps_per_epoch=10), optimizer, 30)
    ramp = [0.05 * (1 + (scale - 1) * step / 8) for step in range(8)]
    expected = ramp + [0.05 * scale] * 2 + [0.05 * scale * 0.7] * 10 + [0.05 * scale * 0.49] * 10
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert lrs[0] == 0.05  # the warm-up starts from --lr itself


def test_a_resumed_schedule_continues_exactly_and_keeps_epochs_on_another_world_size():
    """A checkpoint's schedule: the same run continues bit for bit, mid-epoch too; a run with
    other steps per epoch (at an epoch's end, on another world size under --batch-per-rank)
    continues at the next epoch's rate, with its own scale."""
    flags = batch_flags(per_rank=32, scaling="linear", warmup=4)
    optimizer = sgd()
    schedule = common.lr_schedule(optimizer, flags, common.plan_batches(flags, 2), 6)
    saved = {}
    for steps in (9, 3):  # epoch 2, step 3 of 6; then the end of epoch 2
        step_lrs(schedule, optimizer, steps)
        saved[steps] = schedule.state_dict(), optimizer.state_dict()
    straight = step_lrs(schedule, optimizer, 3)
    for world, steps_per_epoch, at in [(2, 6, 9), (4, 3, 3)]:
        resumed_optimizer = sgd()
        resumed_optimizer.load_state_dict(saved[at][1])  # as checkpoint.restore: optimizer first
        resumed = common.lr_schedule(resumed_optimizer, flags,
                                     common.plan_batches(flags, world), steps_per_epoch)
        resumed.load_state_dict(saved[at][0])
        lrs = step_lrs(resumed, resumed_optimizer, 4)
        if world == 2:
            assert lrs[3:] == straight[:1] and lrs[:3] == [0.1 * 0.7] * 3  # bit for bit
        else:  # epoch 3 of 3 steps at 4 x 0.05 x 0.7**2, then epoch 4
            assert lrs == pytest.approx([0.2 * 0.49] * 3 + [0.2 * 0.343], rel=1e-12)


# ---------------------------------------------------------------- step 01: collectives
LINE = re.compile(r"rank (\d+)/(\d+) (\S+)\s+before=\[([^\]]*)\] after=\[([^\]]*)\]")


def parse_collectives(stdout: str) -> dict:
    values = {}
    for rank, world, name, before, after in LINE.findall(stdout):
        values[(int(rank), name)] = ([float(v) for v in before.split(",")],
                                     [float(v) for v in after.split(",")])
    return values


RING = re.compile(r"^ring all-reduce by hand \(reduce-scatter, then all-gather: (\d+) steps\) of "
                  r"1001 numbers on (\d+) rank\(s\): largest difference from dist\.all_reduce "
                  r"(\S+) for integers, (\S+) for random floats$", re.M)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_01_collectives_give_values_checkable_by_hand(world):
    if world == 1:  # plain python: a world of one, no launcher
        proc = run_step("01_torch_dist_allreduce.py", [])
    else:
        proc = run_step("01_torch_dist_allreduce.py", [], nproc=world)
    values = parse_collectives(proc.stdout)
    assert len(values) == 4 * world, proc.stdout
    total = world * (world + 1) / 2  # ranks hold 1, 2, ..., world
    for rank in range(world):
        mine = [rank + 1.0, 10.0 * (rank + 1)]
        assert values[(rank, "all_reduce(sum)")] == (mine, [total, 10 * total])
        assert values[(rank, "all_reduce(avg)")] == (mine, [total / world, 10 * total / world])
        assert values[(rank, "broadcast(src=0)")] == (mine, [1.0, 10.0])
        everyone = [v for r in range(world) for v in (r + 1.0, 10.0 * (r + 1))]
        assert values[(rank, "all_gather")] == (mine, everyone)
    # The ring by hand, on chunks of unequal length (no world here divides 1001): exact on
    # integers. On random floats only the order of the additions differs from gloo's: none on
    # 1 rank, and a + b == b + a on 2; on more, each order rounds each of its N - 1 additions
    # (of standard normals, |x| < 6 here: sums below 6 N) by at most half an eps of the sum.
    [(steps, ranks, integers, floats)] = RING.findall(proc.stdout)
    assert (int(steps), int(ranks), float(integers)) == (2 * (world - 1), world, 0.0)
    bound = 0.0 if world <= 2 else (world - 1) * torch.finfo(torch.float32).eps * 6 * world
    assert float(floats) <= bound, proc.stdout


BENCH_ROW = re.compile(r"^\s+(\d+)\s+(\d+) ([KM])iB\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                       r"\s+([\d.]+)(?:  (.+))?$", re.M)


def test_01_bench_sweeps_sizes_reports_bus_bandwidth_as_nccl_tests_and_marks_ddps_buckets():
    """--max-mb 25: the smallest sweep that reaches DDP's default bucket (a few seconds)."""
    proc = launch(torchrun_cmd(2, "01_torch_dist_allreduce.py", "--bench", "--max-mb", 25))
    rows = BENCH_ROW.findall(proc.stdout)
    sizes = [int(row[0]) for row in rows]
    assert sizes == [4096 * 2**k for k in range(13)] + [25 * 2**20], proc.stdout  # 4 KiB..16 MiB
    marked = {int(row[0]): row[8] for row in rows if row[8]}
    assert marked == {2**20: "<- DDP's first bucket",
                      25 * 2**20: "<- DDP's other buckets (default)"}, proc.stdout
    for size, number, unit, micros, algbw, busbw, ring_micros, ring_busbw, _ in rows:
        assert int(number) * {"K": 2**10, "M": 2**20}[unit] == int(size)
        assert float(micros) > 0 and float(ring_micros) > 0
        assert float(algbw) == pytest.approx(int(size) / (float(micros) * 1e-6) / 1e9, rel=0.02,
                                             abs=2e-3)
        assert float(busbw) == pytest.approx(float(algbw) * 2 * (2 - 1) / 2, abs=2e-3)
        # The ring's: the same definition, from its own time.
        assert float(ring_busbw) == pytest.approx(
            int(size) / (float(ring_micros) * 1e-6) / 1e9 * 2 * (2 - 1) / 2, rel=0.02, abs=2e-3)


def test_training_set_prefix_is_checked(mnist_root, tmp_path):
    proc = run_step("00_single_gpu.py", ["--data", "mnist", "--data-dir", mnist_root,
                                         "--train-samples", TRAIN_SAMPLES + 1,
                                         "--out-dir", tmp_path], check=False)
    assert proc.returncode == 2 and "has 1200" in proc.stderr, proc.stderr
    assert_no_traceback(proc)


def test_deterministic_mode_sets_what_gpus_need():
    """--deterministic's settings, in a fresh interpreter (they are process-wide)."""
    code = ("import os, torch, common; common.set_deterministic(False); "
            "before = (torch.are_deterministic_algorithms_enabled(), "
            "'CUBLAS_WORKSPACE_CONFIG' in os.environ); common.set_deterministic(True); "
            "print(before, torch.are_deterministic_algorithms_enabled(), "
            "torch.is_deterministic_algorithms_warn_only_enabled(), "
            "torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, "
            "os.environ['CUBLAS_WORKSPACE_CONFIG'])")
    env = {k: v for k, v in base_env().items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True).stdout.split(") ")
    assert out[0] == "(False, False"  # off: nothing changed
    assert out[1].split() == ["True", "True", "False", "True", ":4096:8"]


def test_every_process_the_suite_starts_computes_on_the_cpu(monkeypatch, tmp_path):
    """On a machine with GPUs the CPU suite stays on the CPU: a process it starts, and a job of
    the emulated SLURM cluster, sees no GPU even when the parent was given one (here the
    parent's variable names GPU 0, as on a GPU workstation)."""
    from slurm_cluster import SlurmCluster

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    code = ("import os, torch, common; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), "
            "torch.cuda.is_available(), common.choose_device('auto'))")
    assert launch([sys.executable, "-c", code]).stdout.split() == ["''", "False", "cpu"]
    assert SlurmCluster(tmp_path).env()["CUDA_VISIBLE_DEVICES"] == ""
    assert base_env(gpus=True)["CUDA_VISIBLE_DEVICES"] == "0"  # test_gpu.py opts in


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compile_without_a_compiler_or_python_h_is_one_line(device, monkeypatch, tmp_path):
    """torch.compile builds native code on the node: C++ by inductor on the CPU, Triton's C
    launchers on a GPU, both against Python.h. What is missing is found before training: an
    explicit --compile stops with one line; the GPU default trains eagerly with one note."""
    run = common.Run(torch.device(device))
    assert launcher.missing_compile_tools(run.device) is None  # this machine has both
    assert launcher.compile_choice(SimpleNamespace(compile=True), run) is True
    assert launcher.compile_choice(SimpleNamespace(compile=None), run) is (device == "cuda")
    monkeypatch.setenv("CXX", str(tmp_path / "no-g++"))
    monkeypatch.setenv("CC", str(tmp_path / "no-gcc"))
    assert "compiler" in launcher.missing_compile_tools(run.device)
    with pytest.raises(common.UserError, match=r"^--compile needs a C\+* compiler"):
        launcher.compile_choice(SimpleNamespace(compile=True), run)
    assert launcher.compile_choice(SimpleNamespace(compile=None), run) is False
    assert launcher.compile_choice(SimpleNamespace(compile=False), run) is False
    monkeypatch.delenv("CXX")
    monkeypatch.delenv("CC")
    monkeypatch.setattr(launcher.sysconfig, "get_path", lambda *a, **k: str(tmp_path))
    monkeypatch.setattr(launcher.sysconfig, "get_paths", lambda *a, **k: {"include": str(tmp_path)})
    assert "Python.h" in launcher.missing_compile_tools(run.device)


def test_04_compiling_without_a_compiler_stops_with_one_line(tmp_path):
    proc = run_step("04_ddp_compile.py", ["--compile", "--data", "synthetic", *SMALL,
                                          "--out-dir", tmp_path],
                    env_extra={"CXX": tmp_path / "no-g++"}, check=False)
    assert proc.returncode != 0 and "--compile needs a C++ compiler" in proc.stderr, proc.stderr
    assert_no_traceback(proc)


def test_amp_without_native_bf16_says_so_at_start_up(capsys):
    """--amp where bf16 is not native (a CPU here; a V100 or T4 the same way) trains in float32
    and says so, naming the device, before the start-up line."""
    run = common.Run(torch.device("cpu"), amp=True)
    args = SimpleNamespace(amp=True, lr_scaling="none", seed=0, deterministic=False)
    common.announce(run, args, common.BatchPlan(64, 64, 64, 1, 64), "00_single_gpu.py")
    note, start_up = capsys.readouterr().out.splitlines()
    assert note.startswith("note: --amp computes in bf16, which a CPU has no native support")
    assert "training in float32, amp=False" in note and " amp=False " in start_up


# ---------------------------------------------------------------- FLOPs and MFU
def test_training_flops_are_counted_layer_by_layer():
    """FlopCounterMode's count equals the count by hand: 2 FLOPs (multiply, add) per weight use
    in forward; backward computes the gradients of the weights and of each layer's input (not
    of the images), each as costly as forward."""
    conv1 = 2 * 26 * 26 * 32 * 1 * 9  # output positions x channels x inputs per output
    conv2 = 2 * 24 * 24 * 64 * 32 * 9
    fc1, fc2 = 2 * 9216 * 128, 2 * 128 * 10
    forward = conv1 + conv2 + fc1 + fc2
    backward = conv1 + 2 * (conv2 + fc1 + fc2)  # conv1: weights only
    assert flops.training_flops_per_sample(SimpleNamespace(width=1)) == forward + backward
    assert forward + backward == 71_565_312  # 10x the 6 x 1.2 M parameters of the rule of thumb
    assert flops.training_flops_per_sample(SimpleNamespace(width=2)) > forward + backward


@pytest.mark.parametrize("name, peaks", [
    ("NVIDIA H100 80GB HBM3", (989e12, 494e12)), ("NVIDIA H100 PCIe", (756e12, 378e12)),
    ("NVIDIA H100 NVL", (835e12, 418e12)), ("NVIDIA H200", (989e12, 494e12)),
    ("NVIDIA A100-SXM4-80GB", (312e12, 156e12)), ("NVIDIA A100 80GB PCIe", (312e12, 156e12)),
    ("NVIDIA L4", (121e12, 60e12)), ("NVIDIA L40", (181e12, 90.5e12)),
    ("NVIDIA L40S", (362e12, 183e12)), ("NVIDIA A10", (125e12, 62.5e12)), ("NVIDIA A10G", None),
    ("Tesla V100-SXM2-32GB", (15.7e12, 15.7e12)), ("Tesla V100-PCIE-16GB", (14e12, 14e12)),
    ("Tesla T4", (8.1e12, 8.1e12)), ("NVIDIA GH200 480GB", None), ("NVIDIA RTX A6000", None),
])
def test_gpu_peaks_match_the_model_exactly(name, peaks):
    """L4 is not an L40, A10 not an A10G, H100 SXM not an H100 NVL: a substring match got these
    wrong, and MFU with them. An unlisted GPU gets no peak rather than a neighbour's."""
    assert flops.gpu_peaks(name) == peaks


def test_every_run_reports_flops_and_mfu(synthetic_runs):
    proc, summary, _ = synthetic_runs["synthetic"]
    assert summary["flops_per_sample"] == 71_565_312
    assert re.search(r"epoch 2: .* [\d,]+ samples/s \([\d.]+ [GMT]FLOP/s per rank\)$", proc.stdout,
                     re.M), proc.stdout
    assert summary["flops_per_sec_per_rank"] == pytest.approx(
        summary["samples_per_sec"] * summary["flops_per_sample"])
    assert summary["peak_source"].startswith("CPU: a float32 matmul measured here")
    assert 0 < summary["mfu"] < 1  # a CPU peak measured on the same cores bounds the run
