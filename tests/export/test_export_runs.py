"""Exports of recorded runs, decoded with the real protos and checked against the model."""

from __future__ import annotations

import pytest

from pipetrace.analyze import findings as fk
from pipetrace.export.columns import FINDINGS_TRACK, NEVER_ARRIVED
from pipetrace.export.layout import last_time

from .checks import check_chrome_json, check_perfetto
from .conftest import RUNS

ALL = [
    *RUNS,
    "synthetic-1f1b",
    "synthetic-zbv",
    "synthetic-interleaved-1f1b",
    "synthetic-dualpipev",
]


@pytest.mark.parametrize("name", ALL)
def test_perfetto_export_holds_the_run(recorded, name):
    e = recorded(name)
    check_perfetto(e.run, e.trace)


@pytest.mark.parametrize("name", ALL)
def test_chrome_json_export_holds_the_run(recorded, name):
    e = recorded(name)
    check_chrome_json(e.run, e.json)


def test_tracks_of_a_rank(recorded):
    e = recorded("overlap-dualpipev")
    names = {e.trace.track_name(u) for u in e.trace.tracks if e.trace.rank_of(u) == 0}
    assert {
        "rank 0 (stages 0, 3)",
        "compute",
        "overlap (backward)",
        "iterations",
        "bubbles",
        "p2p 0",
        "p2p 1",
        "activations in flight",
        "messages in flight",
        "recorded events",
    } <= names
    # several P2P ops in flight at once, each on its own track
    assert len([n for n in names if n.startswith("p2p ")]) >= 3
    # a composite holds its forward sub-step on the compute track;
    # its backward is on the overlap track
    composites = [s for s in e.trace.on(0, "compute") if "OVERLAP_F_B" in s.name]
    assert composites and all(
        any(
            c.begin <= s.begin and s.end <= c.end and s.parent is c
            for s in e.trace.on(0, "compute")
        )
        for c in composites
    )
    assert {s.name for s in e.trace.on(0, "overlap (backward)")} == {
        sub
        for c in composites
        for sub in c.name[1:].split(")")[0].split(";")
        if "B" in sub or "I" in sub
    }


def test_counters_return_to_zero_on_a_clean_run(recorded):
    e = recorded("overlap-dualpipev")
    last: dict[int, int] = {}
    peak: dict[int, int] = {}
    for c in e.trace.counters:
        last[c.track] = c.value
        peak[c.track] = max(peak.get(c.track, 0), c.value)
    names = {e.trace.track_name(t) for t in last}
    assert names == {"activations in flight", "messages in flight"}
    assert set(last.values()) == {0} and max(peak.values()) >= 2


def test_interning_and_delta_timestamps(recorded):
    e = recorded("clean-1f1b")
    import io

    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    from pipetrace.export.perfetto import write_perfetto

    buf = io.BytesIO()
    write_perfetto(e.layout, buf)
    packets = pb.Trace.FromString(buf.getvalue()).packet
    events = [p for p in packets if p.HasField("track_event")]
    assert all(not p.track_event.HasField("name") for p in events)  # names are interned
    assert all(not a.HasField("name") for p in events for a in p.track_event.debug_annotations)
    assert all(p.timestamp < 10**12 for p in events)  # deltas, not ~1.7e18 absolute times


def test_deadlock_marks_every_blocked_step(recorded):
    e = recorded("deadlock")
    deadlock = next(f for f in e.findings if f.kind == fk.DEADLOCK)
    marks = [i for i in e.trace.instants if i.name == "error: deadlock"]
    assert {(e.trace.rank_of(i.track), i.args["step"]) for i in marks} == {
        (s.rank, s.step) for s in deadlock.steps
    }
    assert all(e.trace.track_name(i.track) == FINDINGS_TRACK for i in marks)
    assert all(
        i.args["message"] == deadlock.message and i.args["severity"] == "error" for i in marks
    )
    t_end = last_time(e.run)
    for ref in deadlock.steps:
        blocked = [
            s for s in e.trace.on(ref.rank, "compute") if s.name == ref.step and "finding" in s.args
        ]
        assert len(blocked) == 1 and "deadlock" in blocked[0].args["finding"]
        assert blocked[0].args["unfinished"] is True and blocked[0].end == t_end
    # the recv that never completes ends at the end of the trace
    stuck = [
        s
        for s in e.trace.slices
        if s.name.startswith("1RECV_F1") and s.args.get("op") == "recv" and s.args["iteration"] == 1
    ]
    assert len(stuck) == 1 and stuck[0].args["unfinished"] and stuck[0].end == t_end


def test_stuck_step_is_unfinished_and_the_waiter_is_flagged(recorded):
    e = recorded("stuck")
    t_end = last_time(e.run)
    stalled = next(f for f in e.findings if f.kind == fk.RANK_STALLED)
    flagged = {
        e.trace.rank_of(i.track) for i in e.trace.instants if i.name == "error: rank_stalled"
    }
    assert 0 in flagged
    assert set(stalled.ranks) <= flagged  # the rank it waits on too, which has no step of it
    open_steps = [s for s in e.trace.on(1, "compute") if s.args.get("unfinished")]
    assert [s.name for s in open_steps] == ["1B0"] and open_steps[0].end == t_end
    assert "rank 1 (stage 1) [ended]" in {e.trace.track_name(u) for u in e.trace.tracks}
    assert stalled.steps[0].rank == 0


def test_crash_shows_the_exception(recorded):
    e = recorded("crash")
    failed = [i for i in e.trace.instants if i.name == "error: rank_failed"]
    assert [e.trace.rank_of(i.track) for i in failed] == [1]
    exc = [i for i in e.trace.instants if i.name == "exception"]
    assert (
        len(exc) == 1
        and "injected crash" in exc[0].args["message"]
        and "Traceback" in exc[0].args["traceback"]
    )
    # messages that never arrived still get their arrow, to an instant that says so
    never = [i for i in e.trace.instants if i.name == NEVER_ARRIVED]
    assert all(i.args["_parent"].args.get("unfinished") for i in never)


def test_json_marks_findings_and_unfinished(recorded):
    e = recorded("deadlock")
    marks = [x for x in e.json.events if x["ph"] == "i" and x["name"] == "error: deadlock"]
    assert len(marks) == 2 and all(x["args"]["kind"] == "deadlock" for x in marks)
    unfinished = [
        x for x in e.json.events if x["ph"] == "X" and x.get("args", {}).get("unfinished")
    ]
    assert {x["name"] for x in unfinished} >= {"0RECV_B0", "1RECV_F1"}


def test_damaged_runs_still_export(recorded, tmp_path):
    """A missing rank log and a torn last line: the loader works around them, so does the export."""
    import shutil

    from .conftest import export

    src = recorded("clean-1f1b").path
    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    (missing / "rank-00002.ndjson").unlink()
    e = export(missing)
    check_perfetto(e.run, e.trace)
    check_chrome_json(e.run, e.json)
    assert any(e.trace.track_name(u).startswith("rank 2") for u in e.trace.tracks)
    torn = tmp_path / "torn"
    shutil.copytree(src, torn)
    log = torn / "rank-00001.ndjson"
    data = log.read_bytes()
    begin = data.rfind(b'"e":"step_begin"', 0, len(data) * 2 // 3)
    cut = data.index(b"\n", begin) + 12  # after a step began, in the middle of the next line
    log.write_bytes(data[:cut])
    e = export(torn)
    check_perfetto(e.run, e.trace)
    assert any(s.args.get("unfinished") for s in e.trace.on(1, "compute"))


def test_arrival_never_precedes_its_send(recorded):
    """Clocks that put a recv's completion before its send was posted: the recv's slice is
    extended so that the arrow still points forward in time."""
    import io

    from pipetrace.analyze.load import load_run
    from pipetrace.analyze.model import OP_RECV
    from pipetrace.export.layout import build_layout
    from pipetrace.export.perfetto import write_perfetto

    from .decode import decode_perfetto

    run = load_run(recorded("clean-1f1b").path, workers=0)
    p2p = run.ranks[1].p2p
    row = int(next(i for i in range(len(p2p)) if p2p.op[i] == OP_RECV and p2p.match_rank[i] == 0))
    send_post = int(run.ranks[0].p2p.post[p2p.match_index[row]])
    p2p.done[row] = send_post - 1000  # completed 1 µs before the send was posted
    p2p.post[row] = min(int(p2p.post[row]), send_post - 2000)
    buf = io.BytesIO()
    write_perfetto(build_layout(run), buf)
    dec = decode_perfetto(buf.getvalue())  # asserts that every flow begins before it ends
    recv = next(s for s in dec.on(1, "p2p 0") + dec.on(1, "p2p 1") if s.begin == int(p2p.post[row]))
    assert recv.end == send_post


def test_json_counters_read_like_the_tracks(recorded):
    e = recorded("overlap-dualpipev")
    counters = {(x["name"], *x["args"]) for x in e.json.events if x["ph"] == "C"}
    assert counters == {("activations", "in flight"), ("messages", "in flight")}


def test_activations_are_held_until_w(recorded):
    """With the backward split in I and W, activations stay in flight until W ends, even
    when the run stops between the two."""
    import numpy as np

    from pipetrace.analyze.load import load_run
    from pipetrace.analyze.model import OPEN
    from pipetrace.export import derived

    run = load_run(recorded("overlap-zbv").path, workers=0)  # a copy: the shared one stays intact
    rank = run.ranks[0]
    _, v = derived.activations_in_flight(rank, run.catalog)
    assert v[-1] == 0 and v.max() >= 2
    row = next(i for i, c in enumerate(rank.steps.code.tolist()) if run.catalog.texts[c] == "0W0")
    rank.steps.end[row] = OPEN  # the W of micro-batch 0 never ended; its I did
    _, v = derived.activations_in_flight(rank, run.catalog)
    assert v[-1] == 1 and np.all(v >= 0)
