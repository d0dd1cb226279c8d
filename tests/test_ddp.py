"""Steps 02 and 03 proven equal, N ranks proven equal to one process, exact evaluation across
ranks, gradient accumulation, exact resume, progress inside an epoch, and where torch.compile
breaks its graph. Real torchrun processes."""

import re
import sys
from types import SimpleNamespace

import pytest
import torch

import common
from harness.model import build_model

from conftest import (REPO, TEST_SAMPLES, LazyRuns, copy_out, launch, max_difference,
                      rank_params, read_summary, run_step, torchrun_cmd)

TRAIN = 480  # divides by the global batch (48) and by 1 to 4 ranks: no sampler padding
COMMON = ["--data", "mnist", "--train-samples", TRAIN, "--batch-size", 48]
# 02 vs 03 on 2 ranks: bit for bit. 02 sums then halves, DDP halves then sums: halving is exact,
# and a sum of two values is the same in either order (a + b == b + a in floating point).
# 02 vs 03 on 4 ranks: not bit for bit, although 1/4 is exact too. An all-reduce of 4 values
# adds them in an order that depends on where a value sits in the message (gloo's ring works on
# chunks of it; NCCL picks algorithms by size), and 02 sends one message per parameter where DDP
# sends two buckets: the same numbers, added in other orders, differ in their last bits, and ten
# momentum steps amplify that. Measured: 159,995 of the 1,199,882 weights differ after ten steps,
# by at most 3.0e-8 (N ranks vs one process: 7.9e-6, order_bound below); a missing average or a rank
# left out differs by more than 1e-3.
FOUR_RANKS = 1e-6
# N ranks vs one process: float32 gradient sums in another order differ by ~1e-7 per step, and
# ten momentum-SGD steps amplify that; measured 0.8e-5 (2 ranks) and 1.4e-5 (3 ranks) while
# training moved the weights by 0.08. A real sync bug (a missing average, a rank left out)
# differs by more than 1e-3. How much rounding alone gives depends on the CPU's kernels, so the
# bound is measured where the test runs (issue 59): a control, one process again with its batch
# in 2 micro-batches (the same gradients, summed in another order), and 10 times its difference
# from the first, + 1e-6, as train_template.py --check bounds DDP (and never above 1e-3).
def order_bound(runs) -> float:
    control = max_difference(rank_params(runs["one_process"]["probe"]),
                             rank_params(runs["one_process_micro"]["probe"]))
    assert 0 < control, "the control rounded exactly as the reference: it measured nothing"
    return min(10 * control + 1e-6, 1e-3)


PLAN = {  # name: (script, ranks or None for plain python, extra args)
    "02": ("02_manual_ddp.py", 2, ["--epochs", 2]),
    "02_four_ranks": ("02_manual_ddp.py", 4, ["--epochs", 1, "--no-dropout"]),
    "four_ranks": ("03_ddp_wrapper.py", 4, ["--epochs", 1, "--no-dropout"]),
    "03": ("03_ddp_wrapper.py", 2, ["--epochs", 2]),  # (its epoch-1 checkpoint is kept)
    "one_process": ("03_ddp_wrapper.py", None, ["--epochs", 1, "--no-dropout", "--quiet"]),
    "one_process_micro": ("03_ddp_wrapper.py", None, ["--epochs", 1, "--no-dropout", "--quiet",
                                                      "--max-device-batch", 24]),  # the control
    "two_ranks": ("03_ddp_wrapper.py", 2, ["--epochs", 1, "--no-dropout"]),
    "three_ranks": ("03_ddp_wrapper.py", 3, ["--epochs", 1, "--no-dropout"]),
    "accumulate": ("03_ddp_wrapper.py", 2, ["--epochs", 1, "--no-dropout",
                                            "--max-device-batch", 8]),
    # (--compile: on the CPU 04 runs eagerly unless asked)
    "compiled": ("04_ddp_compile.py", 2, ["--epochs", 1, "--no-dropout", "--compile"]),
    # weak scaling: 24 per rank (not COMMON's global 48), --lr x2 after 3 warm-up steps
    "weak": ("03_ddp_wrapper.py", 2, ["--epochs", 2, "--batch-per-rank", 24,
                                      "--lr-scaling", "linear", "--warmup-steps", 3]),
}


@pytest.fixture(scope="module")
def runs(mnist_root, tmp_path_factory):
    """The training runs of PLAN, each launched once, when a test first reads it."""
    root = tmp_path_factory.mktemp("ddp")

    def start(name):
        if name == "03_resumed":  # the checkpoint "03" wrote after epoch 1, resumed
            first_epoch, resumed = runs["03"]["out"] / "checkpoint-epoch1.pt", root / name
            run_step("03_ddp_wrapper.py", [*COMMON, "--data-dir", mnist_root, "--epochs", 2,
                                           "--resume", first_epoch, "--out-dir", resumed],
                     nproc=2, probe_dir=resumed / "probe")
            return {"out": resumed, "probe": resumed / "probe", "summary": read_summary(resumed)}
        script, nproc, extra = PLAN[name]
        out = root / name
        common = COMMON[:-2] if "--batch-per-rank" in extra else COMMON  # not --batch-size
        proc = run_step(script, [*common, "--data-dir", mnist_root, *extra, "--out-dir", out],
                        nproc=nproc, probe_dir=out / "probe",
                        env_extra={"PROBE_KEEP_CHECKPOINTS": 1} if name == "03" else None)
        return {"out": out, "probe": out / "probe", "stdout": proc.stdout,
                "summary": read_summary(out)}

    runs = LazyRuns(start)
    return runs


@pytest.mark.quick
def test_manual_ddp_equals_the_wrapper(runs):
    """02 (broadcast + hand-written all-reduce) and 03 (DDP) end with the same weights, bit for
    bit on 2 ranks."""
    assert max_difference(rank_params(runs["02"]["probe"]), rank_params(runs["03"]["probe"])) == 0
    assert runs["02"]["summary"]["train_losses"] == pytest.approx(
        runs["03"]["summary"]["train_losses"], rel=1e-6)


def test_manual_ddp_equals_the_wrapper_on_4_ranks_up_to_the_order_of_the_sums(runs):
    """With 4 ranks the all-reduce adds four values in an order that depends on the message
    layout, which differs between 02 (one message per parameter) and DDP (buckets): close, not
    bit-identical."""
    difference = max_difference(rank_params(runs["02_four_ranks"]["probe"]),
                                rank_params(runs["four_ranks"]["probe"]))
    assert difference < FOUR_RANKS
    assert runs["02_four_ranks"]["summary"]["world_size"] == 4


@pytest.mark.parametrize("name, ranks", [("02", 2), ("03", 2), ("three_ranks", 3),
                                         ("02_four_ranks", 4), ("four_ranks", 4)])
def test_every_rank_ends_with_identical_weights(runs, name, ranks):
    first = rank_params(runs[name]["probe"], 0)
    for rank in range(1, ranks):
        assert max_difference(first, rank_params(runs[name]["probe"], rank)) == 0.0


@pytest.mark.quick
@pytest.mark.parametrize("name", ["two_ranks", "three_ranks"])
def test_n_ranks_equal_one_process_with_the_same_global_batch(runs, name):
    baseline, bound = rank_params(runs["one_process"]["probe"]), order_bound(runs)
    difference = max_difference(baseline, rank_params(runs[name]["probe"]))
    print(f"\n{name} vs one process: {difference:.3g} (bound {bound:.3g})")
    assert difference <= bound
    assert runs[name]["summary"]["per_rank_batch_size"] == 48 // (2 if name == "two_ranks" else 3)
    # The comparison could fail: training moved the weights far beyond the tolerance.
    initial = list(build_model(SimpleNamespace(dropout=False), seed=0).parameters())
    assert max_difference(baseline, [p.detach() for p in initial]) > 50 * bound


def test_accumulating_micro_batches_equals_one_big_batch(runs):
    summary = runs["accumulate"]["summary"]
    assert (summary["micro_batch_size"], summary["accumulation_steps"]) == (8, 3)
    assert max_difference(rank_params(runs["accumulate"]["probe"]),
                          rank_params(runs["two_ranks"]["probe"])) <= order_bound(runs)


def test_batch_per_rank_grows_the_global_batch_and_scales_the_learning_rate(runs):
    """--batch-per-rank 24 on 2 ranks: a global batch of 48, --lr 0.05 x 2 once the 3 warm-up
    steps are done, x0.7 in the second epoch; the rate each epoch ended with is in the summary
    (and TensorBoard), the scaling in the start-up line."""
    summary, stdout = runs["weak"]["summary"], runs["weak"]["stdout"]
    assert (summary["global_batch_size"], summary["per_rank_batch_size"]) == (48, 24)
    assert "batch=48 (= 2 ranks x 24," in stdout
    assert "lr=0.05x2 (linear, warm-up 3 steps)" in stdout
    assert (summary["lr_scaling"], summary["warmup_steps"]) == ("linear", 3)
    assert summary["lrs"] == pytest.approx([0.1, 0.07], rel=1e-12)
    assert summary["train_losses"][1] < summary["train_losses"][0]


def test_two_epochs_equal_one_epoch_plus_resume(runs):
    """Dropout is on: the resume must restore every rank's RNG to draw the same masks."""
    straight = rank_params(runs["03"]["probe"])
    resumed = rank_params(runs["03_resumed"]["probe"])
    assert max_difference(straight, resumed) == 0.0
    assert runs["03_resumed"]["summary"]["train_losses"] == runs["03"]["summary"]["train_losses"][1:]
    checkpoint = torch.load(runs["03_resumed"]["out"] / "checkpoint.pt", weights_only=True)
    assert checkpoint["epoch"] == 2
    assert not any(key.startswith(("module.", "_orig_mod.")) for key in checkpoint["model"])


# ---------------------------------------------------------------- torch.compile (step 04)
def test_compiled_ddp_learns_like_eager_ddp(runs):
    """Dropout off: compiled and eager dropout draw different masks. Fused kernels add in
    another order, so the weights agree to float32 rounding amplified over ten steps."""
    compiled = runs["compiled"]
    assert "compile=on" in compiled["stdout"], compiled["stdout"]
    assert max_difference(rank_params(compiled["probe"]),
                          rank_params(runs["two_ranks"]["probe"])) <= order_bound(runs)
    assert compiled["summary"]["first_step_seconds"] > 0  # the compile, reported on its own


def test_compiled_checkpoint_loads_into_the_plain_model(runs):
    state = torch.load(runs["compiled"]["out"] / "checkpoint.pt", weights_only=True)["model"]
    assert not any(key.startswith(("module.", "_orig_mod.")) for key in state)
    model = build_model(SimpleNamespace(dropout=False), seed=1)
    model.load_state_dict(state)  # strict: every key matches the eager model's
    assert max_difference([p.detach() for p in model.parameters()],
                          rank_params(runs["compiled"]["probe"])) == 0.0


# ---------------------------------------------------------------- the end of a run
@pytest.mark.parametrize("name", ["02", "03", "compiled"])
def test_the_group_and_its_threads_are_gone_when_the_step_ends(runs, name):
    """destroy_process_group ends gloo's threads on every rank. torchvision (every MNIST run)
    and torch.compile import torch.distributed.nn after the group is made, and its functions'
    default argument (the default group, taken at import) kept the group and its threads
    alive until the interpreter's exit tore them down: common.py imports it first."""
    for rank in range(2):
        threads = torch.load(runs[name]["probe"] / f"rank{rank}.pt", weights_only=True)["threads"]
        if threads is None:
            pytest.skip("threads are read from /proc/self/task (Linux)")
        assert not [thread for thread in threads if "gloo" in thread], (rank, threads)


# ---------------------------------------------------------------- sampler
def train_indices(probe, rank):
    """The training-set indices one rank fetched, in order."""
    fetched = torch.load(probe / f"rank{rank}.pt", weights_only=True)["indices"]
    return [i for batch in fetched[TRAIN] for i in batch]


def test_sampler_gives_disjoint_shares_that_cover_the_set_and_reshuffle(runs):
    per_rank = [train_indices(runs["03"]["probe"], rank) for rank in range(2)]
    share = TRAIN // 2
    for epoch in range(2):
        shares = [set(indices[epoch * share:(epoch + 1) * share]) for indices in per_rank]
        assert len(shares[0]) == len(shares[1]) == share
        assert not shares[0] & shares[1]
        assert shares[0] | shares[1] == set(range(TRAIN))
    first, second = per_rank[0][:share], per_rank[0][share:]
    assert first != second  # set_epoch: a new order each epoch
    # the same seed repeats the order (step 02 draws it exactly as step 03 does)
    assert train_indices(runs["02"]["probe"], 0) == per_rank[0]


# ---------------------------------------------------------------- exact evaluation
def evaluated_in_one_process(checkpoint, mnist_root) -> dict:
    """The saved model evaluated here, in this one process, over the whole test set."""
    from torchvision.datasets import MNIST

    test = MNIST(mnist_root, train=False)
    model = build_model(SimpleNamespace(dropout=False), seed=0)
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    loader = torch.utils.data.DataLoader(common.Digits(test.data, test.targets), batch_size=1000)
    return common.test_results(common.test_sums(model, loader, common.Run(torch.device("cpu"))))


@pytest.mark.quick
@pytest.mark.parametrize("name, ranks", [("two_ranks", 2), ("three_ranks", 3)])
def test_evaluation_counts_every_test_sample_exactly_once(runs, mnist_root, name, ranks):
    """What N ranks report for the model they end with, each rank evaluating its own share,
    is what one process computes for that model over the whole test set (299 samples: a prime,
    so the shares are uneven on any world size)."""
    distributed = runs[name]["summary"]
    single = evaluated_in_one_process(runs[name]["out"] / "checkpoint.pt", mnist_root)
    assert distributed["world_size"] == ranks
    assert distributed["test_samples"] == TEST_SAMPLES == single["samples"]
    assert distributed["test_correct"] == single["correct"]
    assert distributed["test_loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert 0 < single["correct"] < TEST_SAMPLES  # not trivially 0 or all


# ---------------------------------------------------------------- what a learner sees
def test_progress_inside_an_epoch_from_rank_0_only_without_carriage_returns(runs):
    """Output that is not a terminal (here a pipe, as in SLURM logs) gets plain progress lines
    at a steady pace: 10 steps per epoch, a line per tenth, each step once, from rank 0 alone."""
    stdout = runs["03"]["stdout"]
    assert "\r" not in stdout
    for epoch in (1, 2):
        steps = [int(n) for n in re.findall(rf"^epoch {epoch}: step (\d+)/10 \(\d+%\), "
                                            rf"[\d,]+ samples/s, loss \d+\.\d+$", stdout, re.M)]
        assert steps == sorted(set(steps)) and len(steps) >= 5, stdout  # once each: one rank
        assert max(steps) < 10  # the epoch's own line follows instead of "10/10"
    assert "epoch 1: step" not in runs["one_process"]["stdout"]  # --quiet


# ---------------------------------------------------------------- where compile breaks
GRAPH_BREAKS = """
import os, sys, torch, torch.distributed as dist, torch._dynamo
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP
sys.path.insert(0, os.getcwd())
from harness.model import Net
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
dist.init_process_group("gloo", rank=0, world_size=1)
for order in ("compile the wrapper", "wrap the compiled model"):
    torch._dynamo.reset(); counters.clear()
    model = Net()
    if order == "compile the wrapper":
        model = torch.compile(DDP(model), backend="eager")
    else:
        model = DDP(torch.compile(model, backend="eager"))
    for _ in range(2):
        model(torch.randn(4, 1, 28, 28)).sum().backward()
    print(f"{order}: {sum(counters['graph_break'].values())} graph breaks")
dist.destroy_process_group()
"""


def test_compiling_the_wrapper_breaks_the_graph_in_ddp_compiling_inside_does_not(tmp_path):
    """What 04's docstring says: torch.compile(DDP(model)) traces DDP's own forward and breaks
    the graph there; DDP(torch.compile(model)), what 04 does, does not. (Dynamo's "eager"
    backend: the same graphs and breaks as inductor, without generating code.)"""
    proc = launch([sys.executable, "-c", GRAPH_BREAKS])
    breaks = dict(re.findall(r"^(.*): (\d+) graph breaks$", proc.stdout, re.M))
    assert int(breaks["compile the wrapper"]) > 0, proc.stdout
    assert int(breaks["wrap the compiled model"]) == 0, proc.stdout


def test_a_copied_step_runs_without_the_harness_and_trains_the_same(runs, mnist_root,
                                                                    tmp_path):
    """02, 02b, 03, 04 and 05, each copied with common.py into an empty folder, run on 2 ranks
    without harness/ (their output has no FLOP rate, which only the harness prints; 04 and 05
    with --quiet, which leaves out the progress lines the others print), read MNIST and end with
    the test loss and accuracy the repository's 03 ends with, one epoch without dropout (02 = 03
    bit for bit on 2 ranks; 04 on the CPU does not compile by default, and 05 is 04 started on
    many nodes)."""
    folder = tmp_path / "copied"
    scripts = ["02_manual_ddp.py", "02b_overlap_by_hand.py", "03_ddp_wrapper.py",
               "04_ddp_compile.py", "05_multinode.py"]
    copy_out(scripts, folder)
    expected = runs["two_ranks"]["summary"]
    for script in scripts:
        out, quiet = tmp_path / script, ["--quiet"] if script[:2] in ("04", "05") else []
        proc = launch(torchrun_cmd(2, script, *COMMON, "--data-dir", mnist_root, "--epochs", 1,
                                   "--no-dropout", *quiet, "--out-dir", out), cwd=folder)
        assert "FLOP/s" not in proc.stdout and "test accuracy" in proc.stdout, proc.stdout
        assert (": step " in proc.stdout) != bool(quiet), proc.stdout  # --quiet: no progress
        copied = read_summary(out)
        assert (copied["test_loss"], copied["test_accuracy"]) == (
            expected["test_loss"], expected["test_accuracy"]), script


