"""Run step 06 unchanged, noting which training rows every rank's loader reads, per epoch.

    torchrun ... tests/h5_probe.py 06_streaming_h5.py --epochs 2 ...   (PROBE_DIR=<folder>)

The reads happen in DataLoader worker processes, which exit with the loader, so each process
appends its own file PROBE_DIR/reads-<pid>.txt, one line per range read: "rank epoch first last".
Like rank_probe.py it only observes: the step's module body runs first (defining everything,
starting nothing), StreamingDigits.read is wrapped, then main() runs as `python step.py` would.
"""

import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

script, *script_args = sys.argv[1:]
sys.argv = [script, *script_args]
step = runpy.run_path(script, run_name="h5_probe")  # not "__main__": main() does not run yet
dataset_class = step["StreamingDigits"]
original_read = dataset_class.read


def recording_read(self, f, ranges):
    with open(Path(os.environ["PROBE_DIR"]) / f"reads-{os.getpid()}.txt", "a") as out:
        out.writelines(f"{self.rank} {int(self.epoch)} {a} {b}\n" for a, b in ranges)
    return original_read(self, f, ranges)


dataset_class.read = recording_read
step["common"].run_main(step["main"])
