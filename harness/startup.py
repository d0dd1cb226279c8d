"""A Ctrl-C or a stop signal while a step starts is one line, not a traceback or silence.

Every step imports this first, before torch: `import torch` takes about 2 s, and a Ctrl-C then
(or anywhere before errors.run_main takes over) ended in a 37-line KeyboardInterrupt traceback
through importlib, on every rank. This module imports nothing slow (not torch: errors.py does),
so it is in place before the first slow import. It only replaces sys.excepthook, which Python
calls for an exception that nothing caught, so a program that imports a step (a test) keeps
its own handling. A stop signal (SIGTERM: torchrun's, SLURM's) then ended a rank silently, by
its default action: while a step is run as a script, until errors.run_main installs its own
handlers, it is one line and exit 128 + its number, as Ctrl-C is.
"""

from __future__ import annotations

import os
import signal
import socket
import sys


def _where() -> str:
    if os.environ.get("WORLD_SIZE", "1") in ("", "0", "1"):
        return ""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "?"))  # (srun: no RANK)
    return f" (rank {rank} on {socket.gethostname()})"  # a rank of several


def _ctrl_c_is_one_line(kind, value, traceback) -> None:
    """For an uncaught KeyboardInterrupt: errors.run_main's line and exit code (130), at once
    (a half-imported torch is not worth finalizing). Anything else: Python's traceback."""
    if not issubclass(kind, KeyboardInterrupt):
        return sys.__excepthook__(kind, value, traceback)
    print(f"error: interrupted (SIGINT): stopped at once, while starting{_where()}",
          file=sys.stderr, flush=True)
    os._exit(130)


def stopped_while_starting(signum, frame) -> None:
    print(f"error: interrupted ({signal.Signals(signum).name}): stopped at once, while starting"
          f"{_where()}", file=sys.stderr, flush=True)
    os._exit(128 + signum)


sys.excepthook = _ctrl_c_is_one_line
if os.path.basename(sys.argv[0])[:2].isdigit():  # a step run as a script (not imported by a test)
    for _signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(_signum, stopped_while_starting)
