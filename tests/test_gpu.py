"""The GPU side, ready for the first machine with a GPU: collected everywhere, skipped without CUDA.

    python -m pytest tests/test_gpu.py -v -s      # -s shows the measured numbers

Run it on a machine with 2 GPUs to prove everything (one GPU skips the 2-GPU tests). The CPU
suite pins every process it starts to the CPU (conftest.HIDE_GPUS); these tests opt in
(gpus=True).

The rest of the suite proves the tutorial's claims on the CPU (gloo). These tests run the same
steps on CUDA with NCCL, one process per GPU (two where two GPUs are visible): every step trains
and learns; 03 on 2 GPUs equals one GPU within the CPU's tolerance; a 07 run killed and resumed
with --deterministic ends bit-identical; 08 trains in bf16 and resumes; compiled against eager
speed is measured and printed, not asserted (a timed test proves nothing on a shared machine).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import torch

from conftest import (REPO, RESTART_ARGS, TEST_SAMPLES, TRAIN_SAMPLES, assert_no_traceback,
                      base_env, launch, max_difference, rank_params, read_summary, run_step,
                      torchrun_cmd)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
RANKS = min(2, GPUS)  # processes for the distributed steps: one per GPU
SMALL = ["--device", "cuda", "--data", "mnist", "--train-samples", 960, "--batch-size", 48,
         "--epochs", 1, "--quiet"]
ORDER = 5e-5  # N ranks vs one process: the summation order (tests/test_ddp.py says why)
EQUAL_RUNS = ["--no-dropout", "--deterministic"]  # weight-for-weight comparisons
# ...in full float32 where the runs split the work differently (1 GPU against 2, micro-batches
# against one batch): on a GPU the steps use TF32 (common.choose_device), whose 10-bit mantissa
# turns the sums' other order (1e-7) into other weights. Measured on one H100, torch 2.11, 20
# steps of 03: micro-batches against one batch 0.056 apart with TF32, under ORDER without.
# NVIDIA's cuBLAS and cuDNN read NVIDIA_TF32_OVERRIDE=0 and then use no TF32, whatever torch asks.
FULL_FLOAT32 = {"NVIDIA_TF32_OVERRIDE": "0"}
NOT_DETERMINISTIC = "does not have a deterministic implementation"  # torch's warning


def train(script: str, args: list, out, nproc: int | None = RANKS, **kwargs):
    proc = run_step(script, [*SMALL, *args, "--out-dir", out], nproc=nproc, gpus=True, **kwargs)
    assert_no_traceback(proc)
    return proc, read_summary(out)


@pytest.mark.parametrize("script, nproc, extra", [
    ("00_single_gpu.py", None, []),
    ("02_manual_ddp.py", RANKS, []),
    ("02b_overlap_by_hand.py", RANKS, []),
    ("03_ddp_wrapper.py", RANKS, []),
    ("03b_sharded_optimizer.py", RANKS, ["--zero-stage", "2"]),
    ("04_ddp_compile.py", RANKS, ["--compile"]),
    ("05_multinode.py", RANKS, []),
    ("06_streaming_h5.py", RANKS, []),
    ("07a_exact_resume.py", RANKS, []),
    ("07b_restarts.py", RANKS, []),
    ("07_fault_tolerance.py", RANKS, []),
    ("08a_meta_device.py", RANKS, []),
    ("08b_fsdp2_shard.py", RANKS, []),
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
    args = [*EQUAL_RUNS, "--data-dir", mnist_root]
    train("03_ddp_wrapper.py", args, tmp_path / "one", nproc=None, probe_dir=tmp_path / "p1",
          env_extra=FULL_FLOAT32)
    proc, summary = train("03_ddp_wrapper.py", args, tmp_path / "two", nproc=2,
                          probe_dir=tmp_path / "p2", env_extra=FULL_FLOAT32)
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
                        probe_dir=out / "probe", env_extra=env, torchrun_extra=extra,
                        gpus=True)
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
                                                    TRAIN_SAMPLES, "--data-dir", mnist_root],
                              tmp_path / mode.strip("-"))
        rates[mode], printed[mode] = summary["samples_per_sec"], proc.stdout
        assert summary["test_accuracy"] > 0.3
    assert "compile=on" in printed["--compile"] and "compile=off" in printed["--no-compile"]
    assert "first step" in printed["--compile"]  # the compile's one-off cost, timed apart
    print(f"\n04 on {torch.cuda.get_device_name()} x{RANKS}: compiled "
          f"{rates['--compile']:,.0f} vs eager {rates['--no-compile']:,.0f} samples/s after "
          f"the first step")


# ==================================================================== issue 37: the first GPU run
# What the CPU suite cannot prove (issue 37, section 4), each read against torch 2.15's source
# first (see the docs each test names). The key NCCL checks run on both NCCL backends of torch
# 2.15: "nccl" is ProcessGroupNCCL2 (the torchcomms engine) unless TORCH_DIST_USE_NCCL2=0 selects
# the legacy ProcessGroupNCCL (distributed_c10d.py, _register_builtin_nccl_backend).
NCCL_BACKENDS = [pytest.param({}, id="nccl2"),
                 pytest.param({"TORCH_DIST_USE_NCCL2": "0"}, id="legacy-nccl")]
TWO_GPUS = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")


@TWO_GPUS
@pytest.mark.parametrize("backend_env", NCCL_BACKENDS)
def test_manual_ddp_equals_the_wrapper_on_nccl(backend_env, mnist_root, tmp_path):
    """test_ddp.py's 02 = 03 on 2 GPUs: the all-reduce by hand and DDP's buckets average the
    same gradients (2 ranks: a + b is exact in any order, and halving is exact)."""
    params = {}
    for script in ("02_manual_ddp.py", "03_ddp_wrapper.py"):
        proc, summary = train(script, [*EQUAL_RUNS, "--data-dir", mnist_root], tmp_path / script,
                              nproc=2, probe_dir=tmp_path / f"probe{script[:2]}",
                              env_extra=backend_env)
        assert summary["backend"] == "nccl" and summary["world_size"] == 2
        params[script] = rank_params(tmp_path / f"probe{script[:2]}")
    difference = max_difference(params["02_manual_ddp.py"], params["03_ddp_wrapper.py"])
    print(f"\n02 vs 03 on NCCL ({backend_env or 'nccl2'}): max difference {difference:.3g}")
    assert difference < ORDER


@TWO_GPUS
def test_zero_by_hand_equals_the_wrapper_on_nccl(mnist_root, tmp_path):
    """test_sharded_optimizer.py's 03b = 03 on 2 GPUs: NCCL's reduce-scatter and all-gather, by
    hand (both stages) and torch's ZeroRedundancyOptimizer, against DDP's all-reduce."""
    params = {}
    for name, script, extra in [
            ("03", "03_ddp_wrapper.py", []), ("zero1", "03b_sharded_optimizer.py", []),
            ("zero2", "03b_sharded_optimizer.py", ["--zero-stage", "2"]),
            ("torch", "03b_sharded_optimizer.py", ["--zero", "torch"])]:
        proc, summary = train(script, [*EQUAL_RUNS, *extra, "--data-dir", mnist_root],
                              tmp_path / name, nproc=2)
        assert summary["world_size"] == 2 and "device=cuda:0" in proc.stdout
        # (the weights it saved: by hand, the optimizer steps slices, not the parameters)
        saved = torch.load(tmp_path / name / "checkpoint.pt", map_location="cpu",
                           weights_only=True)
        params[name] = list(saved["model"].values())
    for name in ("zero1", "zero2", "torch"):
        difference = max_difference(params["03"], params[name])
        print(f"\n03b {name} vs 03 on NCCL: max difference {difference:.3g}")
        assert difference < ORDER, name


def test_amp_trains_in_bf16_or_says_why_not(mnist_root, tmp_path):
    """--amp: bf16 autocast where the GPU computes bf16 natively; on a V100 or T4 one note
    naming the GPU, and float32 (common.announce)."""
    proc, summary = train("03_ddp_wrapper.py", ["--amp", "--data-dir", mnist_root], tmp_path)
    if torch.cuda.is_bf16_supported(including_emulation=False):
        assert " amp=True " in proc.stdout, proc.stdout[-2000:]
    else:
        assert "note: --amp computes in bf16, which" in proc.stdout and " amp=False " in proc.stdout
    assert summary["test_accuracy"] > 0.3


def test_01_bench_reports_nccl_bus_bandwidth():
    """01 --bench on the GPUs: the rows test_foundation.py checks on gloo, with busbw =
    algbw x 2(n-1)/n as nccl-tests define it; the 25 MiB row is printed (run with -s)."""
    from test_foundation import BENCH_ROW

    proc = launch(torchrun_cmd(RANKS, "01_torch_dist_allreduce.py", "--bench", "--max-mb", 25),
                  env=base_env(gpus=True))
    rows = BENCH_ROW.findall(proc.stdout)
    assert [int(row[0]) for row in rows] == [4096 * 2**k for k in range(13)] + [25 * 2**20]
    assert "backend nccl" in proc.stdout, proc.stdout[-2000:]
    for size, _, _, micros, algbw, busbw, _, _, _ in rows:
        assert float(micros) > 0
        assert float(busbw) == pytest.approx(float(algbw) * 2 * (RANKS - 1) / RANKS, abs=2e-3)
    print(f"\n01 --bench on {RANKS} x {torch.cuda.get_device_name()}: 25 MiB all-reduce "
          f"busbw {rows[-1][5]} GB/s")


def test_profile_breaks_gpu_steps_down_on_the_device_timeline(mnist_root, tmp_path):
    """--profile on GPUs: every rank's breakdown is read on the device timeline, each kernel in
    the step that launched it (profiling._gpu_breakdown: the trace's correlation ids), its parts
    add up to the step, and on 2 GPUs the NCCL kernels are found."""
    proc, _ = train("03_ddp_wrapper.py", ["--profile", "--data-dir", mnist_root], tmp_path)
    assert "profile: ms per step" in proc.stdout, proc.stdout[-2000:]
    for rank in range(RANKS):
        row = json.loads((tmp_path / "profile" / f"summary_rank{rank}.json").read_text())
        assert row["timeline"] == "gpu" and row["steps"] == 3, row
        parts = [row[key] for key in ("compute_ms", "exposed_comm_ms", "data_ms", "other_ms")]
        assert sum(parts) == pytest.approx(row["step_ms"]) and min(parts) > -1e-6, row
        assert row["compute_ms"] > 0
        if RANKS == 2:
            assert row["comm_ms"] > 0, row  # NCCL's kernels, attributed to their steps
    print("\n" + proc.stdout[proc.stdout.index("profile: ms per step"):])


def test_07_stopped_by_sigterm_resumes_exactly_with_deterministic(mnist_root, tmp_path):
    """SLURM's preemption on GPUs: rank 0 gets a real SIGTERM after step 7, every rank saves at
    the agreed step and stops; the requeued run ends bit-identical to an uninterrupted one."""
    args = [*RESTART_ARGS, "--device", "cuda", "--deterministic", "--quiet",
            "--data-dir", mnist_root]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_step("07_fault_tolerance.py", [*args, "--out-dir", straight], nproc=RANKS,
             probe_dir=straight / "probe", gpus=True)
    proc = run_step("07_fault_tolerance.py", [*args, "--out-dir", stopped], nproc=RANKS,
                    probe_dir=stopped / "probe0", env_extra={"PROBE_SIGNAL": "0:7:SIGTERM"},
                    check=False, gpus=True)
    assert "(SIGTERM): checkpoint saved" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert not (stopped / "summary.json").exists()
    requeued = run_step("07_fault_tolerance.py", [*args, "--out-dir", stopped], nproc=RANKS,
                        probe_dir=stopped / "probe", env_extra={"SLURM_RESTART_COUNT": 1},
                        gpus=True)
    assert "resumed at step" in requeued.stdout, requeued.stdout[-2000:]
    assert max_difference(rank_params(straight / "probe"), rank_params(stopped / "probe")) == 0.0


def test_micro_batches_equal_one_batch_on_the_gpu(mnist_root, tmp_path):
    """--max-device-batch 8 (3 micro-batches of 8 per rank, gradients accumulated, one
    all-reduce) trains what one batch of 24 per rank trains, within the order of the sums."""
    params = []
    for name, extra in (("whole", []), ("micro", ["--max-device-batch", 8])):
        proc, _ = train("03_ddp_wrapper.py", [*EQUAL_RUNS, *extra, "--data-dir", mnist_root],
                        tmp_path / name, probe_dir=tmp_path / f"probe-{name}",
                        env_extra=FULL_FLOAT32)
        params.append(rank_params(tmp_path / f"probe-{name}"))
    assert "3 micro-batch(es) of 8" in proc.stdout or RANKS == 1, proc.stdout[-2000:]
    assert max_difference(*params) < ORDER


def test_the_tour_runs_on_the_gpus(mnist_root, tmp_path):
    """tour.py on GPUs: every step on cuda, one process per GPU (at most 2), and the table's
    world sizes say so (01's too: tour.print_table); on one GPU, 11 (which compares ranks) on 2
    CPU processes (tour.placement). Measured on one H200, torch 2.11: before placement, the
    tour ended at 11's refusal of a world of one."""
    proc = launch([sys.executable, "tour.py", "--samples", "480", "--test-samples",
                   str(TEST_SAMPLES), "--data", "mnist", "--data-dir", str(mnist_root),
                   "--out-dir", str(tmp_path)], env=base_env(gpus=True), timeout=1200)
    assert "device=cuda:0" in proc.stdout
    table = proc.stdout.split("=== the tour")[1]
    print(f"=== the tour{table}")  # (-s shows it: the steps' accuracies and samples/s on this GPU)
    worlds = dict(re.findall(r"^(\d\d[a-z]?)\s+.+?\s+(\d+)\s+\S+\s+\S+   .+$", table, re.M))
    # (12 runs on 2 CPU processes wherever it runs: gloo's timeout ends its planted hang)
    assert worlds.pop("00") == "1" and worlds.pop("11") == "2" and worlds.pop("12") == "2", table
    assert set(worlds.values()) == {str(RANKS)}, table
    eleven = proc.stdout.split("\n=== 11:")[1]
    assert f"11_your_model.py: device={'cpu' if RANKS == 1 else 'cuda:0'}" in eleven, eleven


def compute_apps() -> list[tuple[str, str, int]]:
    """(GPU uuid, pid, MiB) of every process nvidia-smi sees on a GPU."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=True).stdout
    return [(uuid, pid, int(mib)) for uuid, pid, mib in
            (line.split(", ") for line in out.splitlines() if line.strip())]


def first_gpu_uuid() -> str:
    """The uuid of the GPU the ranks see as cuda:0."""
    visible = base_env(gpus=True).get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    if not visible.isdigit():
        pytest.skip(f"CUDA_VISIBLE_DEVICES names {visible}: this check maps indices only")
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return dict(line.split(", ") for line in out.splitlines())[visible]


@TWO_GPUS
@pytest.mark.parametrize("backend_env", NCCL_BACKENDS)
def test_09_background_saves_open_no_context_on_gpu_0_from_other_ranks(backend_env, mnist_root,
                                                                        tmp_path):
    """dcp.async_save's writer thread runs on CUDA's default device, GPU 0, of every rank: with
    FileSystemWriter(per_thread_copy_ahead=0), which async_save's staging sets itself
    (FileSystemWriter.stage), it makes no CUDA call there (09's comment). Watched
    with nvidia-smi while 09 saves every 2 steps: GPU 0 holds one new process, rank 0's."""
    gpu0 = first_gpu_uuid()
    before = {pid for uuid, pid, _ in compute_apps() if uuid == gpu0}
    cmd = torchrun_cmd(2, "09_distributed_checkpoint.py", *SMALL, "--epochs", 2,
                       "--train-samples", 4800, "--checkpoint-every", 2, "--data-dir",
                       mnist_root, "--out-dir", tmp_path)
    run = subprocess.Popen(cmd, cwd=REPO, env=base_env(gpus=True, **backend_env),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    on_gpu0 = {}  # pid -> most MiB seen on GPU 0
    while run.poll() is None:
        for uuid, pid, mib in compute_apps():
            if uuid == gpu0 and pid not in before:
                on_gpu0[pid] = max(mib, on_gpu0.get(pid, 0))
        time.sleep(0.5)
    output = run.communicate()[0]
    assert run.returncode == 0, output[-3000:]
    assert (tmp_path / "checkpoint").exists()  # the link to the newest complete save
    if not on_gpu0:
        pytest.skip("nvidia-smi lists no processes here (another PID namespace?)")
    # A context costs hundreds of MiB; 100 MiB leaves room for NCCL's peer mappings.
    contexts = {pid: mib for pid, mib in on_gpu0.items() if mib >= 100}
    assert len(contexts) == 1, f"processes on GPU 0 (MiB): {on_gpu0}\n{output[-2000:]}"


@TWO_GPUS
@pytest.mark.parametrize("backend_env", NCCL_BACKENDS)
def test_a_stalled_peer_under_nccl_ends_the_run_as_docs_reliability_says(backend_env,
                                                                          mnist_root, tmp_path):
    """docs/reliability.md, "A lost or stalled peer under NCCL": rank 1 stops answering after
    its first step; rank 0 blocks inside CUDA, where nothing raises, until the NCCL watchdog
    aborts it (SIGABRT, -6) after --timeout, and torchrun ends the run: no hang."""
    started = time.monotonic()
    proc = run_step("03_ddp_wrapper.py", [*SMALL, "--timeout", 20, "--data-dir", mnist_root,
                                          "--out-dir", tmp_path],
                    nproc=2, probe_dir=tmp_path / "probe", check=False, timeout=600, gpus=True,
                    env_extra={"PROBE_STALL": 1, **backend_env})
    seconds = time.monotonic() - started
    print(f"\nstalled peer, {backend_env or 'nccl2'}: the run ended after {seconds:.0f} s "
          f"(--timeout 20), exit {proc.returncode}")
    assert proc.returncode != 0
    assert "exitcode  : -6" in proc.stderr, proc.stderr[-3000:]  # the watchdog's SIGABRT
    # --timeout, the watchdog's 1 s poll, torchrun's 30 s grace for the others, start-up
    assert seconds < 20 + 120, seconds

# ---------------------------------------------------------------- step 10 under NCCL
# Each bug ends in the same diagnosis line as on gloo (tests/test_debugging.py), on both NCCL
# backends of torch 2.15: nccl2 (what `nccl` builds) and the legacy one (TORCH_DIST_USE_NCCL2=0).
NCCL_BACKENDS = [pytest.param({}, "nccl2", id="nccl2"),
                 pytest.param({"TORCH_DIST_USE_NCCL2": "0"}, "nccl", id="legacy")]
DIAGNOSES = {"skip": "rank 0 is behind (5 training steps, rank 1 took 6)",
             "uneven": "rank 1 is behind (4 training steps, rank 0 took 5)",
             "shape": "got tensors of different shapes"}


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("env, backend", NCCL_BACKENDS)
@pytest.mark.parametrize("bug", ["skip", "shape", "uneven"])
def test_debugging_diagnoses_each_bug_under_nccl(bug, env, backend, tmp_path):
    """No watchdog abort, no silent hang: the run ends non-zero within the timeout and a few
    seconds, its last line the diagnosis, and the Flight Recorder read is NCCL's (DDP's
    all-reduces, named "<backend>:all_reduce", are in it and in the files for fr_trace)."""
    import pickle  # the step's own files, written in this test

    proc = run_step("10_debugging.py", ["--bug", bug, "--device", "cuda", "--timeout", 6,
                                        "--out-dir", tmp_path], nproc=2, env_extra=env,
                    check=False, timeout=180, gpus=True)
    assert proc.returncode != 0
    assert_no_traceback(proc)
    assert f"backend={backend} " in proc.stdout, proc.stdout[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("diagnosis: ") and DIAGNOSES[bug] in last, proc.stdout[-3000:]
    assert "DDP's group #" in proc.stdout and "last collectives: none" not in proc.stdout
    for rank in (0, 1):
        record = pickle.loads((tmp_path / "flight_recorder" / f"rank{rank}").read_bytes())
        assert any(e["profiling_name"] == f"{backend}:all_reduce"
                   for e in record["entries"]), record


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("env, backend", NCCL_BACKENDS)
def test_debugging_fix_exits_0_under_nccl(env, backend, tmp_path):
    proc = run_step("10_debugging.py", ["--fix", "--device", "cuda", "--out-dir", tmp_path],
                    nproc=2, env_extra=env, timeout=180, gpus=True)
    assert_no_traceback(proc)
    assert f"backend={backend} " in proc.stdout
    assert "median test loss over 21 samples" in proc.stdout


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_sync_batchnorm_equals_the_hand_written_one(tmp_path):
    """11 --fix on 2 GPUs (NCCL) with torch's SyncBatchNorm, and with the all-reduced BatchNorm
    that 11 writes for the CPU: each equals one process over the global batch (the step checks
    it and exits 0), and the two end with the same weights and running statistics."""
    saved = {}
    for name, extra in [("torch", []), ("by_hand", ["--batchnorm-by-hand"])]:
        proc = run_step("11_your_model.py", ["--fix", "--device", "cuda", *extra,
                                             "--out-dir", tmp_path / name], nproc=2,
                        gpus=True)
        assert_no_traceback(proc)
        assert "device=cuda:0 world_size=2" in proc.stdout, proc.stdout[-2000:]
        assert "all fixes hold: 2 ranks equal one process" in proc.stdout, proc.stdout[-2000:]
        saved[name] = torch.load(tmp_path / name / "your_model.pt", weights_only=True)
    assert saved["torch"].keys() == saved["by_hand"].keys()
    assert max((saved["torch"][k].double() - saved["by_hand"][k].double()).abs().max().item()
               for k in saved["torch"]) < ORDER


# ------------------------------------------------------ issue 45: the template and a port on GPUs
TEMPLATE_RUN = ["--epochs", 2, "--checkpoint-every", 5]  # 42 steps of 96 an epoch


def template_run(out, *extra, **kwargs):
    """train_template.py under tests/rank_probe.py, on RANKS GPUs (NCCL)."""
    return run_step("train_template.py", [*TEMPLATE_RUN, *extra, "--out-dir", out],
                    nproc=RANKS, probe_dir=out / "probe", gpus=True, **kwargs)


def test_the_template_resumes_on_the_gpu_bit_for_bit_after_kill_9(tmp_path):
    """The template's promise on a GPU: rank 0 killed (kill -9) after step 7 and restarted by
    torchrun --max-restarts 1 resumes from the step-5 checkpoint (the sampler's position, and the
    CUDA generator that draws dropout's masks) and ends with the uninterrupted run's weights."""
    straight = template_run(tmp_path / "straight")
    killed = template_run(tmp_path / "killed", torchrun_extra=("--max-restarts", "1"),
                          env_extra={"PROBE_KILL": "0:7", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": 1})
    assert "resumed at step 5 of epoch 1" in killed.stdout, killed.stdout[-2000:]
    saved = torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=True)
    assert all("cuda" in state for state in saved["rng"]), "it did not run on the GPU"
    difference = max_difference(rank_params(tmp_path / "straight" / "probe"),
                                rank_params(tmp_path / "killed" / "probe"))
    print(f"\ntemplate, killed and resumed vs uninterrupted on {torch.cuda.get_device_name()}: "
          f"max difference {difference:.3g}; {straight.stdout.strip().splitlines()[-1]}")
    assert difference == 0.0


def test_the_template_trains_with_amp_and_compile_on_the_gpu(tmp_path):
    """--amp --compile: bf16 autocast where the GPU computes bf16 natively (no GradScaler: the
    checkpoint's scaler state is empty), fp16 with a GradScaler where it does not (T4, V100);
    DDP over the compiled model. It learns: 8 classes, chance is 12.5 %."""
    proc = template_run(tmp_path, "--amp", "--compile")
    accuracy = float(re.findall(r"test accuracy (\d+\.\d+)%", proc.stdout)[-1])
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert bool(saved["scaler"]) != torch.cuda.is_bf16_supported(including_emulation=False)
    print(f"\ntemplate --amp --compile on {torch.cuda.get_device_name()}: {accuracy} % "
          f"(2 CPU ranks in float32, torch 2.14.1: 83.89 %)")
    assert accuracy > 50


def test_the_resnet18_port_checks_on_the_gpus_with_syncbatchnorm(tmp_path):
    """examples/resnet18_digits.py --check on the GPUs: torch's SyncBatchNorm (convert_sync_
    batchnorm), replayed over rank 0's group alone. On 2 GPUs this is the NCCL proof of the CPU's
    test; on one it runs the same code, the control measuring the GPU's own rounding."""
    proc = run_step("examples/resnet18_digits.py", ["--check", "--train-samples", 256,
                                                    "--test-samples", 64, "--batch-size", 32],
                    nproc=RANKS, gpus=True)
    assert "check step 1, buffers: off by" in proc.stdout, proc.stdout[-2000:]
    print("\n" + "\n".join(line for line in proc.stdout.splitlines() if "check" in line
                           or "diagnosis" in line))
    assert f"diagnosis: DDP on {RANKS} ranks computes what one process computes" in proc.stdout
