"""What the harness checks around steps 08a, 08b and 08: 07's (step07_fault_tolerance.around:
the store check, the checked end_now, mid-epoch reading). Their own functions are their own: the
gathered save is atomic (common.save_torch, which the harness makes refuse NaN weights), the
resume checks the sample order (common.py), and a NaN loss stops the run before a checkpoint
step (metrics.Progress).
"""

from __future__ import annotations

from pathlib import Path

from . import step07_fault_tolerance


def around(script: Path):
    return step07_fault_tolerance.around(script)
