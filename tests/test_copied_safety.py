"""A step copied out of the repository with common.py alone (no harness/) is as safe as in it
(the red team's cases of issue 60): step 09, on 2 CPU ranks under torchrun.

- A checkpoint folder whose .metadata is a pickle calling os.system: the resume refuses it and
  the command never runs (09's own MetadataUnpickler).
- A link planted at the name of 09's next checkpoint folder: nothing is written through it, and
  the run stops; a folder of the user's beside the checkpoints (checkpoint-epoch-best) survives
  every commit (09 removes only folders it made).
"""

import os
import pickle
import sys

from conftest import copy_out, launch, torchrun_cmd

STEP = "09_distributed_checkpoint.py"
SMALL = ["--data", "synthetic", "--train-samples", 96, "--test-samples", 20, "--batch-size", 24,
         "--epochs", 1, "--quiet"]


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def copied(tmp_path):
    folder = tmp_path / "copied"
    copy_out([STEP], folder)
    return folder


def run_copied(folder, *args, check=True):
    return launch(torchrun_cmd(2, STEP, *map(str, args)), cwd=folder, check=check, timeout=300)


def test_a_copied_09_refuses_metadata_that_would_run_code(tmp_path):
    folder = copied(tmp_path)
    run_copied(folder, *SMALL, "--out-dir", tmp_path / "first")
    saved = (tmp_path / "first" / "checkpoint").resolve()
    marker = tmp_path / "code-ran"
    (saved / ".metadata").write_bytes(pickle.dumps(Payload(marker), protocol=4))
    proc = run_copied(folder, *SMALL, "--epochs", 2, "--resume", saved,
                      "--out-dir", tmp_path / "second", check=False)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "posix.system is not allowed" in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists()  # the payload never ran
    export = launch([sys.executable, STEP, "export", "--resume", saved, "--out-dir",
                     tmp_path / "export"], cwd=folder, check=False)
    assert export.returncode != 0 and not marker.exists(), export.stderr[-3000:]


def test_a_copied_09_writes_nothing_through_a_planted_link(tmp_path):
    folder = copied(tmp_path)
    outside, out = tmp_path / "outside", tmp_path / "out"
    outside.mkdir()
    out.mkdir()
    (out / "checkpoint-epoch1-step2").symlink_to(outside, target_is_directory=True)
    proc = run_copied(folder, *SMALL, "--checkpoint-every", 2, "--out-dir", out, check=False)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "it is a symbolic link, and 09 writes only into folders it makes" in proc.stderr, \
        proc.stderr[-3000:]
    assert list(outside.iterdir()) == []  # no .metadata, shard or random state went there
    assert (out / "checkpoint-epoch1-step2").is_symlink()


def test_a_copied_09_keeps_a_folder_it_did_not_make(tmp_path):
    folder = copied(tmp_path)
    out = tmp_path / "out"
    (out / "checkpoint-epoch-best").mkdir(parents=True)
    (out / "checkpoint-epoch-best" / "mine.txt").write_text("the user's")
    run_copied(folder, *SMALL, "--checkpoint-every", 2, "--out-dir", out)
    assert (out / "checkpoint-epoch-best" / "mine.txt").read_text() == "the user's"
    assert sorted(p.name for p in out.glob("checkpoint*")) == [
        "checkpoint", "checkpoint-epoch-best", "checkpoint-epoch1-end"]
