"""A step copied out with common.py alone is what its docstring says: it runs offline on the
synthetic digits common.py draws, prints its progress inside the epoch, refuses a count of 0 in
one line, and trains as it does in the repository. And it is as safe as in the repository (the
red team's cases of issue 60, on a copied 09): a .metadata pickle that would run code is
refused, nothing is written through a link planted at its next folder's name, and a folder of
the user's beside its checkpoints survives its commits."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import sys

import pytest
import torch

import common
from conftest import REPO, copy_out, launch, read_summary, torchrun_cmd

SMALL = ["--data", "synthetic", "--train-samples", "512", "--test-samples", "200",
         "--batch-size", "64", "--epochs", "1", "--no-dropout"]
# 09, the last step of the main line, needs torch 2.9 on gloo (the README's "Versions").
LAST = "09_distributed_checkpoint.py"
FSDP_ON_GLOO = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 9)
OFFLINE = os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip")


def offline(cmd: list) -> list:
    """`cmd` in a network namespace of its own, with only a loopback: no network at all."""
    if not OFFLINE:
        return cmd
    return ["unshare", "--net", "--", "bash", "-c", 'ip link set lo up && exec "$@"', "_",
            *map(str, cmd)]


def result(out) -> tuple:
    summary = read_summary(out)
    return summary["test_loss"], summary["test_accuracy"]


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    """00, 02, 03, 03b (ZeRO-2 by hand) and 09 copied out, each run offline; 00 in the
    repository too, on the same flags. 09 checkpoints every 4 steps, beside a folder of the
    user's."""
    root = tmp_path_factory.mktemp("copied")
    folder = root / "steps"
    copy_out(["00_single_gpu.py", "02_manual_ddp.py", "03_ddp_wrapper.py",
              "03b_sharded_optimizer.py", LAST], folder)
    (root / "09" / "checkpoint-epoch-best").mkdir(parents=True)
    (root / "09" / "checkpoint-epoch-best" / "mine.txt").write_text("the user's")
    (root / "09" / ".checkpoint.link").write_text("the user's")  # (09 deleted it)
    runs = {"folder": folder}
    for name, script, where, extra in [
            ("00", "00_single_gpu.py", folder, []), ("00 repo", "00_single_gpu.py", REPO, []),
            ("02", "02_manual_ddp.py", folder, []), ("03", "03_ddp_wrapper.py", folder, []),
            ("03b", "03b_sharded_optimizer.py", folder, ["--zero-stage", "2"]),
            *([("09", LAST, folder, ["--checkpoint-every", "4"])] if FSDP_ON_GLOO else [])]:
        out = root / name.replace(" ", "-")
        args = [script, *SMALL, *extra, "--out-dir", out]
        cmd = [sys.executable, *args] if name.startswith("00") else torchrun_cmd(2, *args)
        proc = launch(offline(cmd) if where == folder else cmd, cwd=where)
        runs[name] = (proc.stdout, out)
    return runs


def test_a_copied_step_runs_offline_and_prints_its_progress(copied):
    """Offline (a network namespace with a loopback only, where this machine allows one), on
    --data synthetic, with a progress line inside the epoch. The plain copy's lines have no
    FLOP rate (only the repository's harness measures it). (--quiet: test_ddp.py's copies.)"""
    for name in ("00", "02", "03", "03b", "09"):
        if name not in copied:
            continue
        stdout = copied[name][0]
        assert "test accuracy" in stdout and "FLOP/s" not in stdout, (name, stdout)
        assert "epoch 1: step 4/8 (50%)" in stdout, (name, stdout)
    if not OFFLINE:
        pytest.skip("ran with the network: unshare needs root and iproute2 here")


def test_a_copied_step_trains_as_the_repository_does(copied):
    """The synthetic digits a copy draws are the repository's: 00 ends with the repository's
    test loss and accuracy to the last digit; 02 and 03b (ZeRO-2 by hand) with 03's (bit for
    bit on 2 ranks), and 09, FSDP2 and DCP, with their accuracy, as the README's table has
    them. (That a copy of 02-05 trains as the repository does: test_ddp.py, on MNIST-format
    files.)"""
    assert result(copied["00"][1]) == result(copied["00 repo"][1])
    assert result(copied["02"][1]) == result(copied["03"][1]) == result(copied["03b"][1])
    if "09" in copied:
        assert result(copied["09"][1])[1] == result(copied["03"][1])[1]


def test_a_copied_step_refuses_a_count_of_0_in_one_line(tmp_path):
    """--max-device-batch 0 is no limit of 0 samples: refused, as the repository refuses it."""
    folder = tmp_path / "copied"
    copy_out(["00_single_gpu.py"], folder)
    proc = launch([sys.executable, "00_single_gpu.py", "--max-device-batch", "0"], cwd=folder,
                  check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--max-device-batch: must be a whole number of at least 1, not 0" in proc.stderr


def test_save_atomically_writes_through_no_planted_link(tmp_path):
    """A link planted where a temporary file would be named (the old name was
    .<name>.<pid>.tmp) receives nothing: the temporary file is made new (mkstemp), and a
    write that fails leaves none behind."""
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    run_dir.mkdir()
    outside.write_text("the user's file")
    (run_dir / f".checkpoint.pt.{os.getpid()}.tmp").symlink_to(outside)
    common.save_atomically(run_dir / "checkpoint.pt", lambda file: file.write(b"saved"))
    assert outside.read_text() == "the user's file"
    assert (run_dir / "checkpoint.pt").read_text() == "saved"
    assert not (run_dir / "checkpoint.pt").is_symlink()

    def fails(file):
        file.write(b"half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):
        common.save_atomically(run_dir / "summary.json", fails)
    assert sorted(p.name for p in run_dir.iterdir()) == [
        f".checkpoint.pt.{os.getpid()}.tmp", "checkpoint.pt"]



def test_save_atomically_writes_only_through_its_own_descriptor(tmp_path):
    """A link swapped in at the temporary file's name while it is written (a racing writer of
    that folder: it won, with inotify, against 08b's checkpoints) receives nothing: the file is
    written through the descriptor mkstemp opened, and a swapped name is refused, not renamed
    into place as the checkpoint."""
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    run_dir.mkdir()
    outside.write_text("the user's file")

    def swapped_then_written(file):
        [temporary] = run_dir.glob(".checkpoint.pt.*.tmp")
        (run_dir / "link").symlink_to(outside)
        os.replace(run_dir / "link", temporary)  # the race, won
        file.write(b"saved")
    with pytest.raises(OSError, match="was replaced by another file while it was written"):
        common.save_atomically(run_dir / "checkpoint.pt", swapped_then_written)
    assert outside.read_text() == "the user's file"
    assert list(run_dir.iterdir()) == []

# ---------------------------------------------------------------- a copied 09 is safe
class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


needs_09 = pytest.mark.skipif(not FSDP_ON_GLOO, reason="09 needs torch 2.9 on gloo")


@needs_09
def test_a_copied_09_keeps_a_folder_it_did_not_make(copied):
    out = copied["09"][1]
    assert (out / "checkpoint-epoch-best" / "mine.txt").read_text() == "the user's"
    assert (out / ".checkpoint.link").read_text() == "the user's"
    assert sorted(p.name for p in out.glob("checkpoint*")) == [
        "checkpoint", "checkpoint-epoch-best", "checkpoint-epoch1-end"]
    assert not list(out.glob(".link.*"))  # 09's temporary links, each renamed into place


@needs_09
def test_a_copied_09_replaces_no_folder_of_yours_named_checkpoint(copied, tmp_path):
    """Only 09's own link, or a real checkpoint (a run folder copied with `scp -r`), is
    replaced at a commit: a folder of the user's at that name stops the run in one line."""
    out = tmp_path / "out"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "notes.txt").write_text("the user's")
    proc = launch([sys.executable, LAST, *SMALL, "--checkpoint-every", 0, "--out-dir", out],
                  cwd=copied["folder"], check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{out / 'checkpoint'} is neither 09's link nor a checkpoint" in proc.stderr
    assert (out / "checkpoint" / "notes.txt").read_text() == "the user's"
    assert (out / "checkpoint-epoch1-end" / ".metadata").is_file()  # complete, kept


@needs_09
def test_a_copied_09_refuses_metadata_that_would_run_code(copied, tmp_path):
    """The resume and the export read .metadata with 09's own restricted unpickler."""
    saved = tmp_path / "checkpoint"
    shutil.copytree((copied["09"][1] / "checkpoint").resolve(), saved)
    marker = tmp_path / "code-ran"
    (saved / ".metadata").write_bytes(pickle.dumps(Payload(marker), protocol=4))
    proc = launch(torchrun_cmd(2, LAST, *SMALL, "--epochs", 2, "--resume", saved,
                               "--out-dir", tmp_path / "second"), cwd=copied["folder"],
                  check=False)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "posix.system is not allowed" in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists()  # the payload never ran
    export = launch([sys.executable, LAST, "export", "--resume", saved, "--out-dir",
                     tmp_path / "export"], cwd=copied["folder"], check=False)
    assert export.returncode != 0 and not marker.exists(), export.stderr[-3000:]


@needs_09
def test_a_copied_09_reads_no_file_outside_its_checkpoint_and_waits_on_no_fifo(copied, tmp_path):
    """A .metadata naming shards elsewhere (here: the real ones, by absolute path) is refused
    before any is read; a FIFO planted as run.json is a damaged file, not a wait forever."""
    real = (copied["09"][1] / "checkpoint").resolve()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    metadata = pickle.loads((real / ".metadata").read_bytes())  # (the test's own: trusted)
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=str(
        real / info.relative_path)) for index, info in metadata.storage_data.items()}
    (elsewhere / ".metadata").write_bytes(pickle.dumps(metadata))
    export = launch([sys.executable, LAST, "export", "--resume", elsewhere, "--out-dir",
                     tmp_path / "export"], cwd=copied["folder"], check=False, timeout=120)
    assert export.returncode != 0, export.stdout[-2000:]
    assert f"{elsewhere} has no {real}/__0_0.distcp, which .metadata names" in export.stderr
    assert not (tmp_path / "export" / "checkpoint.pt").exists()

    fifo = tmp_path / "fifo"
    shutil.copytree(real, fifo)
    (fifo / "run.json").unlink()
    os.mkfifo(fifo / "run.json")
    proc = launch([sys.executable, LAST, *SMALL, "--epochs", 2, "--resume", fifo,
                   "--out-dir", tmp_path / "second"], cwd=copied["folder"], check=False,
                  timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"error: {fifo / 'run.json'} is damaged or unreadable" in proc.stderr


def test_profile_writes_into_no_planted_link(tmp_path):
    """--profile's traces go to <out-dir>/profile: a link planted there is refused in one line,
    in the repository (the harness's profiler) as in a copy (common.Progress's)."""
    folder, outside = tmp_path / "copied", tmp_path / "outside"
    copy_out(["00_single_gpu.py"], folder)
    outside.mkdir()
    for where in (REPO, folder):
        out = tmp_path / f"out-{where.name}"
        out.mkdir()
        (out / "profile").symlink_to(outside, target_is_directory=True)
        proc = launch([sys.executable, "00_single_gpu.py", *SMALL, "--profile", "--out-dir", out],
                      cwd=where, check=False)
        assert proc.returncode == 2 and proc.stderr == (
            f"error: {out / 'profile'} is a symbolic link: not writing into it\n"), proc.stderr
    assert list(outside.iterdir()) == []

