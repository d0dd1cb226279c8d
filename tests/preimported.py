"""A process that has imported torch once and forks a child for each run that `launch` asks of it.

A run of a step or of torchrun's agent spends 2-3 s of CPU importing torch and torchvision
before its first line, and the suite starts hundreds of them (steps, torchrun's agents and
their workers). Here the imports are done once: each run is a child forked from this process,
which then runs the script as `python SCRIPT`, `python -m MODULE` or `python -c CODE` would
(its own pid, cwd, environment, argv, sys.path[0], stdin, stdout and stderr, and signals as
exec leaves them: see become), and ends as the interpreter's exit begins (see end), with its
own exit status.

conftest starts two per pytest process: one under the tests' environment, one under it with
OMP_NUM_THREADS=1, the variable torchrun sets for its workers (libgomp reads it when torch
loads). What a forked run starts with subprocess.Popen is forked too where it can be
(fork_children: torchrun's workers, the tour's steps, each asked for in a session of its own):
the child is the helper's, in that session, and its parent follows it through a handle with
Popen's pid, poll, wait and signals.

What differs from a fresh interpreter, and so where `conftest.launch` starts one instead:
- torch, torchvision and numpy were imported under this process's environment. A run whose
  environment differs in anything but LATE_VARIABLES (read only when a step runs, never at
  import), or whose interpreter or PYTHONPATH differs, is started fresh;
- anything that is not this interpreter running a .py file, torchrun or `-c CODE`;
- Python's hash seed and numpy's global random state are this process's (the steps seed what
  they draw from explicitly; Python's `random` reseeds itself in a forked child);
- at its end, objects still alive are not finalized (see end);
- a sitecustomize hook on PYTHONPATH (hook_folder) is imported after torch, not before;
- a forked child has the helper as its parent, not the process that asked for it, and
  /proc/PID/environ shows the helper's environment, not its own: the helpers record both (see
  asked; conftest.children and conftest.environment read them). Ranks are forked only where
  their launch has a run id of its own (a uuid, as torchrun --standalone makes), which tells
  launches apart where `harness.peers.this_launch` would otherwise read the parent.
A test whose claim is about starting up (an import that must come first, a Ctrl-C while torch
loads) uses subprocess itself, or launch(..., fresh=True).

    python tests/preimported.py SOCKET HELPERS     (conftest starts it; HELPERS lists them all)
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import uuid

# Whether this interpreter imported a sitecustomize of its own as it started (from its
# site-packages, say): a hook on PYTHONPATH would then not have been imported. Taken before any
# run: a forked run that imported a hook (become) still asks for its children as its helper.
OWN_SITECUSTOMIZE = "sitecustomize" in sys.modules

# Variables the steps, the probe or torch read after import (at a flag's parse, a group's start,
# a step's hook): a run that sets them differently can still be forked from here.
LATE_VARIABLES = ("PROBE_", "SLURM_", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
                  "WORLD_SIZE", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCH_FR_BUFFER_SIZE",
                  "PYTEST_",  # (not TMPDIR: tempfile caches the folder while torch imports)
                  # and what torchrun's agent adds for its workers (torch 2.14.1 reads each
                  # where a group starts or an error is recorded)
                  "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
                  "ROLE_WORLD_SIZE", "TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                  # read by gloo's C++ where a group makes its device, and by DDP's logging
                  # (no other Python file of torch 2.14.1 reads it)
                  "GLOO_SOCKET_IFNAME")


def differs_only_late(env: dict, here: dict) -> bool:
    """Whether a run's environment equals this process's, but for LATE_VARIABLES and a
    PYTHONPATH that only adds a hook (see hook_folder)."""
    changed = (env.keys() ^ here.keys()) | {k for k in env.keys() & here.keys() if env[k] != here[k]}
    if ("PYTHONPATH" not in here and not OWN_SITECUSTOMIZE  # (else one ran here)
            and hook_folder(env.get("PYTHONPATH"))):
        changed.discard("PYTHONPATH")
    return all(name.startswith(LATE_VARIABLES) for name in changed)


def hook_folder(pythonpath: str | None) -> bool:
    """Whether PYTHONPATH is one folder that holds a sitecustomize.py and nothing else that
    could be imported, as the tests' hooks do (conftest.KILL_RANK_1_AT_STEP_27): Python imports
    it as it starts, before the script; a forked run imports it before its run, after torch
    (become), with the folder where PYTHONPATH puts it on sys.path. Anything more on PYTHONPATH
    could hold a module this process imported from elsewhere: such a run starts fresh."""
    if not pythonpath or os.pathsep in pythonpath or not os.path.isdir(pythonpath):
        return False
    return set(os.listdir(pythonpath)) - {"__pycache__"} == {"sitecustomize.py"}


def listen(path: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    return server


def receive(connection: socket.socket) -> tuple[dict, list[int]]:
    """A request (one line of JSON) and the file descriptors sent with it (stdin, stdout and
    stderr of a child a forked run asked for; none from pytest, which names files instead)."""
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    while data and not data.endswith(b"\n"):
        more = connection.recv(1 << 16)
        if not more:
            break
        data += more
    try:
        return json.loads(data), fds
    except ValueError:  # empty or cut: its asker ended before it had asked
        return {}, fds


def returncode(info) -> int:
    """What Popen's returncode says of a child that ended: its exit code, or -N for signal N."""
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def asker(connection: socket.socket) -> int:
    """The pid of the process at the other end of a connection (the kernel's SO_PEERCRED)."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
    return struct.unpack("3i", credentials)[0]


def ignored_by(pid: int) -> list[int]:
    """The signals process `pid` ignores (SigIgn in /proc/PID/status): a program it starts
    ignores them too, and starts every other signal at its default, whatever it catches."""
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    return [int(s) for s in signal.valid_signals() if mask >> (s - 1) & 1]


def asked(folder: str) -> dict[int, dict]:
    """Each running child the helpers forked: {"asker": the pid of the process that asked for it
    (its parent, as Popen would have made it), "env": the environment it runs under (which
    /proc/PID/environ does not show: that is the helper's)}. `python tests/preimported.py`
    writes them in <folder>/asked, where folder holds its HELPERS file (conftest.children)."""
    found = {}
    for name in os.listdir(os.path.join(folder, "asked")):
        try:
            with open(os.path.join(folder, "asked", name)) as f:
                found[int(name)] = json.load(f)
        except (FileNotFoundError, ValueError):  # reaped meanwhile, or ".PID" being written
            pass
    return found


def serve(server: socket.socket, registry: str) -> tuple[dict, list[int]]:
    """Answer requests until the pytest process is gone; in a forked child, its request.

    A child that ended is reaped only once the one who asked for it has closed the connection,
    as a Popen child stays a zombie until its parent waits: torchrun signals a worker's process
    group after it may have ended, which must not find the group gone or its pid reused. Who
    asked for each child is in registry/<child pid> (see asked) from before the asker learns
    the child's pid until just before the child is reaped (a reaped pid may be reused)."""
    running, ended, parent = {}, {}, os.getppid()  # child pid -> the connection that asked for it
    while True:
        ready = select.select([server, *ended.values()], [], [], 0.05)[0]
        for pid, connection in list(running.items()):
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is None:
                continue
            try:
                connection.sendall(json.dumps({"returncode": returncode(info)}).encode() + b"\n")
            except OSError:
                pass  # the one who asked is gone; reaped below
            ended[pid] = running.pop(pid)
        for pid, connection in list(ended.items()):
            if connection in ready:  # closed: nobody will signal or wait for this child again
                os.unlink(os.path.join(registry, str(pid)))
                os.waitpid(pid, 0)
                connection.close()
                del ended[pid]
        if server not in ready:
            if os.getppid() != parent:  # the pytest process is gone (we were handed on)
                return {}, []
            continue
        connection, _ = server.accept()
        request, fds = receive(connection)
        if not request:
            for fd in fds:
                os.close(fd)
            connection.close()
            continue
        pid = os.fork()
        if pid == 0:  # the run: it keeps no connection of ours
            # It starts once its entry is in the registry: on a busy machine it ran first, and a
            # test that read its pid from a file it wrote found no one who asked for it (seen:
            # conftest.children missed a forked rank, both cores kept busy by other loops).
            mine = os.path.join(registry, str(os.getpid()))
            for _ in range(20_000):  # (its helper writes it right after the fork; 20 s at most)
                if os.path.exists(mine):
                    break
                select.select([], [], [], 0.001)
            request["ignored"] = ignored_by(asker(connection))
            for other in [server, connection, *running.values(), *ended.values()]:
                other.close()
            return request, fds
        for fd in fds:
            os.close(fd)
        running[pid] = connection
        with open(os.path.join(registry, f".{pid}"), "w") as f:
            json.dump({"asker": asker(connection), "env": request["env"]}, f)
        os.rename(os.path.join(registry, f".{pid}"), os.path.join(registry, str(pid)))
        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def become(request: dict, fds: list[int]) -> None:
    """Set this forked child up as the fresh process the request describes would be."""
    if request.get("new_session"):  # as torchrun's Popen(start_new_session=True)
        os.setsid()
    os.chdir(request["cwd"])
    # Signals as a started program has them: what the asker ignores stays ignored (a nohup's
    # SIGHUP), every other one at its default (the helper's are its own starter's: a torchrun
    # agent catches SIGHUP, so its fresh workers start with it at its default); then what
    # Python sets as it starts: SIGPIPE and SIGXFSZ ignored, SIGINT raising KeyboardInterrupt.
    for number in signal.valid_signals():
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(number, signal.SIG_IGN if number in request["ignored"]
                              else signal.SIG_DFL)
            except (OSError, ValueError):
                pass  # (the C library's own, for its threads)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if signal.SIGINT not in request["ignored"]:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    if not fds:
        fds = [os.open(os.devnull, os.O_RDONLY),
               *(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                 for name in ("stdout", "stderr"))]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    hook = os.environ.get("PYTHONPATH")
    if hook and not OWN_SITECUSTOMIZE:  # (a hook_folder: differs_only_late)
        import site
        sys.path.insert(0, hook)  # (run puts the script's folder before it, as Python does)
        site.execsitecustomize()  # (Python's own: an error in it is one line, and the run goes on)


def run(request: dict) -> int | str:
    """Run the script or module as __main__; the exit code Python would end with, or CTRL_C."""
    import builtins
    import runpy
    import types
    from importlib.machinery import BuiltinImporter, SourceFileLoader

    target, *args = request["argv"]
    fork_children()
    try:
        if request.get("code") is not None:  # `python -c CODE ARGS`: argv[0] "-c", and the
            sys.argv = ["-c", *args]  # working directory ("") first on sys.path
            sys.path.insert(0, "")
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            main.__dict__.update(__builtins__=builtins, __loader__=BuiltinImporter,
                                 __annotations__={})
            exec(compile(request["code"], "<string>", "exec"), main.__dict__)
        elif request["module"]:
            sys.argv = [target, *args]  # (run_module puts the module's file in argv[0])
            sys.path.insert(0, request["cwd"])  # `python -m`: the working directory first
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:  # as `python SCRIPT` does: argv[0] as given, __file__ absolute (3.9+)
            sys.argv = [target, *args]
            sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
            path = os.path.abspath(target)
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins,
                                 __loader__=SourceFileLoader("__main__", path))
            with open(path, "rb") as source:
                code = compile(source.read(), path, "exec")
            exec(code, main.__dict__)
    except SystemExit as stop:
        code = stop.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except BaseException as err:  # noqa: BLE001 -- printed as Python prints an uncaught one
        traceback = err.__traceback__
        while traceback is not None and traceback.tb_frame.f_code.co_filename in (
                __file__, runpy.__file__, "<frozen runpy>"):
            traceback = traceback.tb_next  # from the script's own frame on, as Python shows it
        sys.excepthook(type(err), err.with_traceback(traceback), traceback)  # (it prints the
        # exception's own __traceback__)
        return CTRL_C if isinstance(err, KeyboardInterrupt) else 1
    return 0


CTRL_C = "ctrl-c"  # run's end for an uncaught KeyboardInterrupt: Python ends by SIGINT itself


def end(code: int | str) -> None:
    """Leave as Python's exit does up to its flush of stdout and stderr: wait for the threads
    that are not daemons, run the atexit functions, flush (exit status 120 if that fails, as
    Python's), then os._exit, or, after an uncaught Ctrl-C (CTRL_C), SIGINT to itself as
    Python sends it once its exit is done. What Python does after the flush, tearing its
    modules down, is left out: in a child forked from here it touched, and so copied, every page of what the helper
    imported, 0.3 s of each child's CPU even with gc.freeze (a 2-rank torchrun of 03: 2.6 s to
    2.0 s a launch, median of 6, interleaved, this VM, torch 2.14.1). What it would do there is
    finalize the objects still alive, which Python does not promise ("It is not guaranteed that
    __del__() methods are called for objects that still exist when the interpreter exits", the
    language reference, object.__del__), and run C++'s static destructors: a run that must
    prove those (a group's destructor at exit) starts fresh, as every run does with
    FRESH_PROCESSES=1 and in CI's oldest-torch leg (.ci/oldest_torch.py)."""
    import atexit
    import threading

    threading._shutdown()  # (what Python's own exit calls first: it joins non-daemon threads)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception as err:  # noqa: BLE001 -- as Python: exit status 120, and for
            code = 120  # stdout, what its hook for an unraisable exception prints
            if stream is sys.stdout:
                import traceback
                print(f"Exception ignored in: {stream!r}", file=sys.stderr)
                traceback.print_exception(type(err), err, None, file=sys.stderr)
    if code == CTRL_C:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code if code != CTRL_C else 1)


HELPERS = ""  # the file that lists every helper's socket and environment (argv[2])


def helper_for(env: dict, helpers: list[dict]) -> str | None:
    """The socket of a helper that imported torch under `env` (but for LATE_VARIABLES)."""
    return next((h["socket"] for h in helpers if differs_only_late(env, h["env"])), None)


def what_runs(rest: list[str]) -> dict | None:
    """What `python REST...` runs, as a request says it (argv, module, code), where a helper
    can run it: a .py file, torchrun (`-m torch.distributed.run`) or `-c CODE`; else None."""
    if rest[:2] == ["-m", "torch.distributed.run"]:
        return {"argv": rest[1:], "module": True, "code": None}
    if rest[:1] == ["-c"] and len(rest) > 1:
        return {"argv": ["-c", *rest[2:]], "module": False, "code": rest[1]}
    if rest[:1] and rest[0].endswith(".py"):
        return {"argv": rest, "module": False, "code": None}
    return None


def child_request(positional: tuple, kwargs: dict) -> tuple[dict, list[int]] | None:
    """The request (and stdin, stdout, stderr) that forks what subprocess.Popen(*positional,
    **kwargs) would start, or None where Popen must start it: anything but this interpreter
    running a .py file (`-u` allowed: the helpers run with PYTHONUNBUFFERED=1) or torchrun, in
    a session of its own (as torchrun starts its workers and the tour its steps: a child of the
    helper could not join its asker's process group), with no pipes (inherited stdin; stdout and
    stderr inherited or files), in an environment a helper imported torch under; and ranks whose
    launch has no run id of its own (a uuid, as torchrun --standalone makes), as
    harness.peers.this_launch would read their parent."""
    args = positional[0] if len(positional) == 1 else kwargs.get("args") if not positional else None
    kwargs = {k: v for k, v in kwargs.items() if k != "args"}
    streams = [kwargs.get("stdout"), kwargs.get("stderr")]
    if (not isinstance(args, (list, tuple)) or not kwargs.get("start_new_session")
            or set(kwargs) - {"cwd", "env", "stdout", "stderr", "start_new_session"}
            or any(s is not None and not hasattr(s, "fileno") for s in streams)
            or not all(isinstance(a, (str, os.PathLike)) for a in args)):
        return None
    args = [os.fspath(a) for a in args]
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])  # (env={}: empty)
    rest = args[1:] if args[:1] == [sys.executable] else []
    if rest[:1] == ["-u"] and env.get("PYTHONUNBUFFERED") == "1":
        rest = rest[1:]
    what = what_runs(rest)
    if what is None:
        return None
    try:
        if "TORCHELASTIC_RUN_ID" in env:
            uuid.UUID(env["TORCHELASTIC_RUN_ID"])
        elif "WORLD_SIZE" in env:
            return None
    except ValueError:
        return None
    with open(HELPERS) as f:
        helper = helper_for(env, json.load(f))
    if helper is None:
        return None
    fds = [0, *(s.fileno() if s is not None else n for s, n in zip(streams, (1, 2)))]
    return {**what, "env": env, "socket": helper,
            "cwd": os.path.abspath(os.fspath(kwargs.get("cwd") or os.getcwd())),
            "new_session": True}, fds


class ForkedChild:
    """What its parent keeps of a child forked by a helper: Popen's pid, poll, wait,
    returncode, signals and `with`. The helper says on the connection when the child has ended."""

    stdin = stdout = stderr = None

    def __init__(self, request: dict, fds: list[int]):
        self.args, self.returncode, self._pending = request["argv"], None, b""
        self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._connection.connect(request["socket"])
        socket.send_fds(self._connection, [json.dumps(request).encode() + b"\n"], fds)
        self.pid = json.loads(self._line(None))["pid"]

    def _line(self, timeout: float | None) -> bytes | None:
        """The helper's next line; None if none came within `timeout`, b"" if it is gone."""
        while b"\n" not in self._pending:
            if not select.select([self._connection], [], [], timeout)[0]:
                return None
            chunk = self._connection.recv(4096)
            if not chunk:
                return b""
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line

    def poll(self) -> int | None:
        if self.returncode is None:
            self._end(self._line(0))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._end(self._line(timeout))
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _end(self, line: bytes | None) -> None:
        if line is not None:  # it ended (b"": the helper is gone, and with it the worker)
            self.returncode = json.loads(line)["returncode"] if line else -signal.SIGKILL
            self._connection.close()  # the helper reaps it now: nothing signals it again

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.wait()


def fork_children() -> None:
    """In a forked run: what it starts with subprocess.Popen is forked by a helper too, where
    child_request can (torchrun's workers, the tour's steps); the rest Popen starts itself."""
    def __new__(cls, *positional, **kwargs):
        asked = child_request(positional, kwargs) if cls is subprocess.Popen else None
        return object.__new__(cls) if asked is None else ForkedChild(*asked)

    subprocess.Popen.__new__ = staticmethod(__new__)


if __name__ == "__main__":
    del sys.path[0]  # (tests/: nothing of ours is imported here; a run puts its own first)
    import numpy  # noqa: F401 -- the imports every run would do, done once
    import torch  # noqa: F401
    import torch.distributed.launcher.api  # noqa: F401 -- torchrun's (not .run itself: runpy
    import torchvision  # noqa: F401 -- would warn that it was imported before it ran)

    HELPERS = sys.argv[2]
    # Every object so far moves to the collector's permanent generation: a forked child's
    # collections, and its interpreter's exit, then leave them alone instead of touching each
    # one, which copied every page of them in each child (gc.freeze's documented use). A forked
    # run of an empty script: 1.2 s of exit before, 0.3 s after (torch 2.14.1, this VM).
    import gc
    gc.freeze()
    listening = listen(sys.argv[1])
    registry = os.path.join(os.path.dirname(HELPERS), "asked")
    os.makedirs(registry, exist_ok=True)  # (both helpers share it)
    print("ready", flush=True)  # (after the bind: a client may connect at once)
    request, received = serve(listening, registry)
    if request:
        become(request, received)
        end(run(request))
