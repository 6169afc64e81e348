"""The Navigator (every move on the timeline) without the UI."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrace.tui.lanes import COMM, MAIN
from pipetrace.tui.navigator import Navigator
from pipetrace.tui.session import open_session


@pytest.fixture(scope="module")
def session(synthetic_run):
    return open_session(synthetic_run, workers=0)


def test_open_selects_the_first_step_of_a_clean_run(session):
    nav = Navigator(session)
    assert nav.open(100) is False
    assert nav.state.cursor == (session.index.main_lane(0), 0)
    assert nav.viewport.columns == 100


def test_peer_back_and_the_filter(session):
    nav = Navigator(session)
    nav.open(100)
    index = session.index
    nav.step(1)  # 0SEND_F0
    start = nav.state.cursor
    assert nav.peer() is None and index.lanes[nav.state.cursor[0]].rank == 1
    assert nav.back() is None and nav.state.cursor == start
    assert nav.back() == "nothing to go back to"
    assert nav.set_filter("rank=0") is None
    assert nav.peer() == "rank 1 is hidden by the filter"
    assert nav.set_filter("rank=9") == "no such rank: the run has ranks 0-3"
    assert "expected rank=" in nav.set_filter("nonsense")
    assert nav.clear() is None and nav.filter.empty
    nav.select(start[0], 0)  # 0F0
    assert nav.peer().startswith("not a P2P op")


def test_iterations_and_lanes(session):
    nav = Navigator(session)
    nav.open(100)
    assert nav.iteration(-1) is None  # from the whole run: the last iteration
    index = session.index
    b, e = index.iteration_span(1)
    assert nav.viewport.start <= b and nav.viewport.end >= e
    assert nav.goto_iteration(7) == "no iteration 7; this run has iterations 0-1"
    nav.lane(1)
    assert index.lanes[nav.state.cursor[0]].role == COMM
    nav.toggle_comm()
    assert all(index.lanes[i].role == MAIN for i in nav.state.lane_ids)
    assert index.lanes[nav.state.cursor[0]].role == MAIN  # the cursor left the hidden row


def test_previous_iteration_from_a_hung_one_that_spans_nearly_the_whole_run():
    hung = Path(__file__).resolve().parents[2] / "sample_traces" / "fault-hang"
    nav = Navigator(open_session(hung, workers=0))
    nav.open(100)
    index = nav.index
    last = int(index.iterations[-1])
    b, e = index.iteration_span(last)
    assert e - b > 0.8 * (index.t_max - index.t_min)  # the case: the view looks "whole"
    nav.fit()
    assert nav.iteration(-1) is None  # from the whole run: the last
    assert nav.iteration(-1) is None  # then the one before it
    shown = index.iteration_at(nav.viewport.start + nav.viewport.span / 2)
    assert shown == last - 1


def test_findings_cycle_and_clear(deadlock_run):
    nav = Navigator(open_session(deadlock_run, workers=0))
    assert nav.open(80) is True and nav.finding_index == 0 and nav.state.highlight
    assert nav.clear() is None and not nav.state.highlight
    assert nav.finding(-1) is None and nav.finding_index == len(nav.session.findings) - 1
    nav.set_filter("rank=1")
    assert nav.goto_finding(0) == "rank(s) [0] of this finding are hidden by the filter"


def test_a_first_finding_of_no_step_still_selects_a_step():
    straggler = Path(__file__).resolve().parents[2] / "sample_traces" / "fault-straggler"
    nav = Navigator(open_session(straggler, workers=0))
    assert nav.open(100) is True
    assert not nav.session.findings[nav.finding_index].items  # the case: nothing to focus
    assert nav.state.cursor is not None
    assert nav.step(1) is None and nav.state.cursor[1] > 0  # the keys that move it work


def test_the_first_view_laid_out_before_the_timeline_has_its_width_keeps_its_window():
    # the app lays out the first view after a refresh that may come before the timeline's
    # final width: a resize then must keep the time shown, not the time per column
    deadlock = Path(__file__).resolve().parents[2] / "sample_traces" / "fault-drop-send"
    nav = Navigator(open_session(deadlock, workers=0))
    assert nav.open(6) is True
    shown = (nav.viewport.start, nav.viewport.span)
    nav.resize(75)
    assert (nav.viewport.start, nav.viewport.span) == shown and nav.viewport.columns == 75
    nav.zoom(2)  # once moved, a resize keeps the time per column again
    per_column = nav.viewport.ns_per_column
    nav.resize(100)
    assert nav.viewport.ns_per_column == pytest.approx(per_column)
