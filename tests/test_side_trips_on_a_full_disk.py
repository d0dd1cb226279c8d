"""Steps 10 and 11 on a real full disk (a small tmpfs): one line each, and 10's diagnosis is still
its last line (issue 43 §5). Before, 11 ended in three chained tracebacks at its model save, and
10's diagnosis was lost in a traceback from writing the Flight Recorder's files.

Both write only at their end, so both also check their --out-dir at the start: a disk that is
full already is one line before any work (00-09 find it opening TensorBoard's event file).
"""

from conftest import assert_no_traceback, run_step
from test_real_failures import error_lines, fill, tmpfs  # noqa: F401 -- tmpfs: a fixture


def test_11_on_a_disk_too_small_for_its_model_is_one_line_per_rank(tmpfs):
    disk = tmpfs("size=64k")  # room for the start's check, not for the model (~4 MiB)
    proc = run_step("11_your_model.py", ["--fix", "--out-dir", disk / "out"], nproc=2,
                    check=False, timeout=180)
    assert proc.returncode != 0
    assert_no_traceback(proc)
    saved = disk / "out" / "your_model.pt"
    errors = error_lines(proc)
    assert errors[0] == f"error: could not write {saved}: No space left on device (rank 0 on " \
                        f"{errors[0].rsplit(' on ', 1)[1]}", proc.stderr[-3000:]
    assert len(errors) == 2 and errors[1].startswith("error: rank 1: "), errors  # rank 1's own
    assert list((disk / "out").iterdir()) == []  # no half-written model, no temporary


def test_10_writes_what_fits_and_still_ends_with_its_diagnosis(tmpfs):
    disk = tmpfs("size=64k")
    (disk / "out").mkdir()
    fill(disk, leave=4096)  # the start's check fits; both ranks' records (~3.5 KiB each) do not
    proc = run_step("10_debugging.py", ["--bug", "skip", "--out-dir", disk / "out"], nproc=2,
                    check=False, timeout=180)
    assert proc.returncode != 0
    assert_no_traceback(proc)
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("diagnosis: rank 0 is behind"), proc.stdout[-3000:]
    assert lines[-2].startswith("[Flight Recorder] records not written: ") \
        and lines[-2].endswith("No space left on device"), lines[-2]


def test_a_disk_full_before_10_or_11_start_is_one_line_before_any_work(tmpfs):
    disk = tmpfs("size=1m")
    (disk / "out").mkdir()
    fill(disk)
    for script in ("10_debugging.py", "11_your_model.py"):
        proc = run_step(script, ["--fix", "--out-dir", disk / "out"], check=False)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert_no_traceback(proc)
        assert error_lines(proc) == [f"error: cannot write in --out-dir {disk / 'out'}: "
                                     f"No space left on device"], proc.stderr
        assert proc.stdout == ""  # before the start-up line
