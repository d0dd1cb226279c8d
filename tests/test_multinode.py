"""Issue 13: step 05 across two "nodes" on one machine, the rehearsal the README describes.

Two torchrun agents, one worker each, meet at a c10d endpoint on loopback, exactly as two
machines would (with c10d the agents number the nodes themselves; no --node-rank). The SLURM
tests (test_slurm.py) run the same step across two slurmd nodes.
"""

import socket
import subprocess
import sys

from conftest import REPO, base_env, max_difference, rank_params, read_summary, run_step

ARGS = ["--no-compile", "--data", "mnist", "--train-samples", 480, "--test-samples", 100,
        "--batch-size", 48, "--epochs", 1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_agents_on_loopback_form_one_world(mnist_root, tmp_path):
    out = tmp_path / "two_nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "rehearsal",
             "--rdzv-endpoint", endpoint, "tests/rank_probe.py", "05_multinode.py",
             *map(str, ARGS), "--data-dir", str(mnist_root), "--out-dir", str(out)]
    (out / "probe").mkdir(parents=True)
    # The probe records each rank's final weights. One thread per rank in both runs: torchrun
    # sets that for 2 processes per node but not for 1, and another thread count sums the
    # convolutions in another order (weights then differ by ~1e-8).
    env = base_env(PROBE_DIR=out / "probe", OMP_NUM_THREADS=1)
    nodes = [subprocess.Popen(agent, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n---\n".join(outputs)

    summary = read_summary(out)
    assert (summary["world_size"], summary["nodes"]) == (2, 2)
    printed = "".join(outputs)  # rank 0 runs in whichever agent the rendezvous made node 0
    assert "[node 0 " in printed and "rank 0/2 local rank 0" in printed
    assert "[node 1 " in printed and "rank 1/2 local rank 0" in printed

    # The same job on one node with two processes computes the same thing.
    one_node = tmp_path / "one_node"
    run_step("05_multinode.py", [*ARGS, "--data-dir", mnist_root, "--out-dir", one_node], nproc=2,
             probe_dir=one_node / "probe", env_extra={"OMP_NUM_THREADS": 1})
    alone = read_summary(one_node)
    assert alone["nodes"] == 1
    for rank in (0, 1):
        assert max_difference(rank_params(out / "probe", rank),
                              rank_params(one_node / "probe", rank)) == 0.0
    assert summary["train_losses"] == alone["train_losses"]
    assert summary["test_correct"] == alone["test_correct"]
