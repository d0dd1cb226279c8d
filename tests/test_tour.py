"""The tour (tour.py): every step in order, with the real launchers, ending with one table."""

import json
import re
import sys
from pathlib import Path

import tour
from conftest import TEST_SAMPLES, launch


def test_the_tour_runs_every_step_and_ends_with_one_table(mnist_root, tmp_path):
    proc = launch([sys.executable, "tour.py", "--samples", "480", "--test-samples",
                   str(TEST_SAMPLES), "--data", "mnist", "--data-dir", str(mnist_root),
                   "--out-dir", str(tmp_path)], timeout=900)
    scripts = [script for script, *_ in tour.STEPS]
    for script in scripts:  # each step's own output, as it went
        assert f"\n=== {tour.step_id(script)}: " in proc.stdout, proc.stdout[-3000:]
    assert "compile=on" in proc.stdout and "first step" in proc.stdout  # 04, compiled once
    table = proc.stdout.split("=== the tour")[1]
    rows = re.findall(r"^(\d\d[a-z]?)\s+.+?\s+(\d+)\s+(\S+)\s+(\S+)   (.+)$", table, re.M)
    assert [row[0] for row in rows] == [tour.step_id(script) for script in scripts], table
    for script, (step, world, accuracy, rate, read_next) in zip(scripts, rows):
        assert read_next.startswith(("diff -u", "read ")), read_next
        if step in ("01", "10", "11"):  # side trips with no summary: collectives, planted
            # hangs, planted mistakes of your own model
            assert (accuracy, rate) == ("-", "-")
            continue
        # The table's numbers are the step's own summary.json.
        summary = json.loads((tmp_path / Path(script).stem / "summary.json").read_text())
        assert accuracy == f"{100 * summary['test_accuracy']:.1f}%", table
        assert 0 < summary["test_accuracy"] <= 1 and summary["test_samples"] == TEST_SAMPLES
        assert int(world) == summary["world_size"] == (1 if step == "00" else 2)
