"""Shared test harness: small MNIST-format files, and launching steps as real processes.

Every test here starts the tutorial's scripts the way a user does (plain python or torchrun)
on the CPU with gloo, GPUs or not (see HIDE_GPUS; only test_gpu.py opts in). Each launch costs
seconds (torch imports in ~3 s, a torchrun agent adds ~4 s), so tests share runs through
module-scoped fixtures wherever one run proves several things.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

# Four or more busy processes share two cores here, and libgomp's threads spin at the end of
# each parallel region, holding a core the others wait for. Passive waiting sleeps at once: the
# same threads split the same work, so the bits do not change (measured in docs/tests.md,
# "Threads that wait without spinning"). libgomp reads it as torch loads: set before that.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common import synthetic_digits  # noqa: E402

TRAIN_SAMPLES, TEST_SAMPLES = 1200, 299  # 299 is prime: it divides over no world size


def write_idx(path: Path, data: torch.Tensor) -> None:
    """MNIST's IDX format: big-endian magic (2051 images / 2049 labels), sizes, uint8 bytes."""
    magic = 2051 if data.dim() == 3 else 2049
    header = struct.pack(f">{1 + data.dim()}I", magic, *data.shape)
    path.write_bytes(header + data.to(torch.uint8).numpy().tobytes())


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory) -> Path:
    """A --data-dir holding small MNIST-format files that torchvision's MNIST class reads.

    The pixels are synthetic digits (learnable, unlike noise): MNIST itself cannot be
    downloaded on the test machines.
    """
    root = tmp_path_factory.mktemp("mnist")
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    train_images, train_labels = synthetic_digits(TRAIN_SAMPLES, seed=11)
    test_images, test_labels = synthetic_digits(TEST_SAMPLES, seed=12)
    write_idx(raw / "train-images-idx3-ubyte", train_images)
    write_idx(raw / "train-labels-idx1-ubyte", train_labels)
    write_idx(raw / "t10k-images-idx3-ubyte", test_images)
    write_idx(raw / "t10k-labels-idx1-ubyte", test_labels)
    return root


@pytest.fixture(scope="session", autouse=True)
def shared_compile_cache(tmp_path_factory):
    """One inductor cache for the whole run, shared by pytest-xdist's workers: a second compile
    of the same graph is cheap, and every compile skips the first one's checks of what the
    CPU's vector instructions can build (torch 2.14.1 builds a probe for each, once per cache:
    a tiny function compiled in 15.9 s with a new cache on the 2-core VM, another in 5.4 s
    after it; the checks take a lock, so ranks and workers that start them together build
    each probe once)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's folder is in the run's own
        root = root.parent
    cache = root / "inductor"
    cache.mkdir(exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))


# The CPU suite stays on the CPU on a machine with GPUs, in every process it starts: an empty
# CUDA_VISIBLE_DEVICES hides every GPU from CUDA, so torch.cuda.is_available() is False there,
# --device auto picks the CPU and the backend gloo. (Unpinned, two ranks of a two-agent test would
# share cuda:0, which NCCL refuses, and gloo's timeout messages would be NCCL's.) Only
# tests/test_gpu.py opts in, with gpus=True.
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}

# The tests send Ctrl-C (SIGINT) and SIGQUIT to the runs they start, as a terminal does. A pytest
# that a script started in the background (`bash script &`: no job control) has both ignored, and
# an ignored signal stays ignored in every process it starts: a Ctrl-C then stopped no run (exit
# 0, not 130). With their defaults back here, the runs start as they do from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def base_env(*, gpus: bool = False, **extra) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({} if gpus else HIDE_GPUS)}
    env.pop("RANK", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch(args: list[str], *, env=None, timeout=300, check=True, cwd=REPO,
           fresh=False) -> subprocess.CompletedProcess:
    """Run a command to completion; on an unexpected exit code show its output.

    A step, or torchrun's agent and its workers, run as children forked from a process that has
    imported torch (tests/preimported.py: its docstring says what that changes, and when a run
    is started fresh anyway); fresh=True, or FRESH_PROCESSES=1 for the whole suite, starts every
    one anew."""
    args, env = [str(a) for a in args], env or base_env()
    request = None if fresh else forkable(args, env, cwd)
    if request is None:
        proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    else:
        proc = Preimported.get().run(args, request, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def start(args: list, log, *, env=None, cwd=REPO, fresh=False):
    """Start a command and return at once, its stdout and stderr going to the open file `log`
    (a pipe nobody reads could block it): forked as `launch` forks, in a session of its own
    and with /dev/null as stdin, or with subprocess.Popen where it cannot be (fresh=True, as
    launch). The handle has Popen's pid, poll, wait, returncode, send_signal, terminate and
    kill; `descendants` finds what it starts, forked or not. What still runs when the test that
    started it ends is ended then (end_left_running)."""
    args, env = [str(a) for a in args], env or base_env()
    request = None if fresh else forkable(args, env, cwd)
    if request is None:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    else:
        import preimported

        stdin = os.open(os.devnull, os.O_RDONLY)
        try:
            proc = preimported.ForkedChild({**request, "new_session": True},
                                           [stdin, log.fileno(), log.fileno()])
        finally:
            os.close(stdin)
    proc.log = log
    STARTED.append(proc)
    return proc


STARTED = []  # what `start` began, for end_left_running


@pytest.fixture(autouse=True)
def end_what_a_test_left_running():
    yield
    end_left_running()


def end_left_running() -> None:
    """SIGKILL what `start` began and is still running, with all below it: a test that failed
    before its run ended (a timeout, say) would otherwise leave the run, or a torchrun agent's
    workers, taking CPU from every test after it, to the end of the suite and beyond it."""
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            for pid in [*descendants(proc.pid), proc.pid]:  # (found before any is gone)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()


def output(proc, timeout: float | None = None) -> str:
    """What a run `start` began has printed, once it has ended (waiting up to `timeout`)."""
    proc.wait(timeout=timeout)
    proc.log.seek(0)
    return proc.log.read()


def children(pid: int) -> list[int]:
    """The processes `pid` started: its children, and those a helper forked for it (a forked
    torchrun's workers, a forked tour's steps: tests/preimported.py records who asked)."""
    found = [int(child) for child in subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()]
    if Preimported._started is not None:
        import preimported

        found += sorted(child for child, run in
                        preimported.asked(str(Preimported._started.folder)).items()
                        if run["asker"] == int(pid))
    return found


def environment(pid: int) -> dict:
    """The environment process `pid` runs under (a forked one's, as its helper recorded it)."""
    if Preimported._started is not None:
        import preimported

        run = preimported.asked(str(Preimported._started.folder)).get(int(pid))
        if run is not None:
            return run["env"]
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(os.fsdecode(item).split("=", 1) for item in f.read().split(b"\0")
                    if b"=" in item)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (its DataLoader workers; under torchrun the ranks and theirs)."""
    return [c for child in children(pid) for c in (child, *descendants(child))]


def forkable(args: list[str], env: dict, cwd) -> dict | None:
    """The request for tests/preimported.py that runs `args`, or None where it cannot."""
    if os.environ.get("FRESH_PROCESSES") == "1" or len(args) < 2 or args[0] != sys.executable:
        return None
    import preimported

    what = preimported.what_runs(args[1:])
    helper = what and preimported.helper_for(env, Preimported.get().helpers)
    if helper is None:
        return None
    return {**what, "env": env, "cwd": str(cwd), "socket": helper}


class Preimported:
    """This pytest process's helpers (tests/preimported.py), started at their first use: one
    imported torch under the tests' environment, one under it with OMP_NUM_THREADS=1, as
    torchrun's workers have it (libgomp reads it when torch loads). Each knows of the other
    through helpers.json: a torchrun agent forked from one has its workers forked by either."""

    _started = None
    ENVIRONMENTS = ({}, {"OMP_NUM_THREADS": "1"})

    @classmethod
    def get(cls) -> "Preimported":
        if cls._started is None:
            cls._started = cls()
        return cls._started

    def __init__(self):
        import atexit
        import tempfile

        self.folder = Path(tempfile.mkdtemp(prefix="preimported-"))
        self.env, listing = base_env(), self.folder / "helpers.json"
        self.helpers = [{"socket": str(self.folder / f"{n}.socket"), "env": {**self.env, **extra}}
                        for n, extra in enumerate(self.ENVIRONMENTS)]
        listing.write_text(json.dumps(self.helpers))
        self.processes = [subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "preimported.py"), helper["socket"], str(listing)],
            cwd=REPO, env=helper["env"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=(self.folder / f"{n}.stderr").open("w"), start_new_session=True)
            for n, helper in enumerate(self.helpers)]  # (both import torch at once)
        self.owner = os.getpid()
        atexit.register(self.stop)
        for n, process in enumerate(self.processes):
            if process.stdout.readline() != b"ready\n":
                raise RuntimeError(f"tests/preimported.py did not start: "
                                   f"{(self.folder / f'{n}.stderr').read_text()[-2000:]}")

    def stop(self):
        if os.getpid() != self.owner:  # a process forked from pytest's, ending: not ours to stop
            return
        for process in self.processes:
            process.kill()
            process.wait()
        subprocess.run(["rm", "-rf", str(self.folder)], check=False)

    def run(self, args, request, timeout) -> subprocess.CompletedProcess:
        import locale
        import socket
        import uuid

        run = self.folder / uuid.uuid4().hex
        request = {**request, "stdout": f"{run}.out", "stderr": f"{run}.err"}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(request["socket"])
            connection.sendall(json.dumps(request).encode() + b"\n")
            answers = connection.makefile()
            pid = json.loads(answers.readline())["pid"]
            connection.settimeout(timeout)
            try:
                code = json.loads(answers.readline())["returncode"]
            except (TimeoutError, socket.timeout):
                os.kill(pid, signal.SIGKILL)
                connection.settimeout(None)
                json.loads(answers.readline())  # (its end: the files are complete)
                code = None
        encoding = locale.getpreferredencoding(False)
        out, err = (Path(f"{run}.{name}").read_bytes().decode(encoding)
                    .replace("\r\n", "\n").replace("\r", "\n") for name in ("out", "err"))
        Path(f"{run}.out").unlink(), Path(f"{run}.err").unlink()
        if code is None:
            raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=err)
        return subprocess.CompletedProcess(args, code, out, err)


# With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, torchrun's agent picks a free port for each round's
# store, frees it, and rank 0 listens there a few seconds later; another process may take it
# between (torch's get_free_port says so). Rank 0's TCPStore then fails with EADDRINUSE and the
# round is lost: once in about 15 whole runs here, with two test files running at a time. A test
# that restarts a group reruns once on that error alone (pytest-rerunfailures), from a fresh
# tmp_path; any other failure, or the same one twice, fails it.
PORT_TAKEN_RERUNS = pytest.mark.flaky(reruns=1, only_rerun=[
    r"failed to listen on any local network address\. port: \d+, useIpv6: \w+, code: -98, "
    r"name: EADDRINUSE"])


def run_id() -> str:
    """A --rdzv-id for one launch of several agents, its own as --standalone makes one: its
    ranks can then be forked (tests/preimported.py; with a fixed id they start fresh, as
    harness.peers.this_launch could not tell two launches of it apart)."""
    return str(uuid.uuid4())


def torchrun_cmd(nproc: int, *script_and_args, extra: tuple = ()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *extra, *map(str, script_and_args)]


def run_step(script: str, args: list, *, nproc: int | None = None, probe_dir: Path | None = None,
             env_extra: dict | None = None, torchrun_extra: tuple = (), check=True,
             timeout=300, gpus: bool = False):
    """Start a step like a user: plain python (nproc=None) or torchrun with nproc ranks, on the
    CPU (gpus=False: see HIDE_GPUS) or on the GPUs this machine has (gpus=True).

    With probe_dir, the step runs under tests/rank_probe.py, which saves each rank's final
    parameters and the sample indices it fetched.
    """
    target = [script]
    env = base_env(gpus=gpus, **(env_extra or {}))
    if probe_dir is not None:
        probe_dir.mkdir(parents=True, exist_ok=True)
        target = [str(REPO / "tests" / "rank_probe.py"), script]
        env["PROBE_DIR"] = str(probe_dir)
    args = [str(a) for a in args]
    if nproc is None:
        cmd = [sys.executable, *target, *args]
    else:
        cmd = torchrun_cmd(nproc, *target, *args, extra=torchrun_extra)
    return launch(cmd, env=env, check=check, timeout=timeout)


def copy_out(scripts: list[str], folder) -> None:
    """A step and common.py, alone in an empty folder, as a learner copies them out."""
    folder.mkdir()
    for name in [*scripts, "common.py"]:
        (folder / name).write_text((REPO / name).read_text())


# Loaded by every Python process of a copied run (PYTHONPATH): rank 1 SIGKILLs itself after its
# 27th optimizer step, in torchrun's first attempt only, as tests/rank_probe.py does in the
# repository (which would take the harness in with it).
KILL_RANK_1_AT_STEP_27 = """
import os
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import signal
    from torch.optim.optimizer import register_optimizer_step_post_hook
    steps = [0]
    def after_step(optimizer, args, kwargs):
        steps[0] += 1
        if steps[0] == 27:
            os.kill(os.getpid(), signal.SIGKILL)
    register_optimizer_step_post_hook(after_step)
"""


def copied_run_killed_at_step_27(script: str, args: list, tmp_path: Path):
    """`script` and common.py copied out (copy_out), run on 2 ranks under torchrun
    --max-restarts 1 with a fresh store per restart, rank 1 killed after its 27th step; the
    run's --out-dir is tmp_path / "out"."""
    folder, hook = tmp_path / "copied", tmp_path / "hook"
    copy_out([script], folder)
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_RANK_1_AT_STEP_27)
    return launch(torchrun_cmd(2, script, *args, "--out-dir", tmp_path / "out",
                               extra=("--max-restarts", "1")),
                  env=base_env(PYTHONPATH=hook, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1),
                  cwd=folder)


def saved_checkpoint(folder: Path) -> tuple[Path, tuple]:
    """A plain model, optimizer and scheduler, saved as <folder>/checkpoint.pt after "epoch 1"."""
    from harness import checkpoint
    from harness.model import Net

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = (model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))
    checkpoint.save(folder / "checkpoint.pt", *state, 1)
    return folder / "checkpoint.pt", state


class LazyRuns(dict):
    """A module's runs, each launched the first time a test reads it and then kept: a test
    starts only the runs it reads (`pytest -m quick` needs few of them), and each runs once
    however many tests read it."""

    def __init__(self, start):
        super().__init__()
        self.start = start  # name -> what the tests read of that run

    def __missing__(self, name):
        self[name] = self.start(name)
        return self[name]


@pytest.fixture
def one_process_group():
    """A gloo group of one, in this process: a hand-written BatchNorm all-reduces (over itself)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def assert_normalises_as_batchnorm2d(bn, ours) -> tuple[torch.Tensor, torch.Tensor]:
    """`ours`, a hand-written BatchNorm holding `bn`'s state, against `bn` (nn.BatchNorm2d of 4
    channels) over 3 training steps where a channel's mean is 100 times its spread: outputs
    and input gradients within 1e-4, and the same running statistics (momentum, the unbiased
    variance). Returns the last input and bn's output, for a test to try another formula on."""
    weight = torch.randn(8, 4, 6, 6)
    for _ in range(3):
        x = 100 + torch.randn(8, 4, 6, 6) * torch.tensor([1.0, 3, 0.5, 2]).view(1, -1, 1, 1)
        found = []
        for layer in (bn, ours):
            x_ = x.clone().requires_grad_()
            y = layer(x_)
            (y * weight).sum().backward()
            found.append((y.detach(), x_.grad))
        (y, grad), (y_ours, grad_ours) = found
        assert (y - y_ours).abs().max() < 1e-4 and (grad - grad_ours).abs().max() < 1e-4
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.allclose(getattr(bn, name), getattr(ours, name), rtol=1e-5), name
    return x, y


def read_summary(out_dir: Path) -> dict:
    return json.loads((out_dir / "summary.json").read_text())


def rank_params(probe_dir: Path, rank: int = 0) -> list[torch.Tensor]:
    return torch.load(probe_dir / f"rank{rank}.pt", weights_only=True)["params"]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b) and a, "parameter lists differ in length or are empty"
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def assert_no_traceback(proc: subprocess.CompletedProcess) -> None:
    """No traceback from our code. When a worker exits non-zero, torchrun prints its own
    ChildFailedError traceback (frames in torch/distributed only): that one is allowed."""
    output = proc.stdout + proc.stderr
    if "ChildFailedError" in output:
        assert not frames_of_ours(output), output[-3000:]
    else:
        assert "Traceback" not in output, output[-3000:]


def frames_of_ours(output: str) -> list[str]:
    """The traceback lines that name a file of this repository (not of a virtualenv inside it,
    where the README's Quickstart installs torch: torchrun's own frames are there)."""
    return [line for line in output.splitlines()
            if line.strip().startswith("File ") and str(REPO) in line
            and "/site-packages/" not in line]


# Steps 07 and 08, 2 epochs of 20 steps (960 samples, global batch 48), a checkpoint every 4.
RESTART_ARGS = ["--data", "mnist", "--train-samples", 960, "--batch-size", 48, "--epochs", 2,
                "--checkpoint-every", 4]


@pytest.fixture(scope="session")
def uninterrupted_07(mnist_root, tmp_path_factory) -> Path:
    """Step 07 on 2 ranks, never interrupted: what every restart test and step 08 must equal.
    Run once for the whole run, as shared_compile_cache is shared: the first of pytest-xdist's
    workers to need it runs it, holding a lock; the others wait for it, then read it."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's folder is in the run's own
        root = root.parent
    out = root / "uninterrupted_07"
    with open(root / "uninterrupted_07.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "summary.json").exists():  # (written last: the run is complete)
            shutil.rmtree(out, ignore_errors=True)  # (what a failed attempt left)
            run_step("07_fault_tolerance.py", [*RESTART_ARGS, "--data-dir", mnist_root,
                                               "--out-dir", out], nproc=2, probe_dir=out / "probe")
    return out


def assert_all_reduce_starts(run_dir: Path, inside_backward: bool) -> list[dict]:
    """The spans bench/timeline.py draws from a profiled 2-rank run, as drawn: on every rank
    forward ends where backward starts, the optimizer runs after backward, and the first
    communication starts while backward still runs (inside_backward) or once it has ended.
    Returns every rank's phases."""
    sys.path.insert(0, str(REPO / "bench"))
    import timeline

    traces = timeline.rank_traces(run_dir)
    assert len(traces) == 2
    drawn = timeline.least_disturbed(traces)
    for trace, phases in zip(traces, drawn):
        (backward_start, backward_end), = phases["backward"]
        (forward_start, forward_end), = phases["forward"]
        assert 0 <= forward_start < forward_end == backward_start < backward_end
        communication = [a for a, b in phases["communication"]]
        assert communication, trace.name
        if inside_backward:
            assert backward_start < min(communication) < backward_end, (trace, phases)
        else:
            assert min(communication) >= backward_end, (trace, phases)
        assert phases["optimizer"] and phases["optimizer"][0][0] >= backward_end
    return drawn


# The files run in pytest-xdist's own order, most tests first: why this file sets none is in
# docs/tests.md, "Two files at a time".
