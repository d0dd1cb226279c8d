"""Step 03b, ZeRO by hand: each rank keeps and updates only its 1/N of the optimizer state, and
ends with the weights of step 03 (DDP, the whole state on every rank), bit for bit on 2 ranks;
torch's ZeroRedundancyOptimizer beside it does too; a checkpoint resumes exactly, on the same
and on another world size, in 03's own format; each rank holds 1/N of 03's momentum."""

from __future__ import annotations

import pytest
import torch

from conftest import read_summary, run_step

# 4 steps an epoch, 2 epochs; a global batch that 2 and 3 ranks divide. No dropout: a rank's
# masks depend on its rank, so only without them do 2 and 3 ranks train the same thing.
SMALL = ["--data", "synthetic", "--train-samples", 384, "--test-samples", 96, "--batch-size", 96,
         "--no-dropout", "--quiet"]
RUNS = {  # name: (step, ranks, flags)
    "03": ("03_ddp_wrapper.py", 2, []),
    "zero1": ("03b_sharded_optimizer.py", 2, []),
    "torch": ("03b_sharded_optimizer.py", 2, ["--zero", "torch"]),
    "first epoch": ("03b_sharded_optimizer.py", 2, ["--epochs", 1]),
    "zero2 resumed": ("03b_sharded_optimizer.py", 2, ["--zero", 2, "--resume", "first epoch"]),
    "03 on 3": ("03_ddp_wrapper.py", 3, []),
    "02 on 3": ("02_manual_ddp.py", 3, []),
    "zero1 on 3": ("03b_sharded_optimizer.py", 3, []),
    "zero2 on 3 resumed": ("03b_sharded_optimizer.py", 3, ["--zero", 2, "--resume",
                                                           "first epoch"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each run's stdout, saved checkpoint and summary.json."""
    root, done = tmp_path_factory.mktemp("zero"), {}
    for name, (script, ranks, flags) in RUNS.items():
        out = root / name.replace(" ", "-")
        flags = [root / "first-epoch" / "checkpoint.pt" if f == "first epoch" else f
                 for f in flags]
        epochs = [] if "--epochs" in flags else ["--epochs", 2]
        proc = run_step(script, [*SMALL, *epochs, *flags, "--out-dir", out], nproc=ranks)
        saved = torch.load(out / "checkpoint.pt", weights_only=True)
        done[name] = (proc.stdout, saved, read_summary(out))
    return done


def weights(run) -> list[torch.Tensor]:
    return list(run[1]["model"].values())


def momenta(run) -> list[torch.Tensor]:
    state = run[1]["optimizer"]["state"]
    return [state[k]["momentum_buffer"] for k in sorted(state)]


def largest_difference(a: list, b: list) -> float:
    assert len(a) == len(b) and a
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_on_2_ranks_zero_by_hand_and_torchs_end_with_03s_weights_bit_for_bit(runs):
    """2 ranks: a + b is exact in any order, and halving is exact, so the reduce-scatter sums
    what DDP's all-reduce sums: the same weights and the same momentum, to the last bit."""
    for name in ("zero1", "torch"):
        assert largest_difference(weights(runs[name]), weights(runs["03"])) == 0, name
        assert largest_difference(momenta(runs[name]), momenta(runs["03"])) == 0, name


def test_a_checkpoint_resumes_exactly_and_is_03s_own_format(runs):
    """1 epoch of ZeRO-1, then --resume with ZeRO-2 for the second: 03's weights and momentum
    bit for bit. The saved optimizer state is gathered into 03's format: the same entries."""
    resumed = runs["zero2 resumed"]
    assert "resumed from" in resumed[0]
    assert largest_difference(weights(resumed), weights(runs["03"])) == 0
    assert largest_difference(momenta(resumed), momenta(runs["03"])) == 0
    ours, ddps = runs["zero1"][1]["optimizer"], runs["03"][1]["optimizer"]
    assert sorted(ours["state"]) == sorted(ddps["state"])
    assert ours["param_groups"][0].keys() == ddps["param_groups"][0].keys()
    assert ours["param_groups"][0]["params"] == ddps["param_groups"][0]["params"]


def test_on_3_ranks_within_what_the_order_of_a_sum_moves(runs):
    """3 ranks: a + b + c rounds differently in another order, and over 8 steps such a last bit
    grows. The bound is measured here: two runs known to compute the same thing, differing
    only in the order of the sums (02 against 03 on 3 ranks; 03 on 2 ranks against 3), at most
    10 times their difference, or 10 float32 ulps of the largest weight. ZeRO-1 on 3 ranks,
    and ZeRO-2 resumed on 3 ranks from a checkpoint written on 2, stay within it."""
    controls = [largest_difference(weights(runs["02 on 3"]), weights(runs["03 on 3"])),
                largest_difference(weights(runs["03"]), weights(runs["03 on 3"]))]
    largest = max(w.abs().max().item() for w in weights(runs["03"]))
    bound = 10 * max(*controls, largest * torch.finfo(torch.float32).eps)
    for name, against in (("zero1 on 3", "03 on 3"), ("zero2 on 3 resumed", "03")):
        difference = largest_difference(weights(runs[name]), weights(runs[against]))
        print(f"\n{name}: {difference:.3g} from {against} (controls {controls}, bound {bound:.3g})")
        assert difference <= bound, (name, difference, controls)


def test_each_rank_holds_1_over_n_of_03s_momentum(runs):
    """Rank 0's optimizer state, in summary.json: its slice of each bucket, padded to divide by N
    (ZeRO-1: one bucket of all parameters; ZeRO-2: a bucket per parameter)."""
    numels = [w.numel() for w in weights(runs["03"])]
    for name, ranks, buckets in (("zero1", 2, [sum(numels)]), ("zero1 on 3", 3, [sum(numels)]),
                                 ("zero2 resumed", 2, numels)):
        stdout, _, summary = runs[name]
        assert summary["optimizer_state_bytes_unsharded"] == 4 * sum(numels)
        assert summary["optimizer_state_bytes"] == 4 * sum(-(-n // ranks) for n in buckets)
        share = summary["optimizer_state_bytes"] / summary["optimizer_state_bytes_unsharded"]
        assert f"rank 0 holds {share:.1%} of 03's optimizer state" in stdout, stdout
    # torch's shards whole parameters: one rank may hold most (fc1's weight is 98 % of all).
    assert runs["torch"][2]["optimizer_state_bytes"] <= 4 * sum(numels)
