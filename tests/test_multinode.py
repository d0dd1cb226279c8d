"""Issue 13: step 05 across two "nodes" on one machine, the rehearsal the README describes.

Two torchrun agents, one worker each, meet at a c10d endpoint on loopback, exactly as two
machines would (with c10d the agents number the nodes themselves; no --node-rank). The SLURM
tests (test_slurm.py) run the same step across two slurmd nodes.
"""

import re
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from conftest import (PORT_TAKEN_RERUNS, assert_no_traceback, base_env, max_difference, output,
                      rank_params, read_summary, run_id, run_step, start)

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
             "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", run_id(),
             "--rdzv-endpoint", endpoint, "tests/rank_probe.py", "05_multinode.py",
             *map(str, ARGS), "--data-dir", str(mnist_root), "--out-dir", str(out)]
    (out / "probe").mkdir(parents=True)
    # The probe records each rank's final weights. One thread per rank in both runs: torchrun
    # sets that for 2 processes per node but not for 1, and another thread count sums the
    # convolutions in another order (weights then differ by ~1e-8).
    env = base_env(PROBE_DIR=out / "probe", OMP_NUM_THREADS=1)
    # One "node" names its network interface for gloo, as a cluster's module file may: 05
    # reports such variables per rank, so a node set up differently shows.
    envs = [{**env, "GLOO_SOCKET_IFNAME": "lo"}, env]
    nodes = [start(agent, open(tmp_path / f"node{n}.txt", "w+"), env=node_env)
             for n, node_env in enumerate(envs)]
    outputs = [output(node, timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n---\n".join(outputs)

    summary = read_summary(out)
    assert (summary["world_size"], summary["nodes"]) == (2, 2)
    printed = "".join(outputs)  # rank 0 runs in whichever agent the rendezvous made node 0
    assert "[node 0 " in printed and "rank 0/2 local rank 0" in printed
    assert "[node 1 " in printed and "rank 1/2 local rank 0" in printed
    rank_lines = [line for line in printed.splitlines() if "/2 local rank 0 on cpu" in line]
    assert len(rank_lines) == 2, printed
    assert sum(line.endswith(" (GLOO_SOCKET_IFNAME=lo)") for line in rank_lines) == 1, rank_lines

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


@PORT_TAKEN_RERUNS
def test_a_rank_killed_on_one_of_two_agents_restarts_both_and_ends_exactly(mnist_root,
                                                                          tmp_path):
    """Step 07 across two agents with --max-restarts 1: rank 1 (on one "node") is SIGKILLed
    mid-epoch. Its agent restarts and counts the restart; the other agent restarts too, for a
    member that left, and does not count it (TORCHELASTIC_RESTART_COUNT stays 0 there). Both
    groups must still resume from the same checkpoint and end as an uninterrupted run."""
    args = [*ARGS, "--checkpoint-every", 4, "--epochs", 2]  # 10 steps per epoch
    out = tmp_path / "killed"
    (out / "probe").mkdir(parents=True)
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d",
             "--rdzv-id", run_id(), "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
             "tests/rank_probe.py", "07_fault_tolerance.py", *map(str, args),
             "--data-dir", str(mnist_root), "--out-dir", str(out)]
    env = base_env(PROBE_DIR=out / "probe", OMP_NUM_THREADS=1, PROBE_KILL="1:15",
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    nodes = [start(agent, open(tmp_path / f"node{n}.txt", "w+"), env=env) for n in range(2)]
    outputs = [output(node, timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n---\n".join(outputs)
    # Killed after step 15 = step 5 of epoch 2; the last checkpoint was at step 4 of epoch 2.
    assert "resumed at step 4 of epoch 2" in "".join(outputs)

    reference = tmp_path / "uninterrupted"
    run_step("07_fault_tolerance.py", [*args, "--data-dir", mnist_root, "--out-dir", reference],
             nproc=2, probe_dir=reference / "probe", env_extra={"OMP_NUM_THREADS": 1})
    for rank in (0, 1):
        assert max_difference(rank_params(out / "probe", rank),
                              rank_params(reference / "probe", rank)) == 0.0
    assert read_summary(out)["test_correct"] == read_summary(reference)["test_correct"]


def test_an_error_only_one_node_has_is_printed_there_and_the_other_names_it(mnist_root,
                                                                             tmp_path):
    """Issue 27 item 5: a --resume path that exists on one node only (here: each agent is given
    its own path, as two machines' disks would differ). The node that cannot find it says so,
    with its rank and host; the other one waits --timeout (5 s) for it and says which rank it
    waited for, instead of blaming a crashed peer."""
    good = tmp_path / "ok.pt"
    good.write_bytes(b"")  # exists: the flag check passes; never read, as the group never forms
    endpoint, launch = f"127.0.0.1:{free_port()}", run_id()

    def agent(resume):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", launch,
               "--rdzv-endpoint", endpoint, "05_multinode.py", *map(str, ARGS), "--timeout", 5,
               "--data-dir", mnist_root, "--out-dir", tmp_path / "out", "--resume", resume]
        return start(cmd, open(tmp_path / f"{Path(resume).stem}.txt", "w+"))

    # Node 0 first: the first agent hosts the rendezvous and, with the lower pid, becomes node 0,
    # whose agent hosts the workers' store. (Were node 0 the failing one, its agent would leave
    # with that store, and torchrun would stop node 1's worker itself.)
    nodes = [agent(good)]
    host, port = endpoint.split(":")
    while socket.socket().connect_ex((host, int(port))) != 0:
        assert nodes[0].poll() is None, output(nodes[0])
        time.sleep(0.05)
    nodes.append(agent(tmp_path / "only_on_the_other_node.pt"))
    outputs = [output(node, timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [1, 1], "\n---\n".join(outputs)
    waited, failed = ([line for line in output.splitlines() if line.startswith("error:")]
                      for output in outputs)
    assert len(failed) == 1 and "only_on_the_other_node.pt does not exist" in failed[0], outputs[1]
    rank = re.search(r"\(rank (\d) on \S+\)$", failed[0]).group(1)
    assert len(waited) == 1, outputs[0]
    assert f"waited 5 s (--timeout) for rank(s) {rank} to join" in waited[0], waited[0]
    for printed in outputs:  # (torchrun's own ChildFailedError traceback is allowed)
        assert_no_traceback(SimpleNamespace(stdout=printed, stderr=""))
