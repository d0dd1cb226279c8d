"""A real two-node SLURM cluster on this one machine, for the tests of slurm/*.sh.

Not a conftest: import it from one and wrap it in a fixture, e.g.

    @pytest.fixture(scope="session")
    def slurm_cluster(tmp_path_factory):
        try:
            cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm"))
        except SlurmUnavailable as exc:
            pytest.skip(f"no SLURM cluster: {exc}")
        yield cluster
        cluster.stop()

What it runs (all as root, all state under the given folder, one fresh cluster per start()):
- munged with its own key and socket, so it never clashes with a system munged or with a second
  cluster started at the same time (slurm.conf points at the socket through AuthInfo);
- slurmctld and two slurmd ("n1", "n2") on this host. Both slurmd use NodeAddr=127.0.0.1: the node
  names do not resolve, as they would not on a cluster whose names differ from its hosts' names.
- Job ids start at a random number (FirstJobId), so that two test clusters on one host do not
  derive the same rendezvous port and id from the same job id.
- Each node declares `cpus_per_node` CPUs, which may be more than the host has
  (SlurmdParameters=config_overrides keeps such a node in service): several small test jobs can
  then run side by side. Nothing is bound to cores here (TaskPlugin=task/none), so the number
  only changes what the scheduler hands out, and what SLURM_CPUS_* say inside a job.

Jobs inherit the submitter's environment (sbatch's default --export=ALL). cluster.env() puts
SLURM_CONF in it, and the bin folder of the Python running the tests first on PATH, so `torchrun`
and `python` inside a job are the ones of this test run.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

APT_PACKAGES = ["slurm-wlm", "slurmctld", "slurmd", "slurm-client", "munge"]

# States in which a job will not change again by itself (a requeued job goes back to PENDING).
FINISHED_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED",
}


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be installed or started here; the message says why (use it in pytest.skip)."""


def _run(cmd, timeout=60, env=None, check=True):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
            f"stdout: {proc.stdout}\nstderr: {proc.stderr}"
        )
    return proc


def ensure_apt_packages(packages, probe):
    """apt-get install `packages` unless the executable `probe` is already on PATH.

    Raises SlurmUnavailable with the reason when that cannot be done (not root, no apt-get,
    no access to the archive).
    """
    if shutil.which(probe) or Path("/usr/sbin", probe).exists():
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{probe} is not installed and installing it needs root")
    if not shutil.which("apt-get"):
        raise SlurmUnavailable(f"{probe} is not installed and there is no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    try:
        # Package lists that are there already save an `apt-get update`; a fresh image has none,
        # and then the install fails at once ("Unable to locate package").
        if _run(install, timeout=600, env=env, check=False).returncode != 0:
            _run(["apt-get", "update"], timeout=300, env=env)
            _run(install, timeout=600, env=env)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        raise SlurmUnavailable(f"apt-get install {' '.join(packages)} failed: {exc}") from exc


def _port_is_free(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick_ports(preferred):
    """The preferred ports if all are free, else free ones (a second cluster on this host)."""
    if all(_port_is_free(p) for p in preferred):
        return list(preferred)
    ports = []
    socks = []
    try:
        for _ in preferred:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
            ports.append(sock.getsockname()[1])
    finally:
        for sock in socks:
            sock.close()
    return ports


def parse_scontrol(text):
    """`scontrol show job -o ID` -> {"JobState": "COMPLETED", "ExitCode": "0:0", ...}.

    Values never contain spaces in the one-line form except Command/WorkDir/paths with spaces,
    which we do not use; a token without "=" is appended to the previous value.
    """
    fields = {}
    last = None
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
            last = key
        elif last is not None:
            fields[last] += " " + token
    return fields


class SlurmCluster:
    """Two slurmd nodes and one slurmctld on this host. Use start(), then stop()."""

    NODES = ("n1", "n2")

    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.munge_dir: Path | None = None
        self.cpus = 2

    # ---------------------------------------------------------------- start / stop
    @classmethod
    def start(cls, root, *, cpus_per_node=2, extra_conf="", ready_timeout=60):
        """Install (if needed), configure and start the cluster under the folder `root`.

        extra_conf: lines appended to slurm.conf (e.g. "KillWait=5").
        Raises SlurmUnavailable when SLURM cannot run here.
        """
        if sys.platform != "linux":
            raise SlurmUnavailable("needs Linux")
        if os.geteuid() != 0:
            raise SlurmUnavailable("the test cluster runs slurmd as root (SlurmUser=root)")
        ensure_apt_packages(APT_PACKAGES, "slurmctld")
        for exe in ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scontrol", "sinfo"):
            if not (shutil.which(exe) or Path("/usr/sbin", exe).exists()):
                raise SlurmUnavailable(f"{exe} is missing after installing {APT_PACKAGES}")

        cluster = cls(Path(root))
        cluster.cpus = cpus_per_node
        atexit.register(cluster.stop)  # daemons must not outlive the test run, even on Ctrl-C
        try:
            cluster._start_munge()
            cluster._write_conf(extra_conf)
            cluster._start_daemons()
            cluster._wait_idle(ready_timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_munge(self):
        # munged runs as the munge user and insists on private folders it owns, so it cannot live
        # under pytest's root-only tmp folder; it gets its own folder in /tmp.
        self.munge_dir = Path(tempfile.mkdtemp(prefix="slurm-test-munge-"))
        key = self.munge_dir / "munge.key"
        _run(["mungekey", "--create", f"--keyfile={key}"])
        shutil.chown(self.munge_dir, "munge", "munge")
        self.munge_dir.chmod(0o755)  # munged requires the socket's folder to be searchable by all
        shutil.chown(key, "munge", "munge")
        key.chmod(0o600)
        self.munge_socket = self.munge_dir / "munge.socket"
        cmd = [
            "runuser", "-u", "munge", "--", "/usr/sbin/munged", "--foreground",
            f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--log-file={self.munge_dir / 'munged.log'}",
            f"--pid-file={self.munge_dir / 'munged.pid'}",
            f"--seed-file={self.munge_dir / 'munged.seed'}",
        ]
        log = self.munge_dir / "munged.stderr"  # --foreground logs to stderr
        with open(log, "w") as out:
            self.procs["munged"] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise SlurmUnavailable(
                    "munged did not start: " + (log.read_text() if log.exists() else "no log"))
            time.sleep(0.05)

    def _write_conf(self, extra_conf):
        for sub in ("state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        ctld_port, *node_ports = _pick_ports([16817, 17001, 17002])
        self.node_ports = dict(zip(self.NODES, node_ports))
        host = socket.gethostname().split(".")[0]
        r = self.root
        nodes = "\n".join(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={self.cpus} State=UNKNOWN"
            for name, port in self.node_ports.items()
        )
        self.conf.write_text(f"""\
# Written by tests/slurm_cluster.py: two nodes on one host, everything under {r}
ClusterName=ddptest
# Job ids from a random start: the scripts derive rendezvous ports and ids from the job id, and two
# test clusters on one host must not both run a job 1 (15000 + 1..12000 also stays below the
# kernel's ephemeral ports, 32768 and up).
FirstJobId={random.randint(1, 12000)}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again cred_expire + 1 s after its requeue (slurmctld's
# batch_requeue_fini, SLURM 22.05), so that no node still runs the old one: 120 s by default,
# 5 the least SLURM accepts (below that it takes 120). Reaching that time wakes no scheduler,
# though: the main one looks every sched_interval (60 s by default) and the backfill one only
# after something changed, so the job alone started 21-26 s after its requeue with 10 s here.
# Both look every second here: a scheduler's pass over two nodes and a few jobs costs nothing.
AuthInfo=socket={self.munge_socket},cred_expire=5
SchedulerParameters=sched_interval=1,bf_interval=1
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in these containers: track processes by parent PID, do not bind tasks.
# config_overrides: trust CPUs= below even where the host has fewer (see the module docstring).
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
# A node that was down comes back by itself; batch jobs may be requeued (scontrol requeue).
ReturnToService=2
JobRequeue=1
# Forget finished jobs late enough for the tests to read them with scontrol.
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
{nodes}
PartitionName=debug Nodes={','.join(self.NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
{extra_conf}
""")

    def _start_daemons(self):
        env = self.env()
        log = self.root / "log"
        self.procs["slurmctld"] = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)], env=env,
            stdout=open(log / "slurmctld.stdout", "w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        for name in self.NODES:
            self.procs[f"slurmd-{name}"] = subprocess.Popen(
                ["slurmd", "-D", "-N", name, "-f", str(self.conf)], env=env,
                stdout=open(log / f"slurmd-{name}.stdout", "w"), stderr=subprocess.STDOUT,
                start_new_session=True)

    def _wait_idle(self, timeout):
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited {proc.returncode}:\n{self.logs()}")
            proc = _run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env(), check=False,
                        timeout=20)
            out = proc.stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in self.NODES):
                return
            time.sleep(0.2)
        raise SlurmUnavailable(f"nodes not idle after {timeout}s: {out!r}\n{self.logs()}")

    def stop(self):
        """Cancel this cluster's jobs, stop its daemons (by PID), then end whatever they left."""
        ctld = self.procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            self._cancel_jobs()
        # slurmd, then slurmctld, then munged (the others authenticate through it).
        order = [k for k in self.procs if k.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()  # runuser forwards SIGTERM to munged
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                # The daemon runs in its own session: kill the whole group.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        self._kill_leftovers()
        self.procs.clear()
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None

    def _cancel_jobs(self, timeout=15):
        """scancel every job still queued or running here, and wait until SLURM has ended them."""
        try:
            ids = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if not ids:
                return
            self.run("scancel", *ids, check=False)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not self.run("squeue", "-h", "-o", "%i", check=False).stdout.split():
                    return
                time.sleep(0.25)
        except (OSError, subprocess.TimeoutExpired):
            pass  # _kill_leftovers still ends the processes

    def _kill_leftovers(self):
        """SIGKILL every process that still runs with this cluster's SLURM_CONF in its environment.

        Those are slurmstepd (it outlives slurmd) and the jobs' own processes (sbatch passes the
        submitter's environment on, SLURM_CONF included): all started by this cluster, none by
        anything else.
        """
        marker = f"SLURM_CONF={self.conf}\0".encode()
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
                continue
            try:
                environ = (pid_dir / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ:
                try:
                    os.kill(int(pid_dir.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # ---------------------------------------------------------------- using it
    def env(self, extra=None):
        """Environment for SLURM clients and for jobs (sbatch exports it to the job).

        extra: variables to set; a value of None removes that variable.
        """
        env = dict(os.environ)
        bindir = os.path.dirname(sys.executable)  # not resolved: a venv's bin, not /usr/bin
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
        env["SLURM_CONF"] = str(self.conf)
        # The emulated nodes compute on the CPU even on a machine with GPUs (conftest.HIDE_GPUS):
        # this cluster has no GPU resources (no gres), so SLURM never sets the variable itself,
        # and the job's torchrun and every worker inherit the empty value (--export=ALL).
        env["CUDA_VISIBLE_DEVICES"] = ""
        # A test run inside a SLURM job must not leak that job's settings into ours.
        for key in list(env):
            if key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and key != "SLURM_CONF":
                del env[key]
        for key, value in (extra or {}).items():
            if value is None:
                env.pop(key, None)  # None removes a variable, e.g. a stray NPROC_PER_NODE
            else:
                env[key] = str(value)
        return env

    def run(self, *cmd, timeout=30, check=True):
        """Run a SLURM client command (scontrol, squeue, ...) against this cluster."""
        return _run([str(c) for c in cmd], env=self.env(), timeout=timeout, check=check)

    def sbatch(self, args, cwd=None, env_extra=None):
        """sbatch --parsable ARGS in `cwd`; returns the job id as int.

        The job gets this environment (sbatch's default --export=ALL): env(env_extra).
        """
        proc = subprocess.run(["sbatch", "--parsable", *map(str, args)], cwd=cwd,
                              env=self.env(env_extra), capture_output=True, text=True,
                              timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {args} failed: {proc.stderr}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id):
        """`scontrol show job` as a dict ({} when SLURM no longer knows the job)."""
        proc = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        if proc.returncode != 0:
            return {}
        return parse_scontrol(proc.stdout)

    def wait_state(self, job_id, states, timeout=60, poll=0.25):
        """Poll until the job's JobState is one of `states`; returns the job dict."""
        states = set(states)
        deadline = time.monotonic() + timeout
        info = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(poll)
        raise TimeoutError(
            f"job {job_id} not in {sorted(states)} after {timeout}s: {info}\n{self.logs()}")

    def wait(self, job_id, timeout=120, poll=0.25):
        """Wait until the job has finished (not `sbatch --wait`, which returns ~30 s late).

        Returns scontrol's fields: JobState, ExitCode ("rc:signal"), NodeList, StdOut, ...
        """
        return self.wait_state(job_id, FINISHED_STATES, timeout=timeout, poll=poll)

    def logs(self, tail=40):
        """The last lines of each daemon's log, for failure messages."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)
