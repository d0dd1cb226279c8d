"""The GPU side, ready for the first machine with a GPU: collected everywhere, skipped without CUDA.

    python -m pytest tests/test_gpu.py -v -s      # -s shows the measured numbers

The rest of the suite proves the tutorial's claims on the CPU (gloo). These tests run the same
steps on CUDA with NCCL, one process per GPU (two where two GPUs are visible): every step trains
and learns; 03 on 2 GPUs equals one GPU within the CPU's tolerance; a 07 run killed and resumed
with --deterministic ends bit-identical; 08 trains in bf16 and resumes; compiled against eager
speed is measured and printed, not asserted (a timed test proves nothing on a shared machine).
"""

from __future__ import annotations

import pytest
import torch

from conftest import (RESTART_ARGS, assert_no_traceback, max_difference, rank_params,
                      read_summary, run_step)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
RANKS = min(2, GPUS)  # processes for the distributed steps: one per GPU
SMALL = ["--device", "cuda", "--data", "mnist", "--train-samples", 960, "--batch-size", 48,
         "--epochs", 1, "--quiet"]
ORDER = 5e-5  # N ranks vs one process: the summation order (tests/test_ddp.py says why)
NOT_DETERMINISTIC = "does not have a deterministic implementation"  # torch's warning


def train(script: str, args: list, out, nproc: int | None = RANKS, **kwargs):
    proc = run_step(script, [*SMALL, *args, "--out-dir", out], nproc=nproc, **kwargs)
    assert_no_traceback(proc)
    return proc, read_summary(out)


@pytest.mark.parametrize("script, nproc, extra", [
    ("00_single_gpu.py", None, []),
    ("02_manual_ddp.py", RANKS, []),
    ("02b_overlap_by_hand.py", RANKS, []),
    ("03_ddp_wrapper.py", RANKS, []),
    ("04_ddp_compile.py", RANKS, ["--compile"]),
    ("05_multinode.py", RANKS, []),
    ("06_streaming_h5.py", RANKS, []),
    ("07_fault_tolerance.py", RANKS, []),
    ("08_fsdp2.py", RANKS, []),
    ("09_distributed_checkpoint.py", RANKS, []),
])
def test_every_step_trains_on_the_gpu_and_learns(script, nproc, extra, mnist_root, tmp_path):
    if script == "06_streaming_h5.py":
        extra = [*extra, "--h5", tmp_path / "digits.h5"]  # prepared from the same samples
    proc, summary = train(script, [*extra, "--data-dir", mnist_root], tmp_path, nproc=nproc)
    assert "device=cuda:0" in proc.stdout, proc.stdout[-2000:]
    assert summary["world_size"] == (nproc or 1)
    assert summary["test_accuracy"] > 0.3, summary  # 10 % is chance


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_nccl_ranks_equal_one_gpu(mnist_root, tmp_path):
    """The CPU's proof (test_ddp.py), on NCCL: 2 GPUs at batch B equal 1 GPU at batch B."""
    args = ["--no-dropout", "--deterministic", "--data-dir", mnist_root]
    train("03_ddp_wrapper.py", args, tmp_path / "one", nproc=None, probe_dir=tmp_path / "p1")
    proc, summary = train("03_ddp_wrapper.py", args, tmp_path / "two", nproc=2,
                          probe_dir=tmp_path / "p2")
    assert summary["world_size"] == 2 and summary["backend"] == "nccl"
    assert max_difference(rank_params(tmp_path / "p1"), rank_params(tmp_path / "p2")) < ORDER
    assert NOT_DETERMINISTIC not in proc.stdout + proc.stderr


def test_deterministic_gpu_runs_repeat_and_resume_bit_for_bit(mnist_root, tmp_path):
    """07 killed after step 27 and restarted equals an uninterrupted run, to the last bit, and
    so does a second uninterrupted run: what --deterministic promises on a GPU."""
    args = [*RESTART_ARGS, "--device", "cuda", "--deterministic", "--quiet",
            "--data-dir", mnist_root]
    runs = {}
    for name, env, extra in [("first", {}, ()), ("again", {}, ()),
                             ("killed", {"PROBE_KILL": f"{RANKS - 1}:27",
                                         "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": 1},
                              ("--max-restarts", "1"))]:
        out = tmp_path / name
        proc = run_step("07_fault_tolerance.py", [*args, "--out-dir", out], nproc=RANKS,
                        probe_dir=out / "probe", env_extra=env, torchrun_extra=extra)
        assert NOT_DETERMINISTIC not in proc.stdout + proc.stderr
        assert "deterministic=on" in proc.stdout
        runs[name] = rank_params(out / "probe")
    assert max_difference(runs["first"], runs["again"]) == 0.0
    assert max_difference(runs["first"], runs["killed"]) == 0.0


@pytest.mark.parametrize("script, saved", [("08_fsdp2.py", "checkpoint.pt"),
                                           ("09_distributed_checkpoint.py", "checkpoint")])
def test_fsdp2_trains_in_bf16_and_resumes(script, saved, mnist_root, tmp_path):
    """On a GPU with native bf16, 08 and 09 with --mixed-precision compute in bf16 and reduce in
    fp32; 08 resumes from its gathered file, 09 from its DCP folder (the link to the newest)."""
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU emulates bf16: --mixed-precision is meant for native bf16")
    proc, summary = train(script, ["--mixed-precision", "--data-dir", mnist_root], tmp_path)
    assert "mixed_precision=bf16/fp32" in proc.stdout, proc.stdout[-2000:]
    assert summary["test_accuracy"] > 0.3
    proc, resumed = train(script, ["--mixed-precision", "--data-dir", mnist_root, "--epochs", 2,
                                   "--resume", tmp_path / saved], tmp_path)
    assert len(resumed["train_losses"]) == 1 and resumed["test_accuracy"] > 0.3


def test_compile_against_eager_on_the_gpu_is_measured(mnist_root, tmp_path):
    """Measured and printed (run with -s), not asserted: speed belongs to bench/, and one pair
    of runs proves nothing. Both must train; the compiled run reports its first step apart."""
    rates, printed = {}, {}
    for mode in ("--compile", "--no-compile"):
        proc, summary = train("04_ddp_compile.py", [mode, "--epochs", 2, "--train-samples",
                                                    4800, "--data-dir", mnist_root],
                              tmp_path / mode.strip("-"))
        rates[mode], printed[mode] = summary["samples_per_sec"], proc.stdout
        assert summary["test_accuracy"] > 0.3
    assert "compile=on" in printed["--compile"] and "compile=off" in printed["--no-compile"]
    assert "first step" in printed["--compile"]  # the compile's one-off cost, timed apart
    print(f"\n04 on {torch.cuda.get_device_name()} x{RANKS}: compiled "
          f"{rates['--compile']:,.0f} vs eager {rates['--no-compile']:,.0f} samples/s after "
          f"the first step")


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_sync_batchnorm_equals_the_hand_written_one(tmp_path):
    """11 --fix on 2 GPUs (NCCL) with torch's SyncBatchNorm, and with the all-reduced BatchNorm
    that 11 writes for the CPU: each equals one process over the global batch (the step checks
    it and exits 0), and the two end with the same weights and running statistics."""
    saved = {}
    for name, extra in [("torch", []), ("by_hand", ["--batchnorm-by-hand"])]:
        proc = run_step("11_your_model.py", ["--fix", "--device", "cuda", *extra,
                                             "--out-dir", tmp_path / name], nproc=2)
        assert_no_traceback(proc)
        assert "device=cuda:0 world_size=2" in proc.stdout, proc.stdout[-2000:]
        assert "all fixes hold: 2 ranks equal one process" in proc.stdout, proc.stdout[-2000:]
        saved[name] = torch.load(tmp_path / name / "your_model.pt", weights_only=True)
    assert saved["torch"].keys() == saved["by_hand"].keys()
    assert max((saved["torch"][k].double() - saved["by_hand"][k].double()).abs().max().item()
               for k in saved["torch"]) < ORDER
