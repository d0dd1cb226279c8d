"""A step copied out with common.py alone is what its docstring says: it runs offline on the
synthetic digits common.py draws, prints its progress inside the epoch (not with --quiet),
refuses a count of 0 in one line, and trains as it does in the repository."""

from __future__ import annotations

import os
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
    """00, 02, 03 and 09 copied out, each run offline (03 with --quiet); 00 and 03 run in the
    repository too, on the same flags."""
    root = tmp_path_factory.mktemp("copied")
    folder = root / "steps"
    copy_out(["00_single_gpu.py", "02_manual_ddp.py", "03_ddp_wrapper.py", LAST], folder)
    runs = {}
    for name, script, where, extra in [
            ("00", "00_single_gpu.py", folder, []), ("00 repo", "00_single_gpu.py", REPO, []),
            ("02", "02_manual_ddp.py", folder, []), ("03", "03_ddp_wrapper.py", folder, ["--quiet"]),
            ("03 repo", "03_ddp_wrapper.py", REPO, ["--quiet"]),
            *([("09", LAST, folder, ["--checkpoint-every", "0"])] if FSDP_ON_GLOO else [])]:
        out = root / name.replace(" ", "-")
        args = [script, *SMALL, *extra, "--out-dir", out]
        cmd = [sys.executable, *args] if name.startswith("00") else torchrun_cmd(2, *args)
        proc = launch(offline(cmd) if where == folder else cmd, cwd=where)
        runs[name] = (proc.stdout, out)
    return runs


def test_a_copied_step_runs_offline_and_prints_its_progress(copied):
    """Offline (a network namespace with a loopback only, where this machine allows one), on
    --data synthetic, with a progress line inside the epoch; --quiet has none. The plain
    copy's lines have no FLOP rate (only the repository's harness measures it)."""
    for name in ("00", "02", "03", "09"):
        if name not in copied:
            continue
        stdout = copied[name][0]
        assert "test accuracy" in stdout and "FLOP/s" not in stdout, (name, stdout)
        progress = [line for line in stdout.splitlines() if ": step " in line]
        assert (not progress) if name == "03" else progress, (name, stdout)
    if not OFFLINE:
        pytest.skip("ran with the network: unshare needs root and iproute2 here")


def test_a_copied_step_trains_as_the_repository_does(copied):
    """The synthetic digits a copy draws are the repository's: 00 ends with the repository's
    test loss and accuracy to the last digit, 02 and 03 with the repository's 03 (02 = 03 bit
    for bit on 2 ranks), and 09, FSDP2 and DCP, with its accuracy (the README's table)."""
    assert result(copied["00"][1]) == result(copied["00 repo"][1])
    assert result(copied["02"][1]) == result(copied["03"][1]) == result(copied["03 repo"][1])
    if "09" in copied:
        assert result(copied["09"][1])[1] == result(copied["03 repo"][1])[1]


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
    common.save_atomically(run_dir / "checkpoint.pt", lambda path: path.write_text("saved"))
    assert outside.read_text() == "the user's file"
    assert (run_dir / "checkpoint.pt").read_text() == "saved"
    assert not (run_dir / "checkpoint.pt").is_symlink()

    def fails(path):
        path.write_text("half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):
        common.save_atomically(run_dir / "summary.json", fails)
    assert sorted(p.name for p in run_dir.iterdir()) == [
        f".checkpoint.pt.{os.getpid()}.tmp", "checkpoint.pt"]
