"""Issue 27, item 6: failures that ended in a traceback, each met for real (a real full
filesystem, a real SIGKILL, real files), since the real failure often raises another exception
type than a mock: a full disk inside torch.save raises RuntimeError, not OSError.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import common
from harness import checkpoint
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
    from harness import step09_dcp_checkpoint as dcp_checkpoint
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
    from harness import checkpoint
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
    ({"rng": [{"cpu": torch.zeros(3)}]}, "the random state of rank 0 is not one torch can set"),
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


def test_09s_small_files_that_meet_a_full_disk_are_absent_not_cut(small_disk):
    """Step 09's own files beside its shards, each written to a temporary file then renamed:
    rng-rank<R>.pt (common.save_torch, as the harness checks it) and run.json
    (common.save_atomically). A full disk leaves neither a cut file nor the temporary one."""
    (small_disk / "filler").write_bytes(b"\0" * (12 * 2**20 - 2**18))  # all but 256 KiB
    with pytest.raises((OSError, RuntimeError)) as raised:  # (torch's: "unexpected pos")
        common.save_torch(small_disk / "rng-rank0.pt", {"cpu": torch.ones(2**18)})  # 1 MiB
    assert "No space left" in f"{raised.value} {raised.value.__context__}", raised.value
    with pytest.raises(OSError, match="No space left"):
        common.save_atomically(small_disk / "run.json", lambda file: file.write(b"\1" * 2**20))
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


# ---------------------------------------------------------------- issue 39, items 4, 5, 7, 8
@pytest.fixture
def tmpfs(tmp_path):
    """mount(options) -> a folder holding a real tmpfs of its own (size=..., nr_inodes=...),
    unmounted after the test."""
    disks = []

    def mount(options: str) -> Path:
        disk = tmp_path / f"disk{len(disks)}"
        disk.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)],
                                 capture_output=True, text=True)
        if mounted.returncode:
            pytest.skip(f"cannot mount a tmpfs here (root needed): {mounted.stderr}")
        disks.append(disk)
        return disk

    yield mount
    for disk in disks:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk: Path, leave: int = 0) -> None:
    """Fill `disk` with one file until `leave` bytes (about: tmpfs counts 4 KiB pages) are left."""
    with open(disk / "filler", "wb") as f:
        try:
            if leave:
                f.write(b"\0" * (shutil.disk_usage(disk).free - leave))
            else:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        except OSError:  # ENOSPC: full
            pass


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


SMALL_RUN = ["--data", "synthetic", "--train-samples", 24 * 8, "--test-samples", 20,
             "--batch-size", 24, "--epochs", 1, "--quiet"]


def test_a_disk_full_before_the_run_starts_is_one_line_before_training(tmpfs):
    """TensorBoard's SummaryWriter writes from a thread of its own: on a full disk that thread
    failed, and the step ended in two tracebacks (the thread's, and the same error raised again
    in the main thread). Every step 00-09 opens it in one place (metrics.open_tensorboard)."""
    disk = tmpfs("size=1m")
    fill(disk)
    proc = run_step("00_single_gpu.py", [*SMALL_RUN, "--out-dir", disk / "run"], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_no_traceback(proc)
    assert error_lines(proc) == [f"error: could not write TensorBoard's event file in "
                                 f"{disk / 'run'}: No space left on device"], proc.stderr
    assert "epoch 1" not in proc.stdout and not (disk / "run" / "checkpoint.pt").exists()


def test_a_full_disk_during_profile_is_one_line_and_leaves_no_partial_trace(tmpfs):
    """torch's exporter writes <trace>.tmp and renames it; on a full disk it silently left the
    part it wrote (here ~250 KiB), and our reading of the missing trace ended in a traceback."""
    disk = tmpfs("size=2m")
    fill(disk, leave=256 * 1024)
    free = shutil.disk_usage(disk).free
    proc = run_step("00_single_gpu.py", [*SMALL_RUN, "--profile", "--out-dir", disk / "run"],
                    check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_no_traceback(proc)
    errors = error_lines(proc)
    assert len(errors) == 1 and errors[0].startswith(
        f"error: could not write the profiler's trace {disk / 'run' / 'profile'}/rank0."), errors
    assert "disk full?" in errors[0]
    assert list((disk / "run" / "profile").iterdir()) == []
    assert shutil.disk_usage(disk).free >= free - 8192  # (the event file: one page)


def test_06_prepare_on_a_full_disk_is_one_line_and_leaves_no_temporary_file(tmpfs):
    """h5py met the full disk in a destructor (tracebacks it could not raise) and the process
    then crashed in HDF5's close (SIGSEGV), leaving its temporary file, which kept the disk
    full. Now the file is built in memory and written by checkpoint.write_atomically; the
    temporary file of a process that died earlier is removed too."""
    disk = tmpfs("size=2m")
    dead = subprocess.Popen(["true"])
    dead.wait()  # a process id that no longer runs
    left = disk / f".digits.h5.{socket.gethostname()}.{dead.pid}.tmp"
    left.write_bytes(b"\0" * 2**17)  # what a crashed prepare left
    fill(disk, leave=256 * 1024)
    proc = run_step("06_streaming_h5.py", [
        "prepare", "--data", "synthetic", "--train-samples", 4000, "--test-samples", 100,
        "--h5", disk / "digits.h5"], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]  # not -11 (SIGSEGV)
    assert_no_traceback(proc)
    assert error_lines(proc) == [f"error: cannot write {disk / 'digits.h5'}: No space left on "
                                 f"device"], proc.stderr
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]


def stop_and_remount_read_only(proc: subprocess.Popen, disk: Path) -> None:
    """Make `disk` read-only under a running process, between two of its writes: Linux refuses
    (EBUSY) while a file is open for writing, so try again until it lands between two."""
    for _ in range(200):
        proc.send_signal(signal.SIGSTOP)
        remounted = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True)
        proc.send_signal(signal.SIGCONT)
        if remounted.returncode == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"could not remount {disk} read-only: {remounted.stderr}")


def test_a_filesystem_that_turns_read_only_mid_run_is_one_line_and_keeps_the_checkpoint(
        tmpfs):
    """Step 07 (plain python), checkpointing every 2 steps; the disk turns read-only after the
    first checkpoint. The next save fails at its first write; its cleanup then raised EROFS
    too (a read-only filesystem refuses even to unlink a missing file), as a traceback: every
    atomic write goes through checkpoint.write_atomically, whose cleanup never raises."""
    disk = tmpfs("size=64m")
    cmd = [sys.executable, "07_fault_tolerance.py", "--data", "synthetic", "--train-samples",
           24 * 60, "--test-samples", 20, "--batch-size", 24, "--epochs", 1,
           "--checkpoint-every", 2, "--quiet", "--out-dir", disk]
    proc = subprocess.Popen(list(map(str, cmd)), cwd=REPO, env=base_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (disk / "checkpoint.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        stop_and_remount_read_only(proc, disk)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert proc.returncode == 2, stderr[-3000:]
    assert_no_traceback(done)
    assert error_lines(done) == [f"error: could not write checkpoint {disk / 'checkpoint.pt'}: "
                                 f"Read-only file system; the previous checkpoint is unchanged"]
    assert checkpoint.load(disk / "checkpoint.pt")["position"]["step"] >= 2
    assert not list(disk.glob(".*.tmp"))


COMMITS = textwrap.dedent("""
    import json, subprocess, sys
    from pathlib import Path
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from concurrent.futures import Future
    import importlib
    import common
    from harness import step09_dcp_checkpoint as dcp_checkpoint

    out = Path(sys.argv[1])
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1)
    step09 = importlib.import_module("09_distributed_checkpoint")  # its own Commits, checked
    dcp_checkpoint.around(Path(step09.__file__)).__enter__()  # as errors.run_main enters it
    commits = step09.Commits(out, common.Run(torch.device("cpu")), {"run": 1})
    done = Future()
    done.set_result(None)

    def save(name):  # what 09's save() does, with a synchronous dcp.save
        folder = commits.new_folder(name, common.rng_state())
        dcp.save({"w": torch.ones(4)}, checkpoint_id=folder)
        commits.started(done)

    def use_every_inode(use):
        for n in range(10_000):
            try:
                (out / f"inode{n}").touch() if use else (out / f"inode{n}").unlink()
            except OSError:
                return

    def attempt(what, action, *args):
        try:
            action(*args)
            print(json.dumps([what, None]), flush=True)
        except common.UserError as err:
            print(json.dumps([what, str(err)]), flush=True)

    save("a")
    commits.finish()  # committed: checkpoint -> checkpoint-a
    save("b")
    use_every_inode(True)
    attempt("commit, no inodes", commits.finish)
    attempt("mkdir, no inodes", commits.new_folder, "c", {})
    use_every_inode(False)
    save("d")
    subprocess.run(["mount", "-o", "remount,ro", str(out)], check=True)
    attempt("commit, read-only", commits.finish)
    attempt("mkdir, read-only", commits.new_folder, "e", {})
    dist.destroy_process_group()
""")


def test_09_a_folder_or_link_it_cannot_create_is_one_line_and_loses_nothing(tmpfs, tmp_path):
    """Step 09's Commits on a real filesystem with no inodes left, then read-only: the folder of
    the next checkpoint (mkdir) and the commit (a new link renamed over the old one) raised
    OSError as tracebacks. Now each is one line (a UserError: exit 2 on every rank), the link
    still names the last committed checkpoint, and a complete checkpoint whose commit failed
    is kept, named in the line."""
    from harness import step09_dcp_checkpoint as dcp_checkpoint
    disk = tmpfs("size=16m,nr_inodes=64")
    proc = launch([sys.executable, "-c", COMMITS, str(disk), str(tmp_path / "store")])
    said = dict(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("["))
    for what, folder in [("commit, no inodes", "b"), ("commit, read-only", "d")]:
        assert said[what] == (
            f"could not commit checkpoint {disk}/checkpoint-{folder}: "
            + ("No space left on device (no inodes left there, though bytes are: see df -i)"
               if "inodes" in what else "Read-only file system")
            + f"; it is complete: resume from it with --resume {disk}/checkpoint-{folder} "
            f"({disk}/checkpoint still names checkpoint-a)"), said[what]
    for what, folder in [("mkdir, no inodes", "c"), ("mkdir, read-only", "e")]:
        assert said[what] == (
            f"could not write checkpoint {disk}/checkpoint-{folder}: "
            + ("No space left on device (no inodes left there, though bytes are: see df -i)"
               if "inodes" in what else "Read-only file system")
            + "; removed it, the last complete checkpoint, checkpoint-a, is unchanged"), \
            said[what]
    assert os.readlink(disk / "checkpoint") == "checkpoint-a"
    for folder in "abd":  # the link's, and the two whose commit failed: complete
        dcp_checkpoint.complete_folder(disk / f"checkpoint-{folder}")


# ---------------------------------------------------------------- issue 43: files outside the run
VICTIM = b"a file outside the run, which no run may write\n"


def victim(tmp_path: Path) -> Path:
    """A file outside the --out-dir that a planted link points to."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(VICTIM)
    return outside / "victim"


@pytest.mark.parametrize("script", ["03_ddp_wrapper.py", "07_fault_tolerance.py"])
def test_a_lock_file_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, script):
    """07 wrote "process N on HOST" through <out-dir>/.lock when it was a symbolic link; 03 takes
    the same lock now (metrics.Metrics claims the --out-dir for steps 00-06)."""
    target = victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").symlink_to(target)
    proc = run_step(script, [*SMALL_RUN, "--out-dir", out], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_no_traceback(proc)
    assert error_lines(proc) == [f"error: {out / '.lock'} is a symbolic link; not writing "
                                 f"through it. Remove it (a run makes it a plain file)"]
    assert target.read_bytes() == VICTIM
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # no checkpoint, no summary


@pytest.mark.parametrize("kind", ["hard link", "FIFO"])
def test_a_lock_file_that_is_a_hard_link_or_a_fifo_is_refused_without_waiting(tmp_path, kind):
    """O_NOFOLLOW stops symbolic links only: a hard link named .lock (a second name of a
    user's file) was overwritten with "process N on vm", and a FIFO named .lock hung the step
    in open() with no word (issue 60). Both are one line now, before any work."""
    target = victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    if kind == "hard link":
        os.link(target, out / ".lock")
    else:
        os.mkfifo(out / ".lock")
    proc = run_step("03_ddp_wrapper.py", [*SMALL_RUN, "--out-dir", out], check=False,
                    timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_no_traceback(proc)
    what = ("a hard link (a second name of another file)" if kind == "hard link" else
            "not a plain file (a FIFO, a device)")
    assert error_lines(proc) == [f"error: {out / '.lock'} is {what}; not writing through it. "
                                 f"Remove it (a run makes it a plain file)"]
    assert target.read_bytes() == VICTIM
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # no checkpoint, no summary


def test_a_link_planted_at_the_temporary_name_is_not_written_through(tmp_path):
    """The temporary file of a save was `.<name>.<host>.<pid>.tmp`, and the pid is the one that
    <out-dir>/.lock prints: a link planted under that name before the save made the checkpoint
    (and summary.json) go wherever it pointed. Planted here before the step even starts; and at
    each name TensorBoard's event file could have had (time, host, pid), which it wrote through."""
    target = victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "00_single_gpu.py", *map(str, SMALL_RUN),
                             "--out-dir", str(out)], cwd=REPO, env=base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    planted = [out / f".{name}.{socket.gethostname()}.{proc.pid}.tmp"
               for name in ("checkpoint.pt", "summary.json")]
    now = int(time.time())
    planted += [out / f"events.out.tfevents.{t:010d}.{socket.gethostname()}.{proc.pid}.{n}"
                for t in range(now - 2, now + 90) for n in (0, 1)]
    for link in planted:
        link.symlink_to(target)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-3000:]
    assert target.read_bytes() == VICTIM
    for name in ("checkpoint.pt", "summary.json"):
        assert (out / name).is_file() and not (out / name).is_symlink()
    assert checkpoint.load(out / "checkpoint.pt")["epoch"] == 1
    assert all(link.is_symlink() for link in planted)  # left alone while their process ran
    # The process is gone: the next save removes what is left under its name (the link, never
    # what it points to), as it removes a killed save's temporary file.
    _, state = saved_checkpoint(tmp_path / "outside")
    checkpoint.save(out / "checkpoint.pt", *state, 3)
    assert not planted[0].is_symlink() and target.read_bytes() == VICTIM


def test_the_room_check_of_10_and_11_replaces_no_file_of_yours(tmp_path):
    """check_room writes a probe in --out-dir and removes it: at a fixed name, .write-check,
    it replaced and then deleted a file of the user's there."""
    (tmp_path / ".write-check").write_text("the user's")
    checkpoint.check_room(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".write-check"]
    assert (tmp_path / ".write-check").read_text() == "the user's"

def test_two_runs_of_steps_00_06_in_one_out_dir_are_refused_in_one_line(tmp_path):
    """07-09 refused a second run in their --out-dir; 00-06 let two runs overwrite each other's
    checkpoint and summary. The first run holds the lock while it trains; the second is
    refused before it writes anything."""
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "03_ddp_wrapper.py", *map(str, SMALL_RUN),
                              "--epochs", "1000", "--out-dir", str(out)], cwd=REPO,
                             env=base_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        while not (out / "checkpoint.pt").exists():  # training, past its start-up
            assert first.poll() is None, first.stderr.read()[-3000:]
            time.sleep(0.05)
        holder = f"process {first.pid} on {socket.gethostname()}"
        second = run_step("00_single_gpu.py", [*SMALL_RUN, "--out-dir", out], check=False)
        assert first.poll() is None, "the first run ended before the second was refused"
    finally:
        first.kill()
        first.communicate()
    assert second.returncode == 2, second.stderr[-3000:]
    assert_no_traceback(second)
    assert error_lines(second) == [
        f"error: --out-dir {out} is in use by another run ({holder}): two runs in one "
        f"--out-dir would replace each other's checkpoints. Give each run its own --out-dir"]
    assert "epoch 1" not in second.stdout


def test_a_link_planted_at_09s_next_checkpoint_folder_is_not_written_through(tmp_path):
    """09 names its checkpoint folders predictably (checkpoint-epoch1-step2): a link planted
    under that name made it write its random states, run.json and shards into the link's
    target. It now stops with one line and leaves the target and the link as they were."""
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint-epoch1-step2").symlink_to(outside, target_is_directory=True)
    proc = run_step("09_distributed_checkpoint.py", [*SMALL_RUN, "--checkpoint-every", 2,
                                                     "--out-dir", out], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_no_traceback(proc)
    errors = error_lines(proc)
    assert errors == [
        f"error: could not write checkpoint {out / 'checkpoint-epoch1-step2'}: it is a symbolic "
        f"link, and 09 writes only into folders it makes; left the link as it was, no complete "
        f"checkpoint was written before it"], errors
    assert list(outside.iterdir()) == []
    assert (out / "checkpoint-epoch1-step2").is_symlink()
