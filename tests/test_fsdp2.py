"""Steps 08a, 08b and 08: the model built on the meta device under DDP is 07's to the bit (08a);
FSDP2 trains like DDP, shards what each rank holds, resumes a killed rank exactly from its
one-file checkpoint (which a plain Net and step 00 load), evaluates on more ranks than test
samples (08b), and shards within nodes with --hsdp (08).

The runs are 2 epochs of 20 steps (conftest.RESTART_ARGS); a run's weights are read back from
its checkpoint.pt, a plain file written by rank 0 from the state gathered from every shard.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import (PORT_TAKEN_RERUNS, REPO, RESTART_ARGS, base_env,
                      copied_run_killed_at_step_27, launch, output, read_summary, run_id, run_step,
                      start, torchrun_cmd)
from harness.model import Net

STEP, SHARD = "08_fsdp2.py", "08b_fsdp2_shard.py"


def saved_weights(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", weights_only=True)["model"]


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def straight(mnist_root, tmp_path_factory):
    """08 on 2 ranks for 2 epochs, never interrupted."""
    out = tmp_path_factory.mktemp("fsdp2")
    proc = run_step(STEP, [*RESTART_ARGS, "--data-dir", mnist_root, "--out-dir", out], nproc=2)
    return {"out": out, "stdout": proc.stdout}


def test_fsdp2_ends_with_the_weights_of_ddp(straight, uninterrupted_07):
    """Same seed, same data, dropout on: FSDP2 averages gradients by reduce-scatter where DDP
    all-reduces; on 2 ranks both divide by a power of two, and the result is bit-identical.
    (The model was built on the meta device and filled from rank 0's copy.)"""
    ddp = torch.load(uninterrupted_07 / "checkpoint.pt", weights_only=True)["model"]
    assert max_difference(saved_weights(straight["out"]), ddp) == 0.0
    assert read_summary(straight["out"])["train_losses"] == pytest.approx(
        read_summary(uninterrupted_07)["train_losses"], rel=1e-12)


def test_the_model_built_on_the_meta_device_under_ddp_is_07s(uninterrupted_07, mnist_root,
                                                            tmp_path):
    """08a: only rank 0 computes the initial weights, broadcast into every rank's uninitialised
    memory; 07's run, in which every rank computed them and DDP kept rank 0's, is the same."""
    run_step("08a_meta_device.py", [*RESTART_ARGS, "--data-dir", mnist_root, "--out-dir",
                                    tmp_path], nproc=2)
    ddp = torch.load(uninterrupted_07 / "checkpoint.pt", weights_only=True)["model"]
    assert max_difference(saved_weights(tmp_path), ddp) == 0.0
    assert read_summary(tmp_path)["train_losses"] == read_summary(uninterrupted_07)["train_losses"]


def test_each_rank_holds_half_of_the_parameters(straight):
    summary = read_summary(straight["out"])
    total = sum(p.numel() for p in Net().parameters())
    assert summary["params_total"] == total == 1_199_882
    assert summary["params_per_rank"] == [total // 2, total // 2]  # every tensor's rows split
    assert summary["optimizer_state_per_rank"] == summary["params_per_rank"]  # SGD momentum
    assert "each rank holds 599,941 of the 1,199,882 parameters" in straight["stdout"]
    assert len(summary["peak_memory_mib"]) == 2 and min(summary["peak_memory_mib"]) > 0


@PORT_TAKEN_RERUNS
def test_a_killed_rank_is_restarted_from_the_gathered_checkpoint_exactly(straight, mnist_root,
                                                                        tmp_path):
    """Rank 1 dies after step 27 (step 7 of epoch 2); the last checkpoint, at step 4 of epoch
    2, holds whole tensors that each rank of the restarted group splits into its shards again;
    the run ends bit-identical to the uninterrupted one. (08b: 08 saves and resumes alike.)"""
    proc = run_step(SHARD, [*RESTART_ARGS, "--data-dir", mnist_root, "--out-dir", tmp_path],
                    nproc=2, probe_dir=tmp_path / "probe",
                    env_extra={"PROBE_KILL": "1:27", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": 1},
                    torchrun_extra=("--max-restarts", "1"))
    assert "resumed at step 4 of epoch 2" in proc.stdout, proc.stdout[-3000:]
    assert max_difference(saved_weights(tmp_path), saved_weights(straight["out"])) == 0.0
    assert (read_summary(tmp_path)["train_losses"]
            == pytest.approx(read_summary(straight["out"])["train_losses"][1:], rel=1e-12))


@PORT_TAKEN_RERUNS
def test_a_copied_08_killed_and_restarted_ends_as_the_uninterrupted_run(straight, mnist_root,
                                                                        tmp_path):
    """08 and common.py in an empty folder, without harness/: its plain gathered save and its
    resume into shards carry a run killed at step 7 of epoch 2 to the repository's
    uninterrupted test loss and accuracy."""
    proc = copied_run_killed_at_step_27(STEP, [*RESTART_ARGS, "--data-dir", mnist_root],
                                        tmp_path)
    assert "resumed at step 4 of epoch 2" in proc.stdout, proc.stdout
    assert "FLOP/s" not in proc.stdout and "test accuracy" in proc.stdout, proc.stdout
    copied, straight = read_summary(tmp_path / "out"), read_summary(straight["out"])
    assert (copied["test_loss"], copied["test_accuracy"]) == (straight["test_loss"],
                                                              straight["test_accuracy"])


def test_the_checkpoint_is_a_plain_one_that_step_00_evaluates_the_same(straight, mnist_root,
                                                                       tmp_path):
    plain = torch.load(straight["out"] / "checkpoint.pt", weights_only=True)
    model = Net()
    model.load_state_dict(plain["model"])  # strict: the keys of a plain Net, no prefixes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(plain["optimizer"])  # numbered, as a plain optimizer saves it
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"],
                           plain["optimizer"]["state"][i]["momentum_buffer"])
               for i, p in enumerate(model.parameters()))
    # Step 00, resumed at its last epoch, only evaluates: the same test set, the same answers.
    run_step("00_single_gpu.py", ["--data", "mnist", "--data-dir", mnist_root, "--epochs", 2,
                                  "--resume", straight["out"] / "checkpoint.pt",
                                  "--out-dir", tmp_path])
    assert read_summary(tmp_path)["test_correct"] == read_summary(straight["out"])["test_correct"]


def test_fewer_test_samples_than_ranks_evaluates_without_a_hang(tmp_path):
    """Rank 2 of 3 has no test sample, yet every forward is a collective (an all-gather): it
    runs a blank one that counts nothing, so the others are not left waiting. (08b; 08 alike.)"""
    run_step(SHARD, ["--data", "synthetic", "--train-samples", 96, "--test-samples", 2,
                    "--batch-size", 48, "--epochs", 1, "--checkpoint-every", 0,
                    "--out-dir", tmp_path], nproc=3, timeout=120)
    summary = read_summary(tmp_path)
    assert (summary["world_size"], summary["test_samples"]) == (3, 2)


def test_hybrid_sharding_on_two_agents_shards_within_each_node(mnist_root, tmp_path):
    """--hsdp on 2 "nodes" (torchrun agents on loopback) x 2 ranks: a 2-D mesh, replicated
    across the nodes, sharded within each. --mixed-precision is asked for, and declined with one
    note, as --amp is: a CPU has no native bf16 (test_gpu.py proves bf16 on a GPU)."""
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-id", run_id(),
             "--rdzv-endpoint", f"127.0.0.1:{port}", STEP, "--hsdp", "--mixed-precision",
             "--data", "mnist", "--data-dir", str(mnist_root), "--train-samples", 480,
             "--batch-size", 48, "--epochs", 1, "--checkpoint-every", 0, "--out-dir",
             str(tmp_path)]
    nodes = [start(agent, open(tmp_path / f"node{n}.txt", "w+"),
                   env=base_env(OMP_NUM_THREADS=1)) for n in range(2)]
    outputs = [output(node, timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n---\n".join(outputs)
    summary = read_summary(tmp_path)
    assert (summary["world_size"], summary["nodes"]) == (4, 2)
    assert summary["params_per_rank"] == [1_199_882 // 2] * 4  # sharded over 2, not 4
    assert "note: --mixed-precision needs a GPU with native bf16" in "".join(outputs)
    assert "mixed_precision=off" in "".join(outputs)
    assert summary["test_accuracy"] > 0.3  # it learns (chance: 0.1)


def test_gradient_clipping_sees_every_shard_and_refuses_a_parameter_left_out(tmp_path):
    """clip_grad_norm_ on FSDP2's DTensor gradients computes the norm of the WHOLE gradient
    (each rank's shard norms are combined by a collective), so a sharded model clips as the
    whole one does. The two float32 norms differ in their last digits: the whole model sums
    fc1's 1.2 M squares in one reduction, the sharded one in two halves (measured: 2.8e-5 and
    0.9e-5 from the float64 norm). A parameter left out of fully_shard stays a plain tensor
    among DTensors, and the norm refuses the mix."""
    launch(torchrun_cmd(2, REPO / "tests" / "clip_probe.py", tmp_path))
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["gradient_difference"] == 0.0  # the same gradients, sharded or not
        assert result["float64_norm"] > 0.5  # clipping did scale the gradients
        for norm in result["whole_norm"], result["sharded_norm"]:
            assert norm == pytest.approx(result["float64_norm"], rel=1e-4)  # float32 sums
        assert result["clipped_norm"] == pytest.approx(0.5, rel=1e-4)
        assert "mixed torch.Tensor and DTensor" in result["left_out_error"]
