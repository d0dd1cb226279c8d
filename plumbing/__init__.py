"""The plumbing every step needs and none of them teaches.

A learner reads the numbered steps and common.py at the root; this package holds what they
call without it being a lesson: the command line (flags), one-line errors (errors), MNIST and
its offline stand-in (data, synthetic_digits), the CNN (model), atomic checkpoints
(checkpoint), progress and summaries (metrics), the profiler (profiling), and print-once /
agree-on-every-rank (ranks). Modules named stepNN_* belong to one step: its file-format or
restart mechanics, kept out of the step so that its diff stays about one idea.

Imports run one way only: the steps and common.py import from here; nothing here imports
from the root.
"""
