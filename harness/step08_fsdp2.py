"""What the harness checks around step 08: 07's (step07_fault_tolerance.around: the store
check, the checked end_now, mid-epoch reading). 08's own functions are its own: its gathered
save is atomic and refuses NaN weights, its resume checks the sample order (common.py).
"""

from __future__ import annotations

from pathlib import Path

from . import step07_fault_tolerance


def around(script: Path):
    return step07_fault_tolerance.around(script)
