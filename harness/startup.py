"""A Ctrl-C while a step starts is one line, not a traceback from inside torch's imports.

Every step imports this first, before torch: `import torch` takes about 2 s, and a Ctrl-C then
(or anywhere before errors.run_main takes over) ended in a 37-line KeyboardInterrupt traceback
through importlib, on every rank. This module imports nothing slow (not torch: errors.py does),
so it is in place before the first slow import. It only replaces sys.excepthook, which Python
calls for an exception that nothing caught, so a program that imports a step (a test) keeps
its own handling.
"""

from __future__ import annotations

import os
import socket
import sys


def _ctrl_c_is_one_line(kind, value, traceback) -> None:
    """For an uncaught KeyboardInterrupt: errors.run_main's line and exit code (130), at once
    (a half-imported torch is not worth finalizing). Anything else: Python's traceback."""
    if not issubclass(kind, KeyboardInterrupt):
        return sys.__excepthook__(kind, value, traceback)
    where = ""
    if os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1"):  # a rank of several
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "?"))  # (srun: no RANK)
        where = f" (rank {rank} on {socket.gethostname()})"
    print(f"error: interrupted (SIGINT): stopped at once, while starting{where}",
          file=sys.stderr, flush=True)
    os._exit(130)


sys.excepthook = _ctrl_c_is_one_line
