"""The SLURM templates in slurm/, checked statically and run on a real two-node SLURM cluster.

The cluster (tests/slurm_cluster.py) runs slurmctld and two slurmd, "n1" and "n2", on this
machine, 2 CPUs each. Every job runs tests/slurm_standin.py, which all-reduces ones over gloo and
writes one JSON report per rank; the tests read those reports.
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

try:
    from slurm_cluster import SlurmCluster, SlurmUnavailable, ensure_apt_packages
except ImportError:  # tests/ made a package
    from tests.slurm_cluster import SlurmCluster, SlurmUnavailable, ensure_apt_packages

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "slurm").glob("*.sh"))
STANDIN = "tests/slurm_standin.py"  # relative: jobs run in the repository root, as users do
# Variables from the caller's shell that would change what the scripts compute.
CLEAN = {"NPROC_PER_NODE": None, "OMP_NUM_THREADS": None}


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
    lines = script.read_text().splitlines()
    assert lines[0] == "#!/bin/bash"
    first_command = next(i for i, line in enumerate(lines)
                         if line.strip() and not line.lstrip().startswith("#"))
    assert not any(line.startswith("#SBATCH") for line in lines[first_command:])
    assert not any(re.match(r"#\s+SBATCH\b", line) for line in lines)
    assert "set -euo pipefail" in lines
    header = [line for line in lines[:first_command] if line.startswith("#SBATCH")]
    tasks = [line for line in header if "--ntasks" in line]
    assert tasks in (["#SBATCH --ntasks-per-node=1"], ["#SBATCH --ntasks=1"]), tasks


# ----------------------------------------------------------------------------- on the cluster
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    try:
        cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm-cluster"))
    except SlurmUnavailable as exc:
        pytest.skip(f"SLURM test cluster unavailable: {exc}")
    yield cluster
    cluster.stop()


def run_job(cluster, tmp_path, script, env_extra=None, timeout=90):
    """sbatch SCRIPT tests/slurm_standin.py --out-dir DIR; returns (job info, reports, log)."""
    out_dir = tmp_path / "ranks"
    job_id = cluster.sbatch(
        [f"--output={tmp_path}/%x-%j.out", script, STANDIN, "--out-dir", out_dir],
        cwd=REPO, env_extra={**CLEAN, **(env_extra or {})},
    )
    info = cluster.wait(job_id, timeout=timeout)
    log_path = tmp_path / f"{info['JobName']}-{job_id}.out"
    log = log_path.read_text() if log_path.exists() else "(no log)"
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (
        f"{info}\n--- job log\n{log}\n--- daemons\n{cluster.logs()}")
    reports = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    return info, reports, log


def test_singlenode(slurm, tmp_path):
    info, reports, log = run_job(slurm, tmp_path, "slurm/singlenode.sh")
    assert info["NodeList"] in ("n1", "n2")
    # Default without GPUs: 2 CPU processes, each with the 2 cores / 2 processes = 1 thread.
    assert sorted(r["rank"] for r in reports) == [0, 1], log
    assert {(r["world_size"], r["sum"]) for r in reports} == {(2, 2.0)}
    assert {r["SLURMD_NODENAME"] for r in reports} == {info["NodeList"]}
    assert {r["env"]["OMP_NUM_THREADS"] for r in reports} == {"1"}
    assert {r["env"]["SLURM_STEP_TASKS_PER_NODE"] for r in reports} == {"1"}  # one torchrun


def test_multinode(slurm, tmp_path):
    # One CPU process per node keeps this fast on two cores: world size 2 across 2 SLURM nodes.
    info, reports, log = run_job(slurm, tmp_path, "slurm/multinode.sh",
                                 env_extra={"NPROC_PER_NODE": 1})
    assert info["NodeList"] == "n[1-2]"
    assert sorted(r["rank"] for r in reports) == [0, 1], log
    assert {(r["world_size"], r["sum"]) for r in reports} == {(2, 2.0)}
    assert sorted(r["SLURMD_NODENAME"] for r in reports) == ["n1", "n2"]
    # One torchrun agent per node, started by one srun task per node.
    assert {r["env"]["SLURM_STEP_TASKS_PER_NODE"] for r in reports} == {"1(x2)"}
    assert sorted(r["env"]["SLURM_PROCID"] for r in reports) == ["0", "1"]
    # The node names do not resolve here: the endpoint must be n1's NodeAddr, not "n1".
    assert re.search(r"rendezvous at 127\.0\.0\.1:\d+", log), log
    # srun passed the job's 2 cores on to torchrun; 2 cores / 1 process = 2 threads.
    assert {r["env"]["SRUN_CPUS_PER_TASK"] for r in reports} == {"2"}
    assert {r["env"]["OMP_NUM_THREADS"] for r in reports} == {"2"}


def test_check(slurm, tmp_path):
    info, reports, log = run_job(slurm, tmp_path, "slurm/check.sh",
                                 env_extra={"NPROC_PER_NODE": 1})
    assert info["NodeList"] == "n[1-2]"
    assert {(r["world_size"], r["sum"]) for r in reports} == {(2, 2.0)}
    assert sorted(r["SLURMD_NODENAME"] for r in reports) == ["n1", "n2"]
    # The per-node lines: both node names, and torch imported on both.
    assert re.search(r"^0: n1$", log, re.M) and re.search(r"^1: n2$", log, re.M), log
    assert len(re.findall(r"^\d: torch \S+ cuda ", log, re.M)) == 2, log
    assert "--- check passed" in log
