"""Issue 15: --profile writes one trace per rank and a step-time breakdown that adds up, and a
real TensorBoard server shows the run's scalars and the profiler plugin's run.

One profiled 2-rank run of step 03 (DDP) serves every test that needs processes; the
breakdown's interval arithmetic is also checked on small hand-made traces, where the right
answer is known exactly (step 02's all-reduce after backward, DDP's overlap, a GPU timeline).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest

from conftest import REPO, assert_all_reduce_starts, assert_no_traceback, launch, run_step
from harness import profiling

ARGS = ["--data", "mnist", "--train-samples", 960, "--test-samples", 100, "--batch-size", 96,
        "--epochs", 1, "--profile"]  # 10 steps per epoch: steps 3-5 are recorded
SCALARS = {"train/loss", "test/accuracy", "test/loss", "train/samples_per_sec", "train/lr"}
PARTS = ("compute_ms", "exposed_comm_ms", "data_ms", "other_ms")
# The parts partition each step exactly; only float rounding separates their sum from it.
ADD_UP_MS = 1e-3
# The plugin's Distributed view splits the same trace with its own code, and files two kinds
# of span otherwise than we do: the c10d call that hands a bucket to gloo (communication to us:
# the training thread cannot compute meanwhile; computation to it) and the DataLoader's
# __next__ (data loading to us; it reads no loader annotation). The call takes ~0.1 ms, but up
# to 11 ms when the 2-core machine preempts the thread: compared as they were, the splits once
# differed by 6 % of the step. So we compare our split outside those spans plus the plugin's
# inside them: measured within 2 us over 82 rank-runs (its rounding to whole microseconds).
PLUGIN_AGREES = 0.01  # of the step time
SERVER_READY_S = 45


@pytest.fixture(scope="module")
def ddp_run(mnist_root, tmp_path_factory):
    """One profiled 2-rank run of step 03: its folder, process and per-rank summaries."""
    out = tmp_path_factory.mktemp("profile03")
    proc = run_step("03_ddp_wrapper.py", [*ARGS, "--data-dir", mnist_root, "--out-dir", out],
                    nproc=2)
    summaries = [json.loads((out / "profile" / f"summary_rank{r}.json").read_text())
                 for r in range(2)]
    return SimpleNamespace(out=out, proc=proc, summaries=summaries)


@pytest.fixture(scope="module")
def manual_run(mnist_root, tmp_path_factory):
    """The same, of step 02 (the all-reduce written out after backward)."""
    out = tmp_path_factory.mktemp("profile02")
    run_step("02_manual_ddp.py", [*ARGS, "--data-dir", mnist_root, "--out-dir", out], nproc=2)
    return SimpleNamespace(out=out)


def trace_events(out, name) -> list[dict]:
    return json.loads((out / "profile" / name).read_text())["traceEvents"]


def host_steps(events) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")
            and e.get("cat") != "gpu_user_annotation"]


def plugin_split_of_calls_and_loader(out, summary) -> dict:
    """How the plugin splits the spans our summary keeps apart from compute: the training
    thread's c10d calls and the loader's __next__ (exposed communication and data loading to
    us). Their ops are its computation ("ops"; overlapping where gloo runs), gloo's time
    outside those ops its communication, the rest other. Per-step means, ms."""
    events = trace_events(out, summary["trace"])
    steps = host_steps(events)
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    on_trainer = [(e["pid"], e["tid"]) == (steps[0]["pid"], steps[0]["tid"]) for e in spans]

    def union(pick):
        return profiling._union(profiling._interval(e) for e, trainer in zip(spans, on_trainer)
                                if pick(e, trainer))

    apart = union(lambda e, trainer: trainer and (profiling._is_comm(e) or (
        "DataLoader" in e["name"] and "__next__" in e["name"])))
    ops = union(lambda e, trainer: trainer and e.get("cat") == "cpu_op")
    gloo = union(lambda e, trainer: not trainer and profiling._is_comm(e))
    in_ops, idle = profiling._intersect(apart, ops), profiling._subtract(apart, ops)
    parts = {"ms": apart, "ops": in_ops, "overlapping": profiling._intersect(in_ops, gloo),
             "communication": profiling._intersect(idle, gloo),
             "other": profiling._subtract(idle, gloo)}
    return {name: sum(profiling._length(profiling._intersect(part, [profiling._interval(s)]))
                      for s in steps) / len(steps) / 1000 for name, part in parts.items()}


def test_one_trace_per_rank_with_communication(ddp_run):
    traces = sorted((ddp_run.out / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]
    for trace in traces:
        events = trace_events(ddp_run.out, trace.name)
        assert len(host_steps(events)) == 3  # active=3 of the schedule
        assert any(e["name"] == "gloo:all_reduce" for e in events)


def test_breakdown_adds_up_to_the_measured_step_time(ddp_run):
    for rank, summary in enumerate(ddp_run.summaries):
        steps = host_steps(trace_events(ddp_run.out, summary["trace"]))
        measured_ms = sum(s["dur"] for s in steps) / len(steps) / 1000
        assert summary["rank"] == rank and summary["steps"] == 3
        assert summary["step_ms"] == pytest.approx(measured_ms, rel=1e-9)
        assert sum(summary[p] for p in PARTS) == pytest.approx(measured_ms, abs=ADD_UP_MS)
        assert min(summary[p] for p in PARTS) > -ADD_UP_MS
        assert summary["compute_ms"] > 0.5 * measured_ms  # a CPU step is mostly compute
        # DDP all-reduces a bucket while backward still computes the earlier layers' gradients
        assert summary["overlapped_comm_ms"] > 0
        assert summary["exposed_comm_ms"] + summary["overlapped_comm_ms"] == pytest.approx(
            summary["comm_ms"], abs=ADD_UP_MS)


def test_rank0_prints_every_ranks_breakdown_once(ddp_run):
    output = ddp_run.proc.stdout + ddp_run.proc.stderr
    assert_no_traceback(ddp_run.proc)
    assert output.count("profile: ms per step") == 1
    lines = ddp_run.proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("profile:"))
    assert [line.split()[0] for line in lines[header + 2:header + 4]] == ["0", "1"]
    assert "gpuGetDeviceCount" not in output  # kineto's GPU probe is silenced on the CPU


def span(name, start, end, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": start,
            "dur": end - start}


def breakdown_of(*events):
    return profiling.step_breakdown([span("ProfilerStep#2", 0, 100, cat="user_annotation"),
                                     *events])


def test_breakdown_of_a_ddp_step_with_known_answer():
    # Times in microseconds: the loader, forward, a backward that starts the all-reduce of
    # its first bucket (gloo runs it on its own thread), then the optimizer.
    result = breakdown_of(
        span("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 5,
             cat="user_annotation"), span("aten::index", 1, 4),
        span("aten::conv2d", 5, 40), span("autograd::engine::evaluate_function", 40, 80),
        span("c10d::allreduce_", 58, 60), span("gloo:all_reduce", 60, 90, tid=2),
        span("aten::add_", 92, 98))
    assert result["step_ms"] == 0.1
    assert result["compute_ms"] == pytest.approx((53 + 20 + 6) / 1000)  # not the loader's op
    assert result["exposed_comm_ms"] == pytest.approx((2 + 10) / 1000)  # launch + tail
    assert result["data_ms"] == pytest.approx(5 / 1000)
    assert result["other_ms"] == pytest.approx(4 / 1000)
    assert result["overlapped_comm_ms"] == pytest.approx(20 / 1000)


def test_breakdown_of_an_all_reduce_after_backward_hides_nothing():
    result = breakdown_of(span("aten::conv2d", 0, 80), span("c10d::allreduce_", 81, 82),
                          span("gloo:all_reduce", 82, 95, tid=2), span("aten::div_", 96, 98))
    assert result["exposed_comm_ms"] == pytest.approx(14 / 1000)
    assert result["overlapped_comm_ms"] == 0


def launched(kernel: dict, at: float, correlation: int) -> list[dict]:
    """A device event and the host's CUDA runtime call that launched it, linked as a trace
    links them: by the correlation id both carry."""
    kernel["args"] = {"correlation": correlation}
    call = span("cudaLaunchKernel", at, at + 1, cat="cuda_runtime")
    call["args"] = {"correlation": correlation}
    return [call, kernel]


def test_breakdown_on_a_gpu_uses_the_device_timeline():
    # The host only launches; the kernels are the work. The step also shows on the GPU's
    # timeline, which must not count as a second step.
    result = breakdown_of(span("aten::conv2d", 0, 30), span("ProfilerStep#2", 5, 95, 7,
                                                            cat="gpu_user_annotation"),
                          *launched(span("sm90_xmma_fprop", 10, 50, 7, cat="kernel"), 2, 1),
                          *launched(span("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 60, 8,
                                         cat="kernel"), 20, 2))
    assert result["steps"] == 1 and result["timeline"] == "gpu"
    assert result["compute_ms"] == pytest.approx(40 / 1000)
    assert result["exposed_comm_ms"] == pytest.approx(10 / 1000)
    assert result["overlapped_comm_ms"] == pytest.approx(10 / 1000)


def test_a_gpu_kernel_counts_in_the_step_that_launched_it():
    """The host runs ahead: step 1's kernels run on into step 2's host window. Cutting the
    device timeline with the host's step windows would give step 2 what step 1 launched; the
    correlation id ties each kernel to the host call, and so to the step, that launched it."""
    nccl = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    result = profiling.step_breakdown([
        span("ProfilerStep#1", 0, 100, cat="user_annotation"),
        span("ProfilerStep#2", 100, 200, cat="user_annotation"),
        *launched(span("sm90_xmma_fprop", 50, 140, 7, cat="kernel"), 10, 1),  # step 1
        *launched(span(nccl, 140, 170, 8, cat="kernel"), 60, 2),  # step 1, exposed
        *launched(span("sm90_xmma_dgrad", 170, 230, 7, cat="kernel"), 110, 3),  # step 2
        *launched(span(nccl, 200, 250, 8, cat="kernel"), 150, 4),  # step 2, 30 us hidden
        span("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 100, 105,
             cat="user_annotation"),  # while step 1's kernel runs: no wait for data
    ])
    # step 1 on the device: 50-170 (90 compute + 30 exposed); step 2: 170-250 (60 compute,
    # 20 exposed, 30 overlapped). Host windows would have given step 1 only 50 us of compute.
    assert result["steps"] == 2 and result["timeline"] == "gpu"
    assert result["step_ms"] == pytest.approx((120 + 80) / 2 / 1000)
    assert result["compute_ms"] == pytest.approx((90 + 60) / 2 / 1000)
    assert result["exposed_comm_ms"] == pytest.approx((30 + 20) / 2 / 1000)
    assert result["overlapped_comm_ms"] == pytest.approx(30 / 2 / 1000)
    assert result["data_ms"] == 0 and result["other_ms"] == pytest.approx(0)


def test_event_files_hold_the_scalars(ddp_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(ddp_run.out))
    events.Reload()
    assert SCALARS <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("test/accuracy")] == [1]  # one epoch
    assert 0 <= events.Scalars("test/accuracy")[0].value <= 1


@pytest.fixture
def tensorboard(ddp_run, tmp_path):
    """A real `tensorboard` serving the run folder; yields a function that GETs JSON."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "tensorboard.log", "w")
    # A session of its own: the profiler plugin loads traces in child processes, and
    # stopping the group by this PID stops them too.
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir",
                               str(ddp_run.out), "--host", "127.0.0.1", "--port", str(port)],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def get(path):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/{path}", timeout=10) as r:
            return json.loads(r.read())

    try:
        deadline = time.monotonic() + SERVER_READY_S
        while True:  # ready once the plugin has loaded the traces
            assert server.poll() is None, (tmp_path / "tensorboard.log").read_text()
            try:
                runs = get("plugin/pytorch_profiler/runs")
                if runs["runs"] and not runs["loading"]:
                    break
            except OSError:
                pass  # not listening yet
            assert time.monotonic() < deadline, "tensorboard not ready in time"
            time.sleep(0.5)
        yield get
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def test_tensorboard_serves_scalars_and_profiler_run(ddp_run, tensorboard):
    assert tensorboard("runs") == ["."]  # the event file lies in the run folder itself
    assert SCALARS <= set(tensorboard("plugin/scalars/tags")["."])
    assert tensorboard("plugins_listing")["pytorch_profiler"]["enabled"]
    assert tensorboard("plugin/pytorch_profiler/runs")["runs"] == ["profile"]
    workers = tensorboard("plugin/pytorch_profiler/workers?run=profile&view=Overview")
    assert workers == ["rank0", "rank1"]
    assert "Distributed" in tensorboard("plugin/pytorch_profiler/views?run=profile")

    # Its Distributed view splits each step as computation / overlapping / communication /
    # other, from the same trace: our summary should tell the same story.
    span = tensorboard("plugin/pytorch_profiler/spans?run=profile&worker=rank0")[0]
    overlap = tensorboard(f"plugin/pytorch_profiler/distributed/overlap?run=profile"
                          f"&worker=All&span={span}")["data"]["all"]
    for rank, ours in enumerate(ddp_run.summaries):
        computation, overlapping, communication, other = (us / 1000 for us in
                                                          overlap[f"rank{rank}"])
        tolerance = PLUGIN_AGREES * ours["step_ms"]
        # Outside the c10d calls and the loader we compare our split; inside, the plugin's
        # (ours there is exposed communication and data loading, no compute and no other).
        inside = plugin_split_of_calls_and_loader(ddp_run.out, ours)
        assert computation + overlapping == pytest.approx(ours["compute_ms"] + inside["ops"],
                                                          abs=tolerance)
        assert overlapping == pytest.approx(ours["overlapped_comm_ms"] + inside["overlapping"],
                                            abs=tolerance)
        assert communication == pytest.approx(ours["exposed_comm_ms"] + ours["data_ms"]
                                              - inside["ms"] + inside["communication"],
                                              abs=tolerance)
        assert other == pytest.approx(ours["other_ms"] + inside["other"], abs=tolerance)


# ---------------------------------------------------------------- the overlap, as a picture
def test_the_timeline_draws_02s_all_reduce_after_backward_and_03s_inside_it(ddp_run,
                                                                          manual_run, tmp_path):
    """The spans the picture draws, read from the real traces of 2 ranks: step 02 starts its
    all-reduce when backward has ended; DDP (03) starts it while backward still runs."""
    assert_all_reduce_starts(manual_run.out, inside_backward=False)
    assert_all_reduce_starts(ddp_run.out, inside_backward=True)
    picture = tmp_path / "overlap.png"
    launch([sys.executable, str(REPO / "bench" / "timeline.py"), str(manual_run.out), str(ddp_run.out),
            "-o", str(picture)])
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
