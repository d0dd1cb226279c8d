"""Issue 27, item 6: failures that ended in a traceback, each met for real (a real full
filesystem, a real SIGKILL, real files), since the real failure often raises another exception
type than a mock: a full disk inside torch.save raises RuntimeError, not OSError.
"""

import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import common
from plumbing import checkpoint
from conftest import REPO, assert_no_traceback, base_env, launch, run_step, saved_checkpoint


@pytest.fixture
def small_disk(tmp_path):
    """A real 12 MiB filesystem (tmpfs): one checkpoint of step 07 (~9.2 MiB: weights and
    momentum) fits, a second one beside it does not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(disk)],
                             capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here (root needed): {mounted.stderr.decode()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_full_disk_during_a_save_is_one_line_keeps_the_last_checkpoint_and_ends_peers(
        small_disk):
    """Step 07, 2 ranks: the checkpoint of step 4 fits, the one of step 8 hits ENOSPC inside
    torch.save. Rank 0 says so in one line; rank 1, waiting at the barrier after the save, loses
    its peer and ends too (before torchrun's shutdown timeout would SIGKILL it)."""
    proc = run_step("07_fault_tolerance.py", [
        "--data", "synthetic", "--train-samples", 480, "--test-samples", 20, "--batch-size", 24,
        "--epochs", 1, "--checkpoint-every", 4, "--quiet", "--out-dir", small_disk],
        nproc=2, check=False, timeout=240)
    assert proc.returncode != 0
    assert_no_traceback(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    disk_full = [line for line in errors if line.startswith("error: could not write checkpoint")]
    assert len(disk_full) == 1, proc.stderr[-3000:]
    assert "inline_container.cc" in disk_full[0] and "disk full?" in disk_full[0]
    assert "the previous checkpoint is unchanged" in disk_full[0]
    # Rank 1 names who failed and why: rank 0 left its error in the group's store.
    lost = [line for line in errors if line.startswith("error: rank 1: lost contact")]
    assert len(lost) == 1 and "because rank 0: could not write checkpoint" in lost[0], \
        proc.stderr[-3000:]
    assert "SIGKILL" not in proc.stderr, proc.stderr[-3000:]
    assert not [p.name for p in small_disk.iterdir() if p.name.endswith(".tmp")]
    assert checkpoint.load(small_disk / "checkpoint.pt")["position"]["step"] == 4


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # loaded here, no group
def test_a_full_disk_during_a_background_dcp_save_is_one_line_and_leaves_no_half_folder(
        small_disk):
    """Step 09, 2 ranks: the DCP checkpoint of step 2 (~9.7 MiB) fits, the one of step 4 hits
    ENOSPC in dcp.async_save's background writes (an OSError or torch's RuntimeError, whichever
    write meets the full disk first). Every rank learns it from DCP, so every rank ends with the
    same line (printed once per machine), the half-written folder is removed, and the link
    still names step 2's complete checkpoint."""
    from plumbing import step09_dcp_checkpoint as dcp_checkpoint
    proc = run_step("09_distributed_checkpoint.py", [
        "--data", "synthetic", "--train-samples", 96, "--test-samples", 20, "--batch-size", 24,
        "--epochs", 1, "--checkpoint-every", 2, "--quiet", "--out-dir", small_disk],
        nproc=2, check=False, timeout=240)
    assert proc.returncode != 0
    assert_no_traceback(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: could not write checkpoint ") and (
        "No space left on device" in errors[0] or "disk full?" in errors[0]), errors[0]
    assert "removed it, the last complete checkpoint, checkpoint-epoch1-step2, is unchanged" \
        in errors[0], errors[0]
    assert "SIGKILL" not in proc.stderr, proc.stderr[-3000:]  # no rank had to be killed
    assert sorted(p.name for p in small_disk.glob("*checkpoint*")) == [
        "checkpoint", "checkpoint-epoch1-step2"]
    folder = dcp_checkpoint.complete_folder(small_disk / "checkpoint")
    state = {"extra": {"epoch": -1, "position": {"step": 0, "loss_sum": 0.0, "samples": 0}}}
    dcp_checkpoint.load(state, folder)  # the previous checkpoint loads
    assert state["extra"]["position"]["step"] == 2


SAVE_FOREVER = textwrap.dedent("""
    import sys
    import torch
    from pathlib import Path
    from plumbing import checkpoint
    model = torch.nn.Linear(4096, 4096)  # 64 MiB of weights: each save takes a while
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    for epoch in range(10_000):
        checkpoint.save(Path(sys.argv[1]), model, optimizer, scheduler, epoch)
""")


def test_a_temporary_file_left_by_a_kill_during_a_save_is_removed_by_the_next_save(tmp_path):
    path = tmp_path / "checkpoint.pt"
    left = []
    for attempt in range(5):  # until the kill lands inside a save (nearly always the first)
        saver = subprocess.Popen([sys.executable, "-c", SAVE_FOREVER, str(path)], cwd=REPO,
                                 env=base_env())
        while not (left := list(tmp_path.glob(".checkpoint.pt.*.tmp"))):
            assert saver.poll() is None, "the saving process ended"
            time.sleep(0.01)
        saver.send_signal(signal.SIGKILL)  # no cleanup runs
        saver.wait()
        left = list(tmp_path.glob(".checkpoint.pt.*.tmp"))
        if left:
            break
    assert left, "the kill never landed inside a save"
    (tmp_path / "other").mkdir()
    _, state = saved_checkpoint(tmp_path / "other")  # another process saves into the folder
    checkpoint.save(path, *state, 7)
    assert list(tmp_path.glob(".checkpoint.pt.*.tmp")) == []
    assert checkpoint.load(path)["epoch"] == 7


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04"])
def test_an_empty_or_cut_checkpoint_is_one_clear_error(tmp_path, content):
    (tmp_path / "checkpoint.pt").write_bytes(content)
    with pytest.raises(common.UserError, match="corrupt or not a checkpoint") as error:
        checkpoint.load(tmp_path / "checkpoint.pt")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("extra, expected", [
    ({"position": {"step": "4", "loss_sum": 1.0, "samples": 96}}, "its 'position' is"),
    ({"position": {"step": 4, "loss_sum": float("nan"), "samples": 96}}, "its 'position' is"),
    ({"position": {"step": -1, "loss_sum": 0.0, "samples": 0}}, "its 'position' is"),
    ({"position": [4, 0.0, 96]}, "its 'position' is"),
    ({"rng": [{"cpu": torch.zeros(3)}]}, "its 'rng' is not a list of random states"),
    ({"rng": "state"}, "its 'rng' is not a list of random states"),
])
def test_a_step_07_checkpoint_with_a_damaged_position_is_one_clear_error(tmp_path, extra,
                                                                         expected):
    path, state = saved_checkpoint(tmp_path)
    checkpoint.save(path, *state, 1, **extra)
    with pytest.raises(common.UserError, match=expected) as error:
        checkpoint.load(path)
    assert "\n" not in str(error.value)


def test_the_timeline_names_an_empty_trace(tmp_path):
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "rank0.1.pt.trace.json").write_text("")
    proc = launch([sys.executable, str(REPO / "bench" / "timeline.py"), str(tmp_path),
                   "-o", str(tmp_path / "out.png")], check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ") and "rank0.1.pt.trace.json" in proc.stderr
    assert not (tmp_path / "out.png").exists()


def test_a_random_state_file_that_meets_a_full_disk_is_absent_not_cut(small_disk):
    """Step 09's per-rank files (rng-rank<R>.pt, run.json) are written through a temporary
    file, fsync and a rename: a full disk leaves neither a cut file nor the temporary one."""
    from plumbing import step09_dcp_checkpoint as dcp_checkpoint
    (small_disk / "filler").write_bytes(b"\0" * (12 * 2**20 - 2**18))  # all but 256 KiB
    with pytest.raises(OSError, match="No space left"):
        dcp_checkpoint.write_atomically(small_disk / "rng-rank0.pt", b"\1" * 2**20)
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]
