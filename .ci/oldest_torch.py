"""CI, the oldest end of the supported range: the tour on the oldest torch requirements.txt
promises (.ci/run installs it in a second virtualenv and runs this with that venv's python).

Passes when the tour ends with its table, every step either ran (its row has a test accuracy,
or "-" for the side trips 01 and 10) or, where its require_torch(...) line asks for a newer
torch, refused in one line naming that version, and no traceback came from our code (torchrun's
own ChildFailedError summary, frames in torch only, is allowed). No pytest: the venv has none.
"""

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import common  # noqa: E402, F401
from harness import versions  # noqa: E402
import tour  # noqa: E402


def main() -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, "tour.py", "--data", "synthetic", "--out-dir", out],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=1800)
    output = proc.stdout
    print(output, flush=True)
    problems = [] if proc.returncode == 0 else [f"the tour exited {proc.returncode}"]
    table = output.split("=== the tour")[-1]
    ran, refused = 0, 0
    for script, *_ in tour.STEPS:
        step = tour.step_id(script)
        row = re.search(rf"^{step}\s.*$", table, re.M)
        needed = versions.torch_needed_by(REPO / script)
        if row is None:
            problems.append(f"{step}: no row in the tour's table")
        elif needed and versions.torch_older_than(needed):
            refusal = f"{script} needs torch >= {needed} ("
            lines = [line for line in output.splitlines() if refusal in line]
            if f"needs torch {needed}" not in row.group(0) or not lines:
                problems.append(f"{step}: no one-line refusal naming torch {needed}")
            elif not all(line.startswith("error: ") for line in lines):
                problems.append(f"{step}: refusal not on an error: line: {lines}")
            refused += 1
        elif not re.search(r"\d%|\s-\s", row.group(0)):
            problems.append(f"{step}: ran, but its row has no result: {row.group(0)}")
        else:
            ran += 1
    ours = [line for line in output.splitlines()  # (not torch's: .ci/run's venv lies in REPO)
            if line.strip().startswith("File ") and str(REPO) in line
            and "/site-packages/" not in line]
    if ours:
        problems.append(f"a traceback from our code: {ours[:3]}")
    seconds = time.monotonic() - started
    for problem in problems:
        print(f"oldest torch: FAILED: {problem}")
    print(f"oldest torch {common.torch.__version__}: {ran} steps ran, {refused} refused in one "
          f"line as needing a newer torch, {len(problems)} problems ({seconds:.0f} s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
