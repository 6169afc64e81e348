"""The TUI's UI-free modules: coverage per column, lookups, peers, filters, viewport, details."""

from __future__ import annotations

import numpy as np
import pytest

from pipetrace import units
from pipetrace.analyze.model import OPEN
from pipetrace.tui.describe import describe
from pipetrace.tui.filters import FilterError, parse_filter
from pipetrace.tui.lanes import (
    BLANK,
    BUBBLE,
    CAT_B,
    CAT_DIM,
    CAT_F,
    CAT_RECV,
    CAT_SEND,
    COMM,
    MAIN,
    NONE,
    PLAN,
    STEPS,
    Lane,
)
from pipetrace.tui.session import open_session
from pipetrace.tui.stats_data import stats_tables
from pipetrace.tui.viewport import History, Viewport


def _lane(begin, end, cat, role=MAIN, spans=None) -> Lane:
    begin, end = np.asarray(begin, np.int64), np.asarray(end, np.int64)
    order = np.argsort(begin, kind="stable")
    n = len(begin)
    kw = {"iter_spans": spans} if spans is not None else {}
    return Lane(
        0,
        role,
        "main",
        STEPS,
        np.arange(n, dtype=np.int64)[order],
        begin[order],
        end[order],
        np.zeros(n, bool),
        np.zeros(n, np.int32),
        np.zeros(n, np.int32),
        np.asarray(cat, np.int8)[order],
        **kw,
    )


def _brute(begin, end, cat, t0, dt, width):
    cov = {}
    for b, e, c in zip(begin, end, cat):
        for col in range(width):
            lo, hi = t0 + col * dt, t0 + (col + 1) * dt
            cov.setdefault(c, np.zeros(width))[col] += max(0.0, min(e, hi) - max(b, lo))
    return cov


@pytest.mark.parametrize("overlapping", [False, True])
def test_columns_pick_the_category_covering_most_of_each_column(overlapping):
    rng = np.random.default_rng(1)
    n = 400
    if overlapping:  # P2P ops in flight overlap
        begin = np.sort(rng.integers(0, 1_000_000, n))
        end = begin + rng.integers(1, 40_000, n)
    else:
        gaps = rng.integers(0, 3_000, n)
        durs = rng.integers(1, 5_000, n)
        begin = np.cumsum(gaps + np.r_[0, durs[:-1]])
        end = begin + durs
    cat = rng.choice([CAT_F, CAT_B, CAT_SEND], n)
    lane = _lane(begin, end, cat, role=COMM)
    for t0, dt, width in ((0.0, 12_345.0, 90), (250_000.0, 700.0, 120), (-5_000.0, 50_000.0, 40)):
        cells = lane.columns(t0, dt, width)
        cov = _brute(begin, end, cat, t0, dt, width)
        for col in range(width):
            covered = {c: v[col] for c, v in cov.items()}
            idle = max(dt - sum(covered.values()), 0.0)
            best = max(covered.values())
            if cells.cat[col] == BLANK:
                assert idle >= best - 1e-6
            else:
                assert covered[int(cells.cat[col])] == pytest.approx(best, abs=1e-3)
                assert best >= idle - 1e-6


def test_columns_bubble_inside_iterations_and_runner_up():
    spans = (np.array([0, 1000], np.int64), np.array([600, 1600], np.int64))
    lane = _lane([0, 150, 1000], [100, 400, 1100], [CAT_F, CAT_B, CAT_F], spans=spans)
    cells = lane.columns(0.0, 50.0, 36)
    assert list(cells.cat[:2]) == [CAT_F, CAT_F]
    assert cells.cat[2] == BUBBLE  # idle inside iteration 0
    assert cells.cat[3] == CAT_B
    assert cells.cat[14] == BLANK  # between iterations (600-1000)
    assert cells.cat[20] == CAT_F
    # zoomed out: a column half F, half idle is mixed
    wide = lane.columns(0.0, 200.0, 3)
    assert wide.cat[0] in (CAT_F, CAT_B) and wide.second[0] != NONE


def test_item_lookups_and_view_range():
    lane = _lane([0, 100, 300], [50, 250, 400], [CAT_F, CAT_B, CAT_F])
    assert lane.item_at(120) == 1
    assert lane.item_at(275) is None
    assert lane.item_at(265, tolerance=30) == 1
    assert lane.nearest(290) == 2
    assert lane.in_view(110, 320) == (1, 3)
    cells = lane.columns(0.0, 10.0, 40)
    assert cells.item[12] == 1 and cells.item[5] == -1 and cells.item[0] == 0


def test_index_lanes_neighbours_and_peers(synthetic_run):
    session = open_session(synthetic_run, workers=0)
    index, run = session.index, session.run
    assert index.lane_ids(comm=False) == [index.main_lane(r) for r in range(4)]
    main1 = index.main_lane(1)
    lane = index.lanes[main1]
    assert lane.role == MAIN and len(lane) == len(run.ranks[1].steps)
    assert all(np.diff(lane.begin) >= 0)
    assert index.neighbour(main1, 0, 1) == 1 and index.neighbour(main1, 0, -1) is None
    # a SEND step on rank 1 -> the RECV step on rank 2 that took its message, and back
    send = int(np.flatnonzero(lane.base_cat == CAT_SEND)[0])
    target = index.peer(main1, send)
    assert target is not None and index.lanes[target[0]].rank == 2
    peer_text = run.catalog.texts[int(index.lanes[target[0]].code[target[1]])]
    assert peer_text.startswith("2RECV_F")
    assert index.peer(*target) == (main1, send)
    # an op on the p2p row -> the matching op on the peer's p2p row
    comm = index.lane_of(1, COMM)
    target = index.peer(comm, 0)
    assert index.lanes[target[0]].role == COMM and index.peer(*target) == (comm, 0)
    # a finding's step reference resolves to the step's item
    hit = index.resolve(1, "1B3", 1, None)
    assert hit is not None and index.lanes[hit[0]].it[hit[1]] == 1
    assert index.resolve(1, "9F9", 0, None) is None
    assert index.iteration_span(1)[0] > index.iteration_span(0)[0]


def test_plan_lanes_repeat_the_simulated_plan_each_iteration(synthetic_run):
    session = open_session(synthetic_run, workers=0)
    plan = session.index.lanes[session.index.lane_of(0, PLAN)]
    per_iteration = len(session.run.ranks[0].plan)
    assert len(plan) == 2 * per_iteration
    assert set(plan.rows.tolist()) == set(range(per_iteration))
    assert session.planned.makespan_ns > 0


def test_filter_dims_and_navigation_skips(synthetic_run):
    session = open_session(synthetic_run, workers=0)
    index, run = session.index, session.run
    flt = parse_filter("stage=1 kind=F mb=2-3")
    assert flt.stages == {1} and flt.microbatches == {2, 3}
    index.set_filter(flt.matching_codes(run.catalog))
    lane = index.lanes[index.main_lane(1)]
    kept = np.flatnonzero(lane.cat != CAT_DIM)
    assert [run.catalog.texts[int(lane.code[i])] for i in kept if lane.it[i] == 0] == ["1F2", "1F3"]
    assert index.neighbour(index.main_lane(1), int(kept[0]), 1) == int(kept[1])
    index.set_filter(None)
    assert (lane.cat != CAT_DIM).all()


@pytest.mark.parametrize(
    "text, message",
    [
        ("rank", "expected rank="),
        ("rank=", "no value"),
        ("kind=Q", "unknown kind"),
        ("stage=a", "not a number"),
        ("colour=red", "expected rank="),
    ],
)
def test_filter_errors_say_what_to_type(text, message):
    with pytest.raises(FilterError, match=message):
        parse_filter(text)


def test_filter_groups_and_ranks():
    flt = parse_filter("r=0,2 kind=comm")
    assert flt.ranks == {0, 2} and len(flt.kinds) == 4
    assert flt.describe() == "rank=0,2 kind=RECV_B,RECV_F,SEND_B,SEND_F"
    assert parse_filter("").empty


def test_viewport_zoom_pan_fit_reveal():
    vp = Viewport(0.0, 1e6, 100, 0.0, 1e6)
    t = vp.time_at(30)
    vp.zoom(2, anchor_column=30)
    assert vp.span == 5e5 and vp.time_at(30) == pytest.approx(t)
    start = vp.start
    vp.pan(10)
    assert vp.start == pytest.approx(start + 10 * 5e3)
    vp.fit(2e5, 3e5, margin=0)
    assert (vp.start, vp.end) == (2e5, 3e5)
    vp.reveal(3.5e5, 3.6e5, margin_columns=1)
    assert vp.end >= 3.6e5 and vp.start <= 3.5e5
    vp.pan(1e9)  # the centre never leaves the run
    assert vp.start + vp.span / 2 <= 1e6
    vp.zoom(1e-9)
    assert vp.span <= 4e6
    vp.zoom(1e9)
    assert vp.ns_per_column == 10  # the most one column can show
    vp.resize(50)
    assert vp.ns_per_column == pytest.approx(vp.span / 50)


def test_history():
    h = History(limit=2)
    for place in [(0, 1), (0, 1), (0, 2), (1, 3)]:
        h.push(place)
    assert len(h) == 2 and h.pop() == (1, 3) and h.pop() == (0, 2) and h.pop() is None


def test_deadlock_finding_points_at_the_whole_cycle(deadlock_run):
    session = open_session(deadlock_run, workers=0)
    (view,) = [v for v in session.findings if v.finding.kind == "deadlock"]
    index = session.index
    by_lane = {(index.lanes[lane].rank, index.lanes[lane].role) for lane, _ in view.items}
    assert by_lane == {(0, MAIN), (0, COMM), (1, MAIN), (1, COMM)}
    texts = {session.run.catalog.texts[int(index.lanes[lane].code[i])] for lane, i in view.items}
    assert texts == {"0RECV_B0", "1RECV_F1"}
    assert all(index.lanes[lane].open[i] for lane, i in view.items)
    lo, hi = view.window
    assert lo <= min(index.lanes[lane].begin[i] for lane, i in view.items) < hi
    d = describe(session, *view.focus)
    assert ("end", "never: still running when the log ends") in d.rows
    assert any(note.startswith("error: deadlock") for note in d.notes)


def test_a_stalled_chain_also_shows_where_its_last_rank_is_stuck(crash_run):
    session = open_session(crash_run, workers=0)
    index = session.index
    kinds = [v.finding.kind for v in session.findings]
    assert kinds[:2] == ["rank_failed", "rank_stalled"]
    stalled = session.findings[1]
    ranks = {index.lanes[lane].rank for lane, _ in stalled.items}
    assert set(stalled.finding.ranks) <= ranks  # the crashed rank at the end of the chain too
    crashed = [(lane, i) for lane, i in stalled.items if index.lanes[lane].rank == 2]
    assert crashed and all(index.lanes[lane].open[i] for lane, i in crashed)
    assert session.run.catalog.texts[int(index.lanes[crashed[0][0]].code[crashed[0][1]])] == "2B0"


def test_describe_ops_steps_and_plan(synthetic_run):
    session = open_session(synthetic_run, workers=0)
    index = session.index
    main = index.main_lane(1)
    recv = int(np.flatnonzero(index.lanes[main].base_cat == CAT_RECV)[0])
    d = describe(session, main, recv)
    labels = dict(d.rows)
    assert d.title.startswith("rank 1 · 1RECV_F0")
    assert labels["recv"].startswith("from rank 0, channel F, seq 0")
    assert labels["matched"].startswith("rank 0 0SEND_F0")
    assert "planned" in labels and "plan position" in labels
    op = describe(session, index.lane_of(1, COMM), 0)
    assert op.title.startswith("rank 1 · recv of 1RECV_F0")
    planned = describe(session, index.lane_of(1, PLAN), 0)
    assert dict(planned.rows)["actual"].startswith("+")


def test_stats_tables(synthetic_run):
    session = open_session(synthetic_run, workers=0)
    run_table, ranks, stages = stats_tables(session)
    assert run_table.rows[1][0].startswith("bubble ratio")
    assert [row[0] for row in ranks.rows] == ["0", "1", "2", "3"]
    assert {row[1] for row in stages.rows} == {"F", "B"}


def test_units():
    assert units.duration(1_234_567) == "1.23 ms"
    assert units.duration(0) == "0 ns"
    assert units.duration(-2_500) == "-2.50 µs"
    assert units.tick_step(30e6, 6) == 5e6
    assert units.tick_label(1.5e6, 5e5, 3e6) == "1.5ms"
    assert units.size(4096) == "4.0 KiB"


def test_open_spans_are_drawn_to_the_end_of_the_log(deadlock_run):
    session = open_session(deadlock_run, workers=0)
    lane = session.index.lanes[session.index.main_lane(0)]
    i = int(np.flatnonzero(lane.open)[0])
    assert session.run.ranks[0].steps.end[lane.rows[i]] == OPEN
    assert lane.end[i] == session.index.log_end[0] > lane.begin[i]
