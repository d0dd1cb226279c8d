"""The SLURM templates in slurm/, checked statically and run on a real two-node SLURM cluster.

The cluster (tests/slurm_cluster.py) runs slurmctld and two slurmd, "n1" and "n2", on this
machine; it is installed with apt when missing, and the tests skip (saying why) where that cannot
work. The jobs run the tutorial's own steps on tiny synthetic data, the way a user submits them
(`sbatch slurm/multinode.sh 05_multinode.py ...` from the repository root). All of them are
submitted at once and queue, as on a cluster: each node has 2 CPUs, so one job runs at a time;
each test waits for its own job and reads the job's log and summary.json.
"""

import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    from slurm_cluster import SlurmCluster, SlurmUnavailable, ensure_apt_packages
except ImportError:  # tests/ made a package
    from tests.slurm_cluster import SlurmCluster, SlurmUnavailable, ensure_apt_packages

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "slurm").glob("*.sh"))
TINY = ["--data", "synthetic", "--train-samples", "480", "--test-samples", "100",
        "--batch-size", "48", "--epochs", "1"]
# Variables from the caller's shell that would change what the scripts or the steps do.
CLEAN = {key: None for key in ["NPROC_PER_NODE", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE",
                               "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]}
# Several jobs share two cores: generous, but a hang still fails well before the time limit.
JOB_TIMEOUT = 240


# ----------------------------------------------------------------------------- static checks
def test_shellcheck():
    try:
        ensure_apt_packages(["shellcheck"], "shellcheck")
    except SlurmUnavailable as exc:
        pytest.skip(f"shellcheck unavailable: {exc}")
    assert SCRIPTS, "no slurm/*.sh"
    proc = subprocess.run(["shellcheck", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_header(script):
    """#SBATCH lines are read only before the first command, and "# SBATCH" is never one."""
    text = script.read_text()
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    first_command = next(i for i, line in enumerate(lines)
                         if line.strip() and not line.lstrip().startswith("#"))
    assert lines[first_command] == "set -euo pipefail"
    assert not any(line.startswith("#SBATCH") for line in lines[first_command:])
    assert not any(re.match(r"#\s+SBATCH\b", line) for line in lines)
    header = [line for line in lines[:first_command] if line.startswith("#SBATCH")]
    # One task per node: that task is the node's one torchrun agent.
    tasks = [line for line in header if "--ntasks" in line]
    assert tasks in (["#SBATCH --ntasks-per-node=1"], ["#SBATCH --ntasks=1"]), tasks
    assert any(line.startswith("#SBATCH --output=") and "%j" in line for line in header)
    # srun does not inherit --cpus-per-task since SLURM 22.05; threads follow the cores.
    assert 'export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK' in text
    assert "export OMP_NUM_THREADS=" in text
    assert "srun --kill-on-bad-exit=1 torchrun" in text
    if script.name != "singlenode.sh":
        for flag in ['--nnodes "$SLURM_NNODES"', "--rdzv-backend c10d",
                     '--rdzv-id "$SLURM_JOB_ID"', '--rdzv-endpoint "$HEAD_ADDR:$PORT"']:
            assert flag in text, flag
    if script.name != "check.sh":
        # Off until step 07 turns it on; the cluster variations stay commented out too.
        assert "##SBATCH --signal=B:USR2@120" in lines[:first_command]
        for variation in ["##SBATCH --account=", "##SBATCH --partition=",
                          "##SBATCH --gpus-per-node=", "# module load", "$SLURM_TMPDIR/env"]:
            assert variation in text, variation


BAD_COUNTS = [("NPROC_PER_NODE", "0", 1), ("NPROC_PER_NODE", "two", 1),
              ("NPROC_PER_NODE", "08", 1), ("MAX_REQUEUES", "-1", 0), ("MAX_REQUEUES", "x", 0)]


# Each script with each count it reads (check.sh never requeues: no MAX_REQUEUES).
SCRIPT_COUNTS = [pytest.param(script, name, value, lowest, id=f"{name}={value}-{script.name}")
                 for script in SCRIPTS for name, value, lowest in BAD_COUNTS
                 if name in script.read_text()]


@pytest.mark.parametrize("script, name, value, lowest", SCRIPT_COUNTS)
def test_a_bad_count_is_one_line_before_anything_runs(script, name, value, lowest, tmp_path):
    """Issue 39, 13: NPROC_PER_NODE=0 was bash's "division by 0", NPROC_PER_NODE=two its
    "unbound variable", a bad MAX_REQUEUES an error inside the USR2 trap. No cluster needed:
    the check comes before the first SLURM command (in a folder without .venv)."""
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "1", name: value},
                          timeout=30)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr == (f"error: {name}={value} is not allowed: it must be a whole number "
                           f"(digits, no leading 0) of at least {lowest}\n"), proc.stderr


# ----------------------------------------------------------------------------- on the cluster
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """One cluster for the module, 2 CPUs per node: every job below asks for both of a node's,
    so the jobs run one at a time. With room for all five at once (10 per node), their ~20
    fresh processes starved the test file beside them: run beside test_ddp.py, its first item
    took 36 s (11 s with the jobs in turn) and SLURM's first job 61 s. In turn, no item of the
    two files took over 42 s, and they ended as soon (122 s against 125 s; 2-core VM, torch
    2.14.1)."""
    try:
        cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm-cluster"))
    except SlurmUnavailable as exc:
        pytest.skip(f"SLURM test cluster unavailable: {exc}")
    yield cluster
    cluster.stop()


@dataclass
class Job:
    cluster: SlurmCluster
    id: int
    folder: Path  # the job's log is <folder>/job.out, the step's --out-dir <folder>/out

    def finish(self):
        """Wait until the job has ended; returns (scontrol's fields, the job's log)."""
        info = self.cluster.wait(self.id, timeout=JOB_TIMEOUT)
        log_path = self.folder / "job.out"
        return info, (log_path.read_text() if log_path.exists() else "(no log)")

    def completed(self):
        """The log of a job that must have COMPLETED with exit code 0."""
        info, log = self.finish()
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (
            f"{info}\n--- job log\n{log}\n--- daemons\n{self.cluster.logs()}")
        return info, log

    def summary(self):
        return json.loads((self.folder / "out" / "summary.json").read_text())


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory):
    """Submit every job now: the cluster runs them in turn while each test waits for its own."""
    root = tmp_path_factory.mktemp("slurm-jobs")

    def submit(name, sbatch_args, step_args=(), **env):
        folder = root / name
        folder.mkdir()
        out = ["--out-dir", str(folder / "out")] if step_args else []
        job_id = slurm.sbatch([f"--output={folder}/job.out", *sbatch_args, *step_args, *out],
                              cwd=REPO, env_extra={**CLEAN, **env})
        return Job(slurm, job_id, folder)

    return {
        # (a) Two nodes, one torchrun each, one CPU worker each: world size 2.
        "multinode": submit("multinode", ["--nodes=2", "slurm/multinode.sh"],
                            ["05_multinode.py", "--no-compile", *TINY], NPROC_PER_NODE=1),
        # (b) One node, the default of 2 CPU workers.
        "singlenode": submit("singlenode", ["slurm/singlenode.sh"],
                             ["03_ddp_wrapper.py", *TINY]),
        # (c) srun without torchrun, 2 tasks on each of 2 nodes: 05's use_srun_identity()
        #     turns SLURM's variables into ranks, and finds the first node's address itself.
        "srun": submit("srun", ["--nodes=2", "--ntasks-per-node=2", "--wrap",
                                "srun python 05_multinode.py --no-compile "
                                + " ".join(TINY) + f" --out-dir {root / 'srun' / 'out'}"]),
        # (d) The sanity check, 2 workers per node: 4 ranks over 2 nodes.
        "check": submit("check", ["slurm/check.sh"], NPROC_PER_NODE=2),
        # (e) A step that fails on every rank (no MNIST there): the job must end, FAILED.
        "fails": submit("fails", ["--nodes=2", "slurm/multinode.sh"],
                        ["05_multinode.py", "--no-compile", "--data", "mnist",
                         "--data-dir", "/nonexistent", "--epochs", "1"], NPROC_PER_NODE=1),
    }


def topology(log):
    """05_multinode.py's "[node N host] rank R/W local rank L on DEV" lines as (N, R, W, L)."""
    return sorted(
        (int(node), int(rank), int(world), int(local))
        for node, rank, world, local in re.findall(
            r"^\[node (\d+) \S+\] rank (\d+)/(\d+) local rank (\d+) on \S+$", log, re.M))


def test_multinode(jobs):
    info, log = jobs["multinode"].completed()
    assert info["NodeList"] == "n[1-2]"
    summary = jobs["multinode"].summary()
    assert (summary["world_size"], summary["nodes"]) == (2, 2), summary
    # One line per rank, each on its own node: two agents met and numbered the nodes 0 and 1.
    assert topology(log) == [(0, 0, 2, 0), (1, 1, 2, 0)], log
    # The node names do not resolve here: the endpoint must be n1's NodeAddr, not "n1".
    assert re.search(r"rendezvous at 127\.0\.0\.1:\d+", log), log
    # The job's 2 cores per node, for 1 worker per node: 2 threads each.
    assert "OMP_NUM_THREADS=2" in log and "threads/rank=2" in log, log


def test_singlenode(jobs):
    info, log = jobs["singlenode"].completed()
    assert info["NodeList"] in ("n1", "n2")
    summary = jobs["singlenode"].summary()
    assert summary["world_size"] == 2, summary
    # The default without GPUs: 2 CPU workers sharing the job's 2 cores, 1 thread each.
    assert "x 2 workers, OMP_NUM_THREADS=1" in log and "threads/rank=1" in log, log


def test_srun_without_torchrun(jobs):
    info, log = jobs["srun"].completed()
    assert info["NodeList"] == "n[1-2]"
    summary = jobs["srun"].summary()
    assert (summary["world_size"], summary["nodes"]) == (4, 2), summary
    # SLURM_PROCID -> rank, SLURM_LOCALID -> local rank, SLURM_NODEID -> node.
    assert topology(log) == [(0, 0, 4, 0), (0, 1, 4, 1), (1, 2, 4, 0), (1, 3, 4, 1)], log


def test_check(jobs):
    info, log = jobs["check"].completed()
    assert info["NodeList"] == "n[1-2]"
    # One line per node from the srun --label step: its SLURM name, host, cores and torch.
    nodes = re.findall(r"^(\d): (n\d) \S+ cpus \d+ torch \S+ cuda (?:True|False) \d+", log, re.M)
    assert sorted(nodes) == [("0", "n1"), ("1", "n2")], log
    # Every one of the 2 x 2 ranks took part in the all-reduce: 1 + 2 + 3 + 4 = 10.
    ranks = re.findall(r"^rank (\d)/4 all_reduce\(sum\) .* after=\[10, 100\]$", log, re.M)
    assert sorted(ranks) == ["0", "1", "2", "3"], log
    assert log.rstrip().endswith("--- check passed"), log


def test_failing_step_fails_the_job(jobs):
    info, log = jobs["fails"].finish()  # it ends at all: no rank is left waiting for the others
    assert info["JobState"] == "FAILED", f"{info}\n{log}"
    # Our one-line message, once (rank 0 prints it for everyone), before torchrun's own report.
    errors = re.findall(r"^error: MNIST not found in /nonexistent\S* .*$", log, re.M)
    assert len(errors) == 1, log
    assert not (jobs["fails"].folder / "out" / "summary.json").exists()


def test_usr2_checkpoints_requeues_and_the_job_resumes(slurm, tmp_path):
    """The time-limit warning (what `--signal=B:USR2@120` sends, delivered here by scancel):
    step 07 stops at a checkpoint, the job requeues itself and the second run resumes."""
    out = tmp_path / "out"
    args = ["07_fault_tolerance.py", "--no-compile", "--data", "synthetic", "--train-samples",
            "960", "--test-samples", "100", "--batch-size", "48", "--epochs", "2",
            "--checkpoint-every", "4", "--out-dir", str(out)]
    job = Job(slurm, slurm.sbatch([f"--output={tmp_path}/job.out", "--nodes=2",
                                   "slurm/multinode.sh", *args],
                                  cwd=REPO, env_extra={**CLEAN, "NPROC_PER_NODE": "1",
                                                        "OMP_NUM_THREADS": "1"}),
              tmp_path)
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (out / "checkpoint.pt").exists():  # training has started
        assert time.monotonic() < deadline and slurm.job(job.id).get("JobState") in (
            "PENDING", "RUNNING"), job.finish()
        time.sleep(0.1)
    slurm.run("scancel", "--signal=USR2", "--batch", job.id)
    # SLURM holds a requeued job back until its old credentials expire (cred_expire, 5 s in
    # the test cluster; 120 s by default), so that no node still running the old one starts it.
    info, log = job.completed()
    assert info["Restarts"] == "1", info
    assert "USR2: time limit or preemption near" in log, log
    assert re.search(r"^stopping at step \d+ of epoch \d \(SIGTERM\): checkpoint saved", log,
                     re.M), log
    assert re.search(r"^resumed at step \d+ of epoch \d$", log, re.M), log
    assert job.summary()["epochs"] == 2 and job.summary()["world_size"] == 2
