"""A process that has imported torch once and forks a child for each run that `launch` asks of it.

A run of a step or of torchrun's agent spends 2-3 s of CPU importing torch and torchvision
before its first line; the suite starts about 200 of them. Here the imports are done once:
each run is a child forked from this process, which then runs the script as `python SCRIPT` or
`python -m MODULE` would (its own pid, cwd, environment, argv, sys.path[0], stdout and stderr),
and ends through the interpreter's own exit (atexit, finalization), with its own exit status.

What differs from a fresh interpreter, and so where `conftest.launch` starts one instead:
- torch, torchvision and numpy were imported under this process's environment. A run whose
  environment differs in anything but LATE_VARIABLES (read only when a step runs, never at
  import), or whose interpreter or PYTHONPATH differs, is started fresh;
- `python -c`, and anything that is not this interpreter running a .py file or a module;
- Python's hash seed and numpy's global random state are this process's (the steps seed what
  they draw from explicitly; Python's `random` reseeds itself in a forked child).
A test whose claim is about starting up (an import that must come first, a Ctrl-C while torch
loads) uses subprocess itself, or launch(..., fresh=True).

    python tests/preimported.py SOCKET     (conftest starts it; one per pytest process)
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

# Variables the steps, the probe or torch read after import (at a flag's parse, a group's start,
# a step's hook): a run that sets them differently can still be forked from here.
LATE_VARIABLES = ("PROBE_", "SLURM_", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
                  "WORLD_SIZE", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCH_FR_BUFFER_SIZE",
                  "PYTEST_")  # (not TMPDIR: tempfile caches the folder while torch imports)


def differs_only_late(env: dict, here: dict) -> bool:
    """Whether a run's environment equals this process's, but for LATE_VARIABLES."""
    changed = (env.keys() ^ here.keys()) | {k for k in env.keys() & here.keys() if env[k] != here[k]}
    return all(name.startswith(LATE_VARIABLES) for name in changed)


def listen(path: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    return server


def serve(server: socket.socket) -> dict:
    """Answer requests until the pytest process is gone; in a forked child, its request."""
    running, parent = {}, os.getppid()  # child pid -> the connection that waits for its status
    while True:
        ready = select.select([server], [], [], 0.05)[0]
        while running:  # reap every child that ended, and say how
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = running.pop(pid)
            connection.sendall(json.dumps({"status": status}).encode() + b"\n")
            connection.close()
        if not ready:
            if os.getppid() != parent:  # the pytest process is gone (we were handed on)
                return {}
            continue
        connection, _ = server.accept()
        request = json.loads(connection.makefile().readline())
        if not request:  # the pytest process is done with us
            return {}
        pid = os.fork()
        if pid == 0:  # the run: it keeps no connection of ours
            for other in [server, connection, *running.values()]:
                other.close()
            return request
        running[pid] = connection
        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def become(request: dict) -> None:
    """Set this forked child up as the fresh process the request describes would be."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, name in ((0, os.devnull), (1, request["stdout"]), (2, request["stderr"])):
        opened = os.open(name, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)


def run(request: dict) -> int:
    """Run the script or module as __main__; the exit code Python would end with."""
    import builtins
    import runpy
    import types
    from importlib.machinery import SourceFileLoader

    target, *args = request["argv"]
    try:
        if request["module"]:
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
        if isinstance(err, KeyboardInterrupt):  # Python then ends by SIGINT itself
            sys.stdout.flush(), sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return 1
    return 0


if __name__ == "__main__":
    del sys.path[0]  # (tests/: nothing of ours is imported here; a run puts its own first)
    import numpy  # noqa: F401 -- the imports every run would do, done once
    import torch  # noqa: F401
    import torch.distributed.launcher.api  # noqa: F401 -- torchrun's (not .run itself: runpy
    import torchvision  # noqa: F401 -- would warn that it was imported before it ran)

    listening = listen(sys.argv[1])
    print("ready", flush=True)  # (after the bind: a client may connect at once)
    asked = serve(listening)
    if asked:
        become(asked)
        sys.exit(run(asked))
