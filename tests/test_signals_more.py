"""Issue 43, section 2 (and the error-marker folder of section 3): signals that were swallowed or
ended in tracebacks, each sent for real to real processes.

- 09's export on SIGTERM (a shard that is a FIFO nobody writes): one line, exit 143 (was killed
  silently); a Ctrl-C during a slow checkpoint read ends 09 with 130.
- A Ctrl-C in run_main's teardown, after main() returned: one line, no traceback.
- 11 on SIGTERM (a preemption): a line of its own, not only torchrun's traceback.
- Stopping the tour stops the step it started, with one line, exit 128 + the signal.
- A link planted where the error markers go is not followed.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, base_env, frames_of_ours, torchrun_cmd
from test_interrupts import GUARD_S, alive, descendants, finish, one_error_line, read, start

STEP09 = "09_distributed_checkpoint.py"


# main() returns; run_main's teardown (a garbage collection, then the group's destruction) meets
# a real Ctrl-C, sent as the destruction starts so that it lands there every time. (The issue
# saw it by chance in the collection, on rank 1 of a torchrun run that got Ctrl-C as it ended.)
CTRL_C_IN_TEARDOWN = """
import os, signal
import torch.distributed as dist
from plumbing import errors

destroy = dist.destroy_process_group

def ctrl_c_then_destroy():
    os.kill(os.getpid(), signal.SIGINT)
    destroy()

def main():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group = ctrl_c_then_destroy  # (main() itself does not call it)

errors.run_main(main)
"""


def test_ctrl_c_in_the_teardown_after_main_is_one_line():
    done = subprocess.run([sys.executable, "-c", CTRL_C_IN_TEARDOWN], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=GUARD_S)
    assert done.returncode == 130, done.stderr[-3000:]
    one_error_line(done.stderr, "interrupted (SIGINT)")
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


MARKER_PROBE = "from plumbing import errors; errors.report('the planted error')"


def report_from_two_ranks(tmp: Path) -> list[str]:
    """Both ranks of one 'launch' (WORLD_SIZE=2, the same parent) report the same error."""
    lines = []
    for rank in (0, 1):
        done = subprocess.run([sys.executable, "-c", MARKER_PROBE], cwd=REPO, timeout=GUARD_S,
                              env=base_env(TMPDIR=tmp, WORLD_SIZE=2, RANK=rank),
                              capture_output=True, text=True, check=True)
        lines += done.stderr.splitlines()
    return lines


def test_a_link_planted_as_the_error_marker_folder_is_not_followed(tmp_path):
    """Another user links the marker folder's name (under the shared temporary folder) to a
    folder of theirs: a launch that reported an error deleted an old file there and left its
    marker. Now the link is refused, and both ranks say their line (rather twice than never);
    a folder of our own still makes one line of two."""
    theirs, tmp = tmp_path / "theirs", tmp_path / "tmp"
    theirs.mkdir()
    tmp.mkdir()
    for name in ("old-file", "0123456789abcdef0123"):  # any name, and a name like a marker's
        (theirs / name).write_text("keep me")
        os.utime(theirs / name, (0, 0))  # from 1970: "a launch long gone"
    for name in ("ddp-tutorial-errors", f"ddp-tutorial-errors-{os.geteuid()}"):
        (tmp / name).symlink_to(theirs)  # wherever the markers may go
    lines = report_from_two_ranks(tmp)
    assert sorted(p.name for p in theirs.iterdir()) == ["0123456789abcdef0123", "old-file"]
    assert [line.split(" (rank")[0] for line in lines] == ["error: the planted error"] * 2
    ours = tmp_path / "ours"
    ours.mkdir()
    assert len(report_from_two_ranks(ours)) == 1
    folder = ours / f"ddp-tutorial-errors-{os.geteuid()}"
    assert folder.stat().st_mode & 0o777 == 0o700
