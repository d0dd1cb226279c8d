"""The harness every step needs and none of them teaches.

A learner reads the numbered steps and common.py at the root; this package holds what they
call without it being a lesson: the command line (flags), one-line errors (errors), MNIST and
its offline stand-in (data, synthetic_digits), the CNN (model), atomic checkpoints
(checkpoint), the learning rate of every step (schedule), progress and summaries (metrics),
FLOPs and MFU (flops), the profiler (profiling), and print-once / agree-on-every-rank /
join-the-group (ranks). Modules named stepNN_* belong to step NN: its file format (06),
restart mechanics (07), restoring into shards (08), the DCP folder's commit and safe reading
(09), collecting every rank's state when a collective fails (10); kept out of the step so that
its diff stays about one idea.

Imports run one way only: the steps and common.py import from here; nothing here imports
from the root.
"""
