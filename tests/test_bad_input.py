"""Issue 16: bad input gets one clear line on stderr (rank 0 only) and a non-zero exit, with
nothing half-written; a stalled peer fails the run within --timeout instead of hanging.

These checks live in common.py, so every training step has them; each case runs the step a
user would most likely run it with, as plain python where the case allows (cheaper).
"""

import pytest
import torch

from conftest import assert_no_traceback, run_step

TINY = ["--data", "synthetic", "--train-samples", 96, "--test-samples", 50, "--batch-size", 48,
        "--epochs", 1]


def expect_one_error_line(proc, *fragments):
    assert proc.returncode != 0
    assert_no_traceback(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr  # one line, not one per rank
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("good")
    run_step("00_single_gpu.py", [*TINY, "--out-dir", out])
    return out / "checkpoint.pt"


def test_unknown_flag(tmp_path):
    proc = run_step("03_ddp_wrapper.py", ["--epochz", 3], check=False)
    assert proc.returncode == 2
    expect_one_error_line(proc, "unrecognized arguments: --epochz")


def test_cuda_asked_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_step("00_single_gpu.py", [*TINY, "--device", "cuda", "--out-dir", tmp_path],
                    check=False)
    expect_one_error_line(proc, "--device cuda", "no CUDA GPU")


def test_unwritable_out_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = run_step("00_single_gpu.py", [*TINY, "--out-dir", blocker / "run"], check=False)
    expect_one_error_line(proc, "--out-dir", str(blocker / "run"))


def test_corrupt_mnist_files(mnist_root, tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for source in (mnist_root / "MNIST" / "raw").iterdir():
        data = source.read_bytes()
        (raw / source.name).write_bytes(data[: len(data) // 2])  # truncated copies
    proc = run_step("00_single_gpu.py", ["--data", "mnist", "--data-dir", tmp_path,
                                         "--out-dir", tmp_path / "out"], check=False)
    expect_one_error_line(proc, "could not read MNIST")
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_checkpoint_is_refused_and_left_alone(good_checkpoint, tmp_path, damage):
    data = good_checkpoint.read_bytes()
    bad = tmp_path / "checkpoint.pt"
    bad.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a checkpoint" * 64)
    before = bad.read_bytes()
    proc = run_step("00_single_gpu.py", [*TINY, "--resume", bad, "--out-dir", tmp_path],
                    check=False)
    expect_one_error_line(proc, "corrupt or not a checkpoint")
    assert bad.read_bytes() == before  # nothing overwritten
    assert not (tmp_path / "summary.json").exists()


def test_checkpoint_of_a_different_model(tmp_path):
    other = {"model": {"fc.weight": torch.zeros(3, 3)}, "optimizer": {}, "scheduler": {},
             "epoch": 1, "rng": []}
    torch.save(other, tmp_path / "other.pt")
    proc = run_step("00_single_gpu.py", [*TINY, "--resume", tmp_path / "other.pt",
                                         "--out-dir", tmp_path], check=False)
    expect_one_error_line(proc, "does not fit this model")


def test_batch_not_divisible_by_world_size_prints_once(tmp_path):
    proc = run_step("03_ddp_wrapper.py", [*TINY[:-4], "--batch-size", 47, "--epochs", 1,
                                          "--out-dir", tmp_path], nproc=2, check=False)
    expect_one_error_line(proc, "47", "2")


def test_a_stalled_peer_fails_the_run_within_the_timeout(tmp_path):
    """Rank 1 stops after one step; rank 0 must give up after --timeout (5 s), not hang."""
    # Without the timeout this would hang for the hour rank 1 sleeps; the launch gives up
    # (and fails the test) after 240 s, a guard against hangs, not a speed bound.
    proc = run_step("03_ddp_wrapper.py", [*TINY, "--timeout", 5, "--out-dir", tmp_path],
                    nproc=2, probe_dir=tmp_path / "probe", env_extra={"PROBE_STALL": 1},
                    check=False, timeout=240)
    assert proc.returncode != 0, proc.stdout[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: rank 0:")]
    assert errors and "timed out" in errors[0] and "stalled" in errors[0], proc.stderr[-3000:]
