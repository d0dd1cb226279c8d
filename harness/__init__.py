"""The harness: what makes a run robust but teaches nothing.

A step takes it in with its first lines, `try: import harness` and `except ModuleNotFoundError:
pass`; a step copied out of the repository, with common.py, runs without it as plain torch
does. Importing it replaces common.py's plain functions by checked ones, which train the same:

- common.parser: every flag's range (flags.py), one line per bad flag, on every rank;
- common.run_main, common.record: one-line errors on every rank, signals, the watchdog
  (errors.py); common.setup_distributed: a check-in that names the ranks that never came;
- common.load_datasets: MNIST's .gz files, a checked download, the synthetic digits offline;
- common.Progress, common.Metrics: progress lines, the NaN check, FLOPs and MFU, TensorBoard,
  the --out-dir lock (metrics.py, flops.py, profiling.py);
- common.save_checkpoint, common.restore_checkpoint: temporary names no one can plant, checked
  reading (checkpoint.py); common.LRSchedule: resumable on another world size (schedule.py).

Modules named stepNN_* belong to step NN: 06's file format, 07's restart mechanics, 08's
restoring into shards, 09's DCP folders, 10's hang diagnosis, 11's one-process replay. Their
`take_in(step)` replaces some of the step's own functions by checked twins before its main()
runs (twins.py).
"""

from . import startup  # noqa: F401 -- first, before torch: a Ctrl-C while it loads is one line

import common  # noqa: E402

from . import checkpoint, data, errors, flags, launcher, metrics, schedule, versions  # noqa: E402

common.parser, common.Parser = flags.parser, flags.Parser
common.run_main, common.record = errors.run_main, errors.record
common.setup_distributed, common.compile_choice = launcher.setup_distributed, launcher.compile_choice
common.load_datasets = data.load_datasets
common.Progress, common.Metrics = metrics.Progress, metrics.Metrics
common.save_checkpoint, common.restore_checkpoint = checkpoint.save, checkpoint.restore
common.LRSchedule = schedule.LRSchedule
versions.warn_of_unsupported_torch()
