"""The harness: what makes a run robust but teaches nothing.

A step takes it in with `try: import harness`; a copied step runs without. Importing it replaces
common.py's plain functions by checked ones, which train the same (stepNN_*: around step NN):

- common.parser: every flag's range (flags.py), one line per bad flag, on every rank;
- common.run_main, record: one-line errors on every rank, signals, the watchdog (errors.py);
- common.load_datasets: MNIST's .gz files, a checked download (data.py);
- common.Progress, Metrics: the NaN check, FLOPs, TensorBoard, the --out-dir lock (metrics.py);
- common.save/restore_checkpoint, save_torch: checked (checkpoint.py); LRSchedule: a resume
  takes this run's --lr and steps per epoch, where a copy keeps the checkpoint's (schedule.py);
- common.compile_choice: its tools checked, and init_process_group: the ranks that never came
  (launcher.py); common.write_h5, open_h5: checked (step06_*).

It never replaces a function a step defines: the code a learner reads is the code that runs.
"""

from . import startup  # noqa: F401 -- first, before torch: a Ctrl-C while it loads is one line

import torch.distributed  # noqa: E402

import common  # noqa: E402

from . import checkpoint, data, errors, flags, launcher, metrics, schedule, versions  # noqa: E402

common.parser, common.Parser = flags.parser, flags.Parser
common.run_main, common.record = errors.run_main, errors.record
common.compile_choice = launcher.compile_choice
torch.distributed.init_process_group = launcher.init_process_group  # around every step's setup
common.load_datasets = data.load_datasets
common.Progress, common.Metrics = metrics.Progress, metrics.Metrics
common.save_checkpoint, common.restore_checkpoint = checkpoint.save, checkpoint.restore
common.save_torch = checkpoint.checked_save_torch(common.save_torch)
common.LRSchedule = schedule.LRSchedule
versions.warn_of_unsupported_torch()
from . import step06_digits_h5  # noqa: E402 -- 06's file: checked writing and opening
common.write_h5, common.open_h5 = step06_digits_h5.write_h5, step06_digits_h5.open_h5
