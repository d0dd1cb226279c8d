"""The torch versions we promise (README, "Versions"; docs/versions.md): a step that needs a
newer torch than the one installed says so in one line, and what the steps' comments state of
this torch holds. (.ci/oldest_torch.py runs the tour on the oldest torch; this file runs on the
newest.)"""

import subprocess
import sys

import pytest
import torch

import common
from harness import versions
import tour
from conftest import REPO


def test_a_step_that_needs_a_newer_torch_refuses_in_one_line(capsys):
    versions.require_torch(torch.__version__.split("+")[0], "runs here")  # this torch: silent
    with pytest.raises(SystemExit) as stopped:
        versions.require_torch("99.1", "a feature of the future")
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and (
        f"needs torch >= 99.1 (a feature of the future); this is torch {torch.__version__}"
        in lines[0]), lines


def test_version_comparison():
    assert versions.torch_older_than("99.0") and not versions.torch_older_than("2.7")
    assert not versions.torch_older_than(torch.__version__)


def test_every_gated_step_checks_before_its_harness_imports():
    """The check must come before anything only a newer torch can import (a step's harness
    imports), or, in a step that imports no harness module (10: copyable), before any work:
    the first statement of its main(), a UserError (one line, exit 2, as require_torch)."""
    gated = {script: versions.torch_needed_by(REPO / script) for script, *_ in tour.STEPS}
    gated = {script: version for script, version in gated.items() if version}
    assert set(gated) >= {"10_debugging.py"}, gated
    for script in gated:
        source = (REPO / script).read_text()
        first_harness_import = source.replace("\nfrom harness import versions\n", "\n", 1)
        if "\nfrom harness" not in first_harness_import:  # copyable: a plain check, no harness
            if f'torch.__version__ < "{gated[script]}":' in source:  # 10: main's first statement
                main = source.split("\ndef main():\n", 1)[1]
                assert main.lstrip().startswith(f'if torch.__version__ < "{gated[script]}":')
                assert "raise common.UserError(" in main.split("\n")[1], script
            continue
        assert first_harness_import.index("versions.require_torch(") < \
            first_harness_import.index("\nfrom harness"), script


# What 01, 03 and docs/steps.md state of this torch (2.15), checked in a world of one.
CLAIMS = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
dist.init_process_group("gloo", rank=0, world_size=1, device_id=torch.device("cpu:0"))  # accepted
average = torch.tensor([1.0, 3.0])
dist.all_reduce(average, op=dist.ReduceOp.AVG)  # gloo has AVG (2.7's raised; 2.8's has it)
model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
for _ in range(3):  # DDP rebuilds its buckets in the forward after its first backward
    model(torch.randn(2, 4)).sum().backward()
print("rebuilt:", model._get_ddp_logging_data()["has_rebuilt_buckets"])
del model
dist.destroy_process_group()
"""


@pytest.mark.skipif(versions.torch_older_than("2.15"), reason="the claims are about torch 2.15")
def test_gloo_takes_a_cpu_device_id_and_averages_and_a_world_of_one_rebuilds_buckets():
    proc = subprocess.run([sys.executable, "-c", CLAIMS], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rebuilt: 1" in proc.stdout, proc.stdout


def test_an_unsupported_torch_is_one_warning_line_at_start_and_the_run_goes_on(tmp_path, capsys):
    """Torch 2.7 (unsupported: a step can hang at its very end) ran 00-07 without a word. Here
    the step runs with torch.__version__ set to 2.7.1 before it imports common; this torch
    itself is silent."""
    versions.warn_of_unsupported_torch()
    assert capsys.readouterr().err == ""
    as_2_7 = ("import runpy, sys, torch; torch.__version__ = '2.7.1'; sys.argv = sys.argv[1:]; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", as_2_7, "00_single_gpu.py", "--data", "synthetic",
                           "--train-samples", "256", "--test-samples", "64", "--epochs", "1",
                           "--out-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "warning: torch 2.7.1 is older than 2.8, the oldest supported: a step can hang at its "
        "very end, in destroy_process_group (README, \"Versions\"); pip install 'torch>=2.8' "
        "and its torchvision"], proc.stderr
    assert "test accuracy" in proc.stdout


ABSENT_PRIVATE_APIS = """
import pickle, torch.serialization, torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch._C._distributed_c10d as c10d
del torch.serialization._get_layout, dcp_filesystem._StorageInfo, c10d._dump_fr_trace
if hasattr(c10d, "_dump_nccl_trace"):
    del c10d._dump_nccl_trace
from harness import step09_dcp_checkpoint as dcp_checkpoint, step10_diagnosis as debug
assert not [key for key in dcp_checkpoint.METADATA_GLOBALS if key[1] in ("_get_layout",
                                                                          "_StorageInfo")]
assert all(pickle.loads(debug.dump_for(name)()) == {} for name in ("gloo", "nccl2", "nccl"))
print("fallbacks taken")
"""


def test_a_torch_without_the_private_apis_the_harness_uses_takes_their_fallbacks():
    """Every private torch API is looked up (hasattr, a signature), not assumed from a version:
    a torch without one imports the harness all the same. (Here they are deleted from this
    torch before the harness is imported: the imports of 09's and 10's harness failed.)"""
    proc = subprocess.run([sys.executable, "-c", ABSENT_PRIVATE_APIS], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "fallbacks taken" in proc.stdout, proc.stderr[-3000:]
