"""Step 09: FSDP2 with distributed checkpoints (DCP) still trains like DDP, and its checkpoints
resume on any number of ranks, survive a rank killed mid-save, export to one plain file, and
never run code that a file holds.

Every run is 2 epochs of 20 steps (conftest.RESTART_ARGS), or the first of them; the weights of
a run are read back from its final DCP checkpoint, in this process, without a process group.
"""

import dataclasses
import io
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import (PORT_TAKEN_RERUNS, RESTART_ARGS, TEST_SAMPLES, LazyRuns,
                      assert_no_traceback, children, copied_run_killed_at_step_27,
                      frames_of_ours, launch, read_summary, run_step, start, torchrun_cmd)
from harness import step09_dcp_checkpoint as dcp_checkpoint
from harness.errors import UserError
from harness.model import Net

STEP = "09_distributed_checkpoint.py"


def final_weights(out: Path) -> dict:
    """The model in <out>/checkpoint (the link to the newest complete DCP checkpoint)."""
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(dcp_checkpoint.complete_folder(out / "checkpoint"), Path(tmp) / "all.pt")
        return torch.load(Path(tmp) / "all.pt", weights_only=True)["model"]


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(mnist_root, tmp_path_factory):
    """09 on 2 ranks for 2 epochs ("straight"), and for 1 epoch ("first_epoch"); the 1-epoch
    checkpoint resumed for the second epoch on 1 rank and on 3 ranks. The resume on 1 rank
    continues in a copy of the 1-epoch run's folder as `scp -r` or `rsync -L` make it: its link,
    `checkpoint`, a real folder. Each run starts when a test first reads it (LazyRuns)."""
    root = tmp_path_factory.mktemp("dcp")
    args = [*RESTART_ARGS, "--data-dir", mnist_root]

    def start(name):
        out, extra, nproc = root / name, [], 2
        if name == "first_epoch":
            extra = ["--epochs", 1]
        elif name == "resumed_on_1":  # (symlinks=False: a copy, its link a folder)
            shutil.copytree(runs["first_epoch"]["out"], out)
            extra, nproc = ["--resume", out / "checkpoint"], 1
        elif name == "resumed_on_3":
            # A complete checkpoint a user keeps under a name of their own, in the --out-dir of
            # a run (test_a_folder_the_run_did_not_make_survives_its_commits).
            shutil.copytree((runs["first_epoch"]["out"] / "checkpoint").resolve(),
                            out / "checkpoint-best")
            extra, nproc = ["--resume", root / "first_epoch" / "checkpoint"], 3
        proc = run_step(STEP, [*args, *extra, "--out-dir", out], nproc=nproc)
        return {"out": out, "stdout": proc.stdout}

    runs = LazyRuns(start)
    return runs


def test_fsdp2_with_dcp_ends_with_the_weights_of_ddp(runs, uninterrupted_07):
    """As 08 (tests/test_fsdp2.py): bit-identical to DDP on 2 ranks, checkpointing as it goes."""
    ddp = torch.load(uninterrupted_07 / "checkpoint.pt", weights_only=True)["model"]
    assert max_difference(final_weights(runs["straight"]["out"]), ddp) == 0.0
    assert read_summary(runs["straight"]["out"])["train_losses"] == pytest.approx(
        read_summary(uninterrupted_07)["train_losses"], rel=1e-12)


def test_a_run_folder_copied_with_its_link_as_a_folder_commits_over_the_copy(runs):
    """The resume on 1 rank ran in a copied run folder whose `checkpoint` is a real folder: its
    first commit raised IsADirectoryError (a rename cannot put a link over a folder). Now the
    copy is moved aside and removed with the older checkpoints, and the link is a link again,
    to the run's last checkpoint (the run itself ended as the one on 3 ranks did: below)."""
    out = runs["resumed_on_1"]["out"]
    assert (out / "checkpoint").is_symlink()
    assert sorted(p.name for p in out.glob("*checkpoint*")) == ["checkpoint",
                                                                "checkpoint-epoch2-end"]
    dcp_checkpoint.complete_folder(out / "checkpoint")


def test_a_folder_the_run_did_not_make_survives_its_commits(runs):
    """Issue 43: a commit removed every checkpoint-* folder but its own, a user's
    checkpoint-best too. Now only folders of the names 09 makes go."""
    out = runs["resumed_on_3"]["out"]
    assert sorted(p.name for p in out.glob("checkpoint*")) == [
        "checkpoint", "checkpoint-best", "checkpoint-epoch2-end"]
    dcp_checkpoint.complete_folder(out / "checkpoint-best")  # whole, not only there


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_checkpoint_of_2_ranks_resumes_on_another_number_of_ranks(runs, ranks):
    resumed = read_summary(runs[f"resumed_on_{ranks}"]["out"])
    straight = read_summary(runs["straight"]["out"])
    assert resumed["world_size"] == ranks and len(resumed["params_per_rank"]) == ranks
    assert resumed["test_samples"] == TEST_SAMPLES  # every test sample counted once
    assert "resumed from" in runs[f"resumed_on_{ranks}"]["stdout"]
    # The same samples per step; other dropout masks and summation orders (the random streams
    # of another world size cannot be the same): about the same result, not the same bits.
    assert abs(resumed["test_accuracy"] - straight["test_accuracy"]) < 0.05
    assert resumed["train_losses"][0] == pytest.approx(straight["train_losses"][1], rel=0.05)


@PORT_TAKEN_RERUNS
def test_a_rank_killed_mid_save_resumes_from_the_previous_checkpoint_exactly(
        runs, mnist_root, tmp_path):
    """Rank 1 dies while writing its shards of the 3rd checkpoint (step 12 of epoch 1): the link
    still names the 2nd (step 8), torchrun restarts the group, and the run ends bit-identical
    to the uninterrupted one."""
    proc = run_step(STEP, [*RESTART_ARGS, "--data-dir", mnist_root, "--out-dir", tmp_path],
                    nproc=2, probe_dir=tmp_path / "probe",
                    env_extra={"PROBE_KILL_SAVE": "1:3", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": 1},
                    torchrun_extra=("--max-restarts", "1"))
    assert "at step 8 of epoch 1" in proc.stdout, proc.stdout[-3000:]
    assert max_difference(final_weights(tmp_path), final_weights(runs["straight"]["out"])) == 0
    assert sorted(p.name for p in tmp_path.glob("checkpoint*")) == [
        "checkpoint", "checkpoint-epoch2-end"]  # older and unfinished folders are gone


@PORT_TAKEN_RERUNS
def test_a_copied_09_killed_and_restarted_ends_as_the_uninterrupted_run(runs, mnist_root,
                                                                        tmp_path):
    """09 and common.py in an empty folder, without harness/: its plain dcp.async_save, the
    link it switches to commit a folder, and dcp.load carry a run killed at step 7 of epoch 2
    to the repository's uninterrupted test loss and accuracy, and its export loads plainly.
    (The save of step 4 of epoch 2 is committed by the next save, which the kill prevents: the
    restart continues from the end of epoch 1.)"""
    proc = copied_run_killed_at_step_27(STEP, [*RESTART_ARGS, "--data-dir", mnist_root],
                                        tmp_path)
    assert "checkpoint-epoch1-end at step 0 of epoch 2" in proc.stdout, proc.stdout
    assert "FLOP/s" not in proc.stdout and "test accuracy" in proc.stdout, proc.stdout
    copied, straight = read_summary(tmp_path / "out"), read_summary(runs["straight"]["out"])
    assert (copied["test_loss"], copied["test_accuracy"]) == (straight["test_loss"],
                                                              straight["test_accuracy"])
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint*")) == [
        "checkpoint", "checkpoint-epoch2-end"]
    launch([sys.executable, STEP, "export", "--resume", tmp_path / "out" / "checkpoint",
            "--out-dir", tmp_path / "export"], cwd=tmp_path / "copied")
    plain = torch.load(tmp_path / "export" / "checkpoint.pt", weights_only=True)
    Net().load_state_dict(plain["model"])  # strict: the keys of a plain Net
    assert max_difference(plain["model"], final_weights(runs["straight"]["out"])) == 0.0


def test_the_exported_checkpoint_loads_plainly_and_evaluates_the_same(runs, mnist_root,
                                                                      tmp_path):
    out = runs["straight"]["out"]
    run_step(STEP, ["export", "--resume", out / "checkpoint", "--out-dir", tmp_path])
    plain = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    model = Net()
    model.load_state_dict(plain["model"])  # strict: the keys of a plain Net, no prefixes
    assert max_difference(plain["model"], final_weights(out)) == 0.0
    # Step 00, resumed at its last epoch, only evaluates: the same test set, the same answers.
    run_step("00_single_gpu.py", ["--data", "mnist", "--data-dir", mnist_root, "--epochs", 2,
                                  "--resume", tmp_path / "checkpoint.pt",
                                  "--out-dir", tmp_path / "00"])
    assert (read_summary(tmp_path / "00")["test_correct"]
            == read_summary(out)["test_correct"])


class Payload:
    """What an attacker would put in a checkpoint: unpickling it runs a command (it creates
    `marker`)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def with_malicious_metadata(checkpoint: Path, folder: Path, marker: Path) -> Path:
    """A copy of a real checkpoint whose .metadata was replaced by a payload (the protocol DCP
    writes, so it is FRAMEd as a real one)."""
    shutil.copytree(checkpoint.resolve(), folder)
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker), protocol=4))
    return folder


def reaching_outside(checkpoint: Path, folder: Path) -> Path:
    """A copy of a real checkpoint whose .metadata sends every read of rank 1's shard to
    ../other/__1_0.distcp: a real shard, outside the folder."""
    shutil.copytree(checkpoint.resolve(), folder)
    (folder.parent / "other").mkdir()
    (folder / "__1_0.distcp").rename(folder.parent / "other" / "__1_0.distcp")
    with open(folder / ".metadata", "rb") as f:
        metadata = dcp_checkpoint.MetadataUnpickler(f).load()
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path="../other/__1_0.distcp")
        if info.relative_path == "__1_0.distcp" else info
        for index, info in metadata.storage_data.items()}
    (folder / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    return folder


def damaged_copy(checkpoint: Path, folder: Path, name: str, damage) -> Path:
    """A copy of a real checkpoint with one file damaged: damage(its bytes) -> new bytes."""
    shutil.copytree(checkpoint.resolve(), folder)
    (folder / name).write_bytes(damage((folder / name).read_bytes()))
    return folder


def test_a_checkpoint_that_is_incomplete_of_another_model_or_malicious_is_one_line(runs,
                                                                                   tmp_path):
    unfinished = tmp_path / "checkpoint-epoch1-step4"  # what a killed save leaves: no .metadata
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"half")
    marker = tmp_path / "code-ran"
    saved = runs["straight"]["out"] / "checkpoint"
    malicious = with_malicious_metadata(saved, tmp_path / "malicious", marker)
    # Damaged files (each torch error, as it was, said nothing of which file, or blamed the
    # model): an emptied .metadata, a shard cut short, a shard overwritten with garbage.
    empty = damaged_copy(saved, tmp_path / "empty", ".metadata", lambda data: b"")
    cut = damaged_copy(saved, tmp_path / "cut", "__1_0.distcp", lambda data: data[:len(data) // 2])
    garbage = damaged_copy(saved, tmp_path / "garbage", "__0_0.distcp",
                           lambda data: bytes(range(256)) * 64 + data[256 * 64:])
    # Issue 43: a shard named outside the folder was loaded silently; a run.json nested some
    # 100,000 lists deep ended in a RecursionError traceback.
    outside = reaching_outside(saved, tmp_path / "outside")
    missing = damaged_copy(saved, tmp_path / "missing", "run.json", lambda data: data)
    (missing / "__1_0.distcp").unlink()  # (copied in part: 09's reader names it, 2026-11-29)
    nested = damaged_copy(saved, tmp_path / "nested", "run.json",
                          lambda data: b"[" * 100_000 + b"]" * 100_000)
    for command, resume, extra, expected in [
            ("train", unfinished, [], "is not a complete DCP checkpoint"),
            ("train", saved, ["--width", "2"],
             "does not fit this model (ValueError: Size mismatch"),
            ("train", malicious, [], "is not a DCP checkpoint's metadata; not loading it "
                                     "(UnpicklingError: posix.system is not allowed"),
            ("export", malicious, [], "is not a DCP checkpoint's metadata"),
            ("export", empty, [], f"{empty / '.metadata'} is damaged or is not a DCP "
                                  f"checkpoint's metadata; not loading it (EOFError"),
            ("train", cut, [], f"checkpoint file {cut / '__1_0.distcp'} is damaged or "
                               f"unreadable; not loading it (RuntimeError: PytorchStreamReader"),
            ("export", garbage, [], f"checkpoint file {garbage / '__0_0.distcp'} is damaged or "
                                    f"unreadable; not loading it"),
            ("train", outside, [], f"{outside / '.metadata'} reaches outside its checkpoint "
                                   f"folder: it names '../other/__1_0.distcp', a file outside "
                                   f"{outside}; not loading it"),
            ("export", outside, [], f"{outside / '.metadata'} reaches outside its checkpoint"),
            ("export", missing, [], f"checkpoint {missing} is incomplete: its .metadata names "
                                    f"'__1_0.distcp', which is not in it (copied in part?)"),
            ("train", nested, [], f"{nested / 'run.json'} is damaged or unreadable "
                                  f"(RecursionError: ")]:
        proc = run_step(STEP, [command, "--data", "synthetic", "--train-samples", 96,
                               "--batch-size", 48, "--resume", resume, *extra,
                               "--out-dir", tmp_path / "out"], check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        errors = proc.stderr.strip().splitlines()
        assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
        assert_no_traceback(proc)
    assert not marker.exists()  # the payload never ran


def test_in_the_repository_09s_own_unpickler_is_the_one_that_refuses(runs, tmp_path,
                                                                     monkeypatch):
    """The harness checks a folder before dcp.load reads it (checked_load, which the harness
    puts in dcp.load's place while 09 runs) with 09's own SafeReader first: the refusal a
    learner reads in 09 (MetadataUnpickler.find_class) is the one that runs, in the repository
    as in a copy. (The harness's reader refused first, and 09's never ran.)"""
    import importlib
    step09 = importlib.import_module(Path(STEP).stem)
    met, find_class = [], step09.MetadataUnpickler.find_class

    def spy(self, module, name):
        met.append(f"{module}.{name}")
        return find_class(self, module, name)
    monkeypatch.setattr(step09.MetadataUnpickler, "find_class", spy)
    marker = tmp_path / "code-ran"
    malicious = with_malicious_metadata(runs["straight"]["out"] / "checkpoint",
                                        tmp_path / "malicious", marker)
    with pytest.raises(UserError, match="posix.system is not allowed in a checkpoint"):
        dcp_checkpoint.checked_load({}, storage_reader=step09.SafeReader(malicious))
    assert met == ["posix.system"] and not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no process group here
def test_a_saved_value_or_random_state_that_would_run_code_is_refused(tmp_path):
    """DCP stores a value that is not a tensor (the epoch, the scheduler) as a pickle, which
    torch 2.14's planner loads with weights_only=False; the RNG files are pickles too."""
    marker = tmp_path / "code-ran"
    dcp.save({"extra": {"epoch": Payload(marker)}}, checkpoint_id=tmp_path)
    with pytest.raises(UserError, match="holds something other than data; not loading it "
                                        r"\(UnpicklingError"):
        dcp_checkpoint.load({"extra": {"epoch": 0}}, dcp_checkpoint.complete_folder(tmp_path))
    torch.save(Payload(marker), tmp_path / "rng-rank0.pt")
    with pytest.raises(UserError, match="is not a random state; not loading it"):
        dcp_checkpoint.rng_state(tmp_path, type("Run", (), {"world_size": 1, "rank": 0}))
    assert not marker.exists()
    # ...and the payload is real: plain DCP would have run it.
    dcp.load({"extra": {"epoch": 0}}, checkpoint_id=tmp_path)
    assert marker.exists()



def torch_bytes(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("damage, expected", [
    (lambda data: b"", r"\(EOFError"),
    (lambda data: data[:len(data) // 2], r"\(RuntimeError: PytorchStreamReader"),
    (lambda data: torch_bytes(7), r"\(a int without a CPU random state\)"),  # plain data
])
def test_an_empty_cut_or_foreign_random_state_file_is_one_line(runs, tmp_path, damage, expected):
    """A rank's rng-rank<R>.pt, read when a mid-epoch checkpoint resumes on as many ranks."""
    shutil.copytree((runs["straight"]["out"] / "checkpoint").resolve(), tmp_path,
                    dirs_exist_ok=True)
    path = tmp_path / "rng-rank1.pt"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(UserError, match=f"{path} is damaged or is not a random state; not "
                                        f"loading it {expected}") as error:
        dcp_checkpoint.rng_state(tmp_path, type("Run", (), {"world_size": 2, "rank": 1}))
    assert "\n" not in str(error.value)


def with_a_stalled_shard(checkpoint: Path, folder: Path) -> Path:
    """A copy of a real checkpoint whose rank-1 shard is a FIFO that nobody writes: opening it
    blocks, as a file on a hung network filesystem does, so the load is where a signal lands."""
    shutil.copytree(checkpoint.resolve(), folder)
    (folder / "__1_0.distcp").unlink()
    os.mkfifo(folder / "__1_0.distcp")
    return folder


def signal_while_it_loads(cmd, out: Path, signum) -> tuple[int, str]:
    """Start cmd; once a process of it waits for the stalled shard (its kernel wait channel is
    a FIFO's), send `signum` to cmd's process (torchrun forwards it to every rank). Returns the
    exit code and the output."""
    out.mkdir()
    with open(out / "output.txt", "w+") as log:
        proc = start(cmd, log)
        deadline = time.monotonic() + 120  # a hang guard
        while not any(Path(f"/proc/{pid}/wchan").read_text() == "wait_for_partner"
                      for pid in [proc.pid, *children(proc.pid)] if Path(f"/proc/{pid}").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read()
            time.sleep(0.05)
        proc.send_signal(signum)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"still running 120 s after the signal:\n{log.read()}")
        log.seek(0)
        return proc.returncode, log.read()


def test_a_signal_during_the_checkpoint_load_ends_the_run_as_that_signal(runs, tmp_path):
    """DCP catches every exception on a rank, KeyboardInterrupt too, and sends it to every rank
    by pickle. A SIGTERM during the load (SLURM's preemption lands exactly there in a requeued
    job) was `TypeError: Interrupted.__init__()` on every rank (exit 1), a Ctrl-C "checkpoint
    ... does not fit this model" (exit 2), in export too. Now the signal's own line and exit
    code, and every rank ends by itself."""
    stalled = with_a_stalled_shard(runs["straight"]["out"] / "checkpoint", tmp_path / "stalled")
    code, output = signal_while_it_loads(
        [sys.executable, STEP, "export", "--resume", str(stalled), "--out-dir",
         str(tmp_path / "export")], tmp_path / "export", signal.SIGINT)
    assert (code, output.strip()) == (130, "error: interrupted (SIGINT): stopped at once, "
                                           "without a checkpoint (the last one saved is kept)")
    code, output = signal_while_it_loads(
        torchrun_cmd(2, STEP, "--data", "synthetic", "--train-samples", 96, "--batch-size", 48,
                     "--quiet", "--resume", stalled, "--out-dir", tmp_path / "two"),
        tmp_path / "two", signal.SIGTERM)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(  # the same line from both: once
        "error: SIGTERM before the first training step: stopped at once"), output[-3000:]
    assert "SIGKILL" not in output, output[-3000:]  # every rank ended by itself
    assert "TypeError" not in output and "does not fit" not in output, output[-3000:]
    # (torchrun, sent a SIGTERM, prints its own traceback)
    assert not frames_of_ours(output), output[-3000:]
