"""Run a step script unchanged, then save what each rank ended with, for the tests to compare.

    torchrun ... tests/rank_probe.py 03_ddp_wrapper.py --epochs 1 ...   (PROBE_DIR=<folder>)

Writes PROBE_DIR/rank<R>.pt = {"params": the parameters this rank's optimizer last stepped,
"indices": {dataset size: [every index batch fetched from a dataset of that size]},
"threads": the names of this process's threads once the step has ended (its group torn down)}.
It only observes: a global optimizer hook (a public PyTorch API) keeps a reference to the
optimizer, and the training set's batch fetch is wrapped to note the indices it is asked for.

Two failures on request:
- PROBE_KILL=<rank>:<step>: that rank SIGKILLs itself after its <step>-th optimizer step, in the
  first attempt only (TORCHELASTIC_RESTART_COUNT=0), as a crashed node would;
- PROBE_STALL=<rank>[:<step>]: that rank stops answering after its first step (or its <step>-th)
  (sleeps an hour), as a rank stuck in I/O or a deadlock would; the others wait in their next
  all-reduce until --timeout;
- PROBE_NAN=<rank>:<step>: after its <step>-th optimizer step that rank sets its first weight to
  NaN, as an overflow would, so that its next loss is NaN;
- PROBE_SIGNAL=<rank>:<step>:<name>: that rank sends itself the signal <name> (e.g. SIGTERM)
  after its <step>-th optimizer step, in the first attempt only, as SLURM's would arrive;
- PROBE_RAISE=<rank>:<step>: that rank raises a RuntimeError (an exception no step expects, as
  a bug would) after its <step>-th optimizer step;
- PROBE_KILL_SAVE=<rank>:<n>: that rank SIGKILLs itself while it writes its shards of the n-th
  DCP checkpoint (step 08), in the first attempt only.

And one record on request: PROBE_KEEP_CHECKPOINTS=1 copies each checkpoint.pt the step saves to
checkpoint-epoch<E>.pt beside it (E: the epochs it holds), so a test can resume from epoch 1 of a
2-epoch run instead of launching a 1-epoch run for it.
"""

import os
import runpy
import signal
import time
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import data  # noqa: E402

seen = {"steps": 0}
fetched = defaultdict(list)
rank = os.environ.get("RANK", "0")
kill_rank, _, kill_step = os.environ.get("PROBE_KILL", "-1:0").partition(":")
nan_rank, _, nan_step = os.environ.get("PROBE_NAN", "-1:0").partition(":")
stall_rank, _, stall_step = os.environ.get("PROBE_STALL", "-1").partition(":")
signal_rank, signal_step, signal_name = os.environ.get("PROBE_SIGNAL", "-1:0:SIGTERM").split(":")
raise_rank, _, raise_step = os.environ.get("PROBE_RAISE", "-1:0").partition(":")
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def after_optimizer_step(optimizer, args, kwargs):
    seen.update(opt=optimizer, steps=seen["steps"] + 1)
    if first_attempt and rank == kill_rank and seen["steps"] == int(kill_step):
        os.kill(os.getpid(), signal.SIGKILL)
    if first_attempt and rank == signal_rank and seen["steps"] == int(signal_step):
        os.kill(os.getpid(), getattr(signal, signal_name))
    if rank == raise_rank and seen["steps"] == int(raise_step):
        raise RuntimeError("planted by tests/rank_probe.py")
    if rank == stall_rank and seen["steps"] >= int(stall_step or 1):
        time.sleep(3600)
    if rank == nan_rank and seen["steps"] == int(nan_step):
        with torch.no_grad():
            optimizer.param_groups[0]["params"][0].fill_(float("nan"))


register_optimizer_step_post_hook(after_optimizer_step)

save_rank, _, save_number = os.environ.get("PROBE_KILL_SAVE", "-1:0").partition(":")
if first_attempt and rank == save_rank:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    original_write = FileSystemWriter.write_data

    def dying_write(self, plan, planner):
        seen["saves"] = seen.get("saves", 0) + 1
        if seen["saves"] == int(save_number):
            os.kill(os.getpid(), signal.SIGKILL)  # mid-save: its shards are never written
        return original_write(self, plan, planner)

    FileSystemWriter.write_data = dying_write

if os.environ.get("PROBE_KEEP_CHECKPOINTS") == "1":
    import shutil

    import common  # (its save_checkpoint is the harness's, since `from harness import data`)

    original_save = common.save_checkpoint

    def keeping_save(path, model, optimizer, scheduler, epoch, **extra):
        original_save(path, model, optimizer, scheduler, epoch, **extra)
        if rank == "0":
            shutil.copyfile(path, path.with_name(f"{path.stem}-epoch{epoch}{path.suffix}"))

    common.save_checkpoint = keeping_save

original_getitems = data.Digits.__getitems__


def recording_getitems(self, indices):
    fetched[len(self)].append(list(indices))
    return original_getitems(self, indices)


data.Digits.__getitems__ = recording_getitems

script, *script_args = sys.argv[1:]
sys.argv = [script, *script_args]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    # (Under FSDP2 a parameter is a DTensor: this rank's shard is what it holds.)
    params = [(p.to_local() if hasattr(p, "to_local") else p).detach().cpu().clone()
              for group in seen["opt"].param_groups for p in group["params"]] \
        if "opt" in seen else []
    tasks = Path("/proc/self/task")  # (Linux: native threads too; elsewhere None)
    threads = sorted((tasks / task / "comm").read_text().strip()
                     for task in os.listdir(tasks)) if tasks.is_dir() else None
    torch.save({"params": params, "indices": dict(fetched), "threads": threads},
               Path(os.environ["PROBE_DIR"]) / f"rank{rank}.pt")
