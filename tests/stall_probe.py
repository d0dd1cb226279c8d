"""Run a step script unchanged, except that one rank stalls: it stops answering after its
first optimizer step, as a rank stuck in I/O or a deadlock would.

    torchrun ... tests/stall_probe.py 03_ddp_wrapper.py ...   (STALL_RANK=<rank>)

The other ranks then wait in their next all-reduce until --timeout expires.
"""

import os
import runpy
import sys
import time
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook


def stall(optimizer, args, kwargs):
    if os.environ.get("RANK") == os.environ["STALL_RANK"]:
        time.sleep(3600)


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the steps import common
register_optimizer_step_post_hook(stall)
script, *script_args = sys.argv[1:]
sys.argv = [script, *script_args]
runpy.run_path(script, run_name="__main__")
