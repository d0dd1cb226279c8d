"""Step 10's diagnosis (harness/step10_diagnosis.py), without processes: on made-up states, for
the branches no planted bug reaches (a rank in no collective, a rank that died) and for 4 ranks;
the choice of the Flight Recorder to read for each backend (NCCL cannot run here); and what
harness/step10_debugging.around replaces for the time of 10's main() (common's functions only).
The runs that reach the other branches are in tests/test_debugging.py.
"""

from __future__ import annotations

import pickle
import runpy
import sys

import common
import pytest
from conftest import REPO
from harness import step10_debugging
from harness import step10_diagnosis as debug

# ---------------------------------------------------------------- the diagnosis alone
def state(rank, steps, last_seq, pending=None, absent=(), where="here", detail=None):
    """A rank's published state, as step10_debugging.ThisRank.state makes it, without the
    record."""
    last = {"seq": last_seq, "op": "all_reduce", "shapes": [[4]], "dtypes": ["Float"],
            "done": pending is None}
    return {"rank": rank, "steps": steps, "last": {"DDP's group": last}, "pending": pending,
            "detail": detail, "absent": list(absent), "where": where}


def test_diagnosis_names_a_rank_in_no_collective():
    """DETAIL's monitored barrier names the rank that never came (same steps, same record)."""
    states = {0: state(0, 3, 7, absent=[1], where="a.py:1 in f"), 1: state(1, 3, 7)}
    line = debug.diagnose(states, 2)
    assert line.startswith("rank 1 is behind") and "rank 0 waits in at a.py:1 in f" in line


def test_diagnosis_without_detail_uses_the_flight_recorder_counts():
    """Without DETAIL, the waiting rank's record holds one collective more, not completed."""
    waiting = {"seq": 8, "op": "all_reduce", "shapes": [[4]], "dtypes": ["Float"], "done": False}
    states = {0: state(0, 3, 8, pending=waiting, where="a.py:9 in g"), 1: state(1, 3, 7)}
    line = debug.diagnose(states, 2)
    assert line.startswith("rank 1 is behind: it missed collective #8 all_reduce of [4] Float")
    assert "which rank 0 waits in at a.py:9 in g" in line


def test_diagnosis_names_a_rank_that_died():
    assert debug.diagnose({0: state(0, 3, 7)}, 2).startswith("rank 1 died")


def test_diagnosis_names_the_collectives_only_the_rank_ahead_holds():
    """gloo marked DDP's timed-out all-reduce as completed (seen here): the counts still tell."""
    states = {0: state(0, 5, 14, where="a.py:5 in h"), 1: state(1, 6, 16, where="a.py:7 in t")}
    assert debug.diagnose(states, 2) == (
        "rank 0 is behind (5 training steps, rank 1 took 6): it missed collective #15-16 "
        "all_reduce of [4] Float on DDP's group, which rank 1 waits in at a.py:7 in t; rank 0 "
        "is at a.py:5 in h")


def test_a_rank_reads_the_same_whether_its_own_timeout_came_first_or_not():
    """The race CI met: a rank published by its watcher while it waits (DDP's two bucket
    all-reduces not retired) and the same rank after its timeout (gloo retired both) are the
    same state once as_it_waited gives both the record of the wait: same lines, same diagnosis."""
    def record(retired):
        return {"entries": [entry(0, ("0", "default_pg"), seq=14),
                            entry(0, ("0", "default_pg"), seq=15, retired=retired),
                            entry(0, ("0", "default_pg"), seq=16, retired=retired)]}

    def rank_state(retired, error):
        r = record(retired)
        return {"rank": 1, "steps": 6, "where": "a.py:7 in t", "record": r, "error": error,
                "last": debug.last_collectives(r), "pending": debug.pending_collective(r),
                "detail": None, "absent": []}

    stuck = rank_state(retired=False, error=None)  # taken by the watcher while it waits
    waiting = debug.as_it_waited(stuck, rank_state(retired=False, error=None))
    failed = debug.as_it_waited(stuck, rank_state(retired=True, error="Timed out"))
    assert failed["pending"] == waiting["pending"] and failed["last"] == waiting["last"]
    assert debug.describe(failed["pending"]) == "#15-16 all_reduce of [2] Float"
    behind = {"rank": 0, "steps": 5, "where": "a.py:5 in h", "record": {}, "detail": None,
              "absent": [], "pending": None,
              "last": {"DDP's group": debug.collective(entry(0, seq=14))}}
    lines = {debug.diagnose({0: behind, 1: s}, 2) for s in (waiting, failed)}
    assert lines == {"rank 0 is behind (5 training steps, rank 1 took 6): it missed collective "
                     "#15-16 all_reduce of [2] Float on DDP's group, which rank 1 waits in at "
                     "a.py:7 in t; rank 0 is at a.py:5 in h"}
    # Another wait (a later step, or another line) keeps its own record.
    later = rank_state(retired=True, error="Timed out") | {"steps": 7}
    assert debug.as_it_waited(stuck, later) == later


def test_diagnosis_at_4_ranks():
    """The three bugs' states at 4 ranks, as the 2- and 3-rank runs above publish them (in
    the order they arrive: any order, the line is the same)."""
    skip = {**{r: state(r, 6, 16) for r in (3, 1, 2)}, 0: state(0, 5, 14)}
    assert debug.diagnose(skip, 4).startswith("rank 0 is behind (5 training steps, rank 1 "
                                              "took 6)")
    uneven = {**{r: state(r, 4, 12) for r in (2, 3, 1)}, 0: state(0, 5, 14)}
    assert debug.diagnose(uneven, 4).startswith("ranks 1, 2, 3 are behind (4 training steps, "
                                                "rank 0 took 5): they missed collective #13-14")

    def fingerprint(n):
        return {"seq": 3, "op": "all_reduce", "shapes": [[n]], "dtypes": ["Float"],
                "done": False}
    shape = {r: state(r, 5, 14, detail=fingerprint(11 if r == 0 else 10)) for r in range(4)}
    line = debug.diagnose(shape, 4)
    assert line.startswith("collective #3 (all_reduce) got tensors of different shapes "
                           "(rank 0 differs): rank 0 [11] Float")
    assert "rank 3 [10] Float" in line


# ---------------------------------------------------------------- which Flight Recorder
def test_the_flight_recorder_read_is_the_one_of_the_backend_that_carries_ddp():
    """gloo records into the buffer `_dump_fr_trace()` reads by default; nccl2 (what `nccl`
    builds in torch 2.15) into the hook's buffer named "nccl2"; legacy ProcessGroupNCCL into
    its own, which `_dump_nccl_trace()` reads (see debug.dump_for for the sources)."""
    gloo, nccl2 = debug.dump_for("gloo"), debug.dump_for("nccl2")
    assert gloo.func is debug._dump_fr_trace and "backend" not in gloo.keywords
    # `backend=` is looked up, not assumed: torch 2.14.1 has none (and one buffer), 2.15.0 has it
    assert nccl2.func is debug._dump_fr_trace and nccl2.keywords.get("backend") == (
        "nccl2" if debug.takes(debug._dump_fr_trace, "backend") else None)
    assert not gloo.keywords["includeStackTraces"] and not nccl2.keywords["includeStackTraces"]
    # A hooked backend's buffer is its own: on this CPU machine nothing ever recorded into it.
    # Where there is one buffer (2.14.1) nccl2's read is gloo's, which holds whatever an earlier
    # test of this process ran over gloo (12 entries, with the files in another order).
    if "backend" in nccl2.keywords:
        assert pickle.loads(nccl2()).get("entries", []) == []
    else:
        assert pickle.loads(nccl2()) == pickle.loads(gloo())
    legacy = debug.dump_for("nccl")
    if not hasattr(debug.c10d_ext, "_dump_nccl_trace"):
        assert pickle.loads(legacy()) == {}  # a CPU-only build: no legacy NCCL, no record
        pytest.skip("this torch is a CPU-only build: no legacy NCCL to read")
    assert legacy.func.__name__ == "_dump_nccl_trace"


def test_a_keyword_is_found_in_a_signature_or_a_pybind11_docstring():
    """torch's C++ functions have no inspect.signature: their docstring's first line is one."""
    assert debug.takes(debug.dump_for, "backend") and not debug.takes(debug.dump_for, "rank")
    assert debug.takes(debug._dump_fr_trace, "includeStackTraces")
    assert not debug.takes(debug._dump_fr_trace, "noSuchArgument")


def entry(pg_id, name=("", ""), seq=1, retired=True):
    return {"pg_id": pg_id, "process_group": name, "collective_seq_id": seq,
            "profiling_name": "x:all_reduce", "input_sizes": [[2]], "input_dtypes": ["Float"],
            "retired": retired}


def test_groups_are_told_apart_by_name_or_creation_order():
    """gloo (measured in torch 2.15): DDP's group ('0', 'default_pg') is pg 0, the DETAIL-wrapped
    `checked` group pg 1 with entries named ('', ''), DETAIL's helper pg 2. A record whose
    default group is not pg 0 (a backend that numbers its groups its own way) is read by name."""
    gloo = {"entries": [entry(0, ("0", "default_pg")), entry(2), entry(1)]}
    assert debug.group_names(gloo) == {0: "DDP's group", 1: "checked group"}
    other = {"entries": [entry(7, ("1", "undefined")), entry(5, ("0", "default_pg"), seq=3,
                                                             retired=False)]}
    assert debug.group_names(other) == {5: "DDP's group", 7: "checked group"}
    assert debug.pending_collective(other)["seq"] == 3


def test_the_analyser_is_named_only_where_this_torch_has_it(tmp_path):
    """torch 2.8 has no torch.distributed.flight_recorder: 10 named a command that fails there."""
    line = debug.analyser_command(tmp_path)
    try:
        import torch.distributed.flight_recorder.fr_trace  # noqa: F401
    except ImportError:
        assert line.startswith(f"{tmp_path} (torch ") and "has no analyser" in line
    else:
        assert line == f"python -m torch.distributed.flight_recorder.fr_trace {tmp_path}"


# ---------------------------------------------------------------- around 10's main()
def test_around_replaces_common_s_functions_for_main_only(monkeypatch, tmp_path):
    """common.parser (its flags then checked for room in --out-dir) and common.leave_at_once,
    for the time of main() only; none of the step's own functions, whose namespace it never
    sees (it gets the script's path)."""
    plain = common.parser, common.leave_at_once
    monkeypatch.setattr(sys, "argv", ["10_debugging.py", "--out-dir", str(tmp_path / "out")])
    with step10_debugging.around(REPO / "10_debugging.py"):
        assert common.parser is not plain[0] and common.leave_at_once is not plain[1]
        args = common.parser("step 10", "10_debugging.py").parse_args()
    assert args.out_dir == tmp_path / "out" and list(args.out_dir.iterdir()) == []  # (no probe)
    assert (common.parser, common.leave_at_once) == plain
    assert not hasattr(step10_debugging, "take_in")


def test_no_flight_recorder_record_is_written_through_a_planted_link(tmp_path):
    """<out-dir>/flight_recorder as a link planted there: neither the harness's records
    (write_fr_dumps) nor step 10's own (save_flight_record) go into its target."""
    outside, folder = tmp_path / "outside", tmp_path / "flight_recorder"
    outside.mkdir()
    folder.symlink_to(outside, target_is_directory=True)
    assert debug.write_fr_dumps(folder, {0: {}}) == (
        f"{folder}: a symbolic link: not writing through it")
    step = runpy.run_path(str(REPO / "10_debugging.py"), run_name="step10")
    assert step["save_flight_record"](0, folder) == "not written (File exists)"
    assert list(outside.iterdir()) == []
