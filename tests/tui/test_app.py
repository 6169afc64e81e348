"""The app driven headless with Pilot: loading, navigation, findings, peers, filter, panels."""

from __future__ import annotations

import numpy as np
import pytest

from pipetrace.cli import main
from pipetrace.tui.app import PipetraceApp
from pipetrace.tui.filters import parse_filter
from pipetrace.tui.help import HelpScreen
from pipetrace.tui.lanes import CAT_DIM, COMM, MAIN, PLAN

from .conftest import SAMPLES, run_async, screen_text, wait_loaded


def _text_of(app, place) -> str:
    lane = app.session.index.lanes[place[0]]
    return app.session.run.catalog.texts[int(lane.code[place[1]])]


@run_async
async def test_loads_in_the_background_then_shows_every_rank(synthetic_run):
    app = PipetraceApp(synthetic_run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_loaded(pilot)
        text = screen_text(app)
        assert "1f1b-synthetic · 1f1b · 4 ranks · 8 mb · 2 it" in text
        for rank in range(4):
            assert f"r{rank} main" in text
        assert "rank 0 · 0F0" in text  # details of the first step, selected on open
        assert app.state.cursor == (app.session.index.main_lane(0), 0)
        assert app.load_error is None


@run_async
async def test_navigation_moves_the_cursor_along_and_across_lanes(synthetic_run):
    app = PipetraceApp(synthetic_run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_loaded(pilot)
        index = app.session.index
        main0, main1 = index.main_lane(0), index.main_lane(1)
        await pilot.press("right", "right")
        assert app.state.cursor == (main0, 2)
        await pilot.press("left")
        assert app.state.cursor == (main0, 1)
        await pilot.press("down")  # rank 0's p2p row
        assert app.state.cursor[0] == index.lane_of(0, COMM)
        await pilot.press("down")  # rank 1's main row, the step nearest in time
        lane_id, item = app.state.cursor
        assert lane_id == main1
        t = index.lanes[main0].begin[1]
        assert (
            abs(index.lanes[main1].begin[item] - t)
            <= np.abs(index.lanes[main1].begin - t).min()
            + index.lanes[main1].end[item]
            - index.lanes[main1].begin[item]
        )
        assert f"rank 1 · {_text_of(app, app.state.cursor)}" in screen_text(app)
        await pilot.press("end")
        assert app.state.cursor == (main1, len(index.lanes[main1]) - 1)
        vp = app.state.viewport
        assert vp.start <= index.lanes[main1].begin[-1] <= vp.end  # revealed
        await pilot.press("home")
        assert app.state.cursor == (main1, 0)


@run_async
async def test_zoom_pan_and_iterations(synthetic_run):
    app = PipetraceApp(synthetic_run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_loaded(pilot)
        vp = app.state.viewport
        span = vp.span
        await pilot.press("plus")
        assert vp.span == pytest.approx(span / 2)
        await pilot.press("minus", "minus")
        assert vp.span == pytest.approx(span * 2)
        await pilot.press("plus")
        start = vp.start
        await pilot.press("shift+right")
        assert vp.start == pytest.approx(start + vp.span / 4)
        await pilot.press("z", "right_square_bracket")  # from the whole run: the first iteration
        b0, e0 = app.session.index.iteration_span(0)
        assert vp.start <= b0 and vp.end >= e0 and vp.span < (e0 - b0) * 1.1
        await pilot.press("right_square_bracket")
        b1, e1 = app.session.index.iteration_span(1)
        assert vp.start <= b1 < e1 <= vp.end
        lane = app.session.index.lanes[app.state.cursor[0]]
        assert lane.it[app.state.cursor[1]] == 1
        await pilot.press("g", "0", "enter")  # go to iteration 0 by number
        assert vp.start <= b0 < e0 <= vp.end < (b1 + e1) / 2
        await pilot.press("b")  # back to where the jump started
        assert app.session.index.lanes[app.state.cursor[0]].it[app.state.cursor[1]] == 1


@run_async
async def test_jump_to_peer_and_back(synthetic_run):
    app = PipetraceApp(synthetic_run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_loaded(pilot)
        index = app.session.index
        await pilot.press("right")  # 0F0 -> 0SEND_F0
        start = app.state.cursor
        assert _text_of(app, start) == "0SEND_F0"
        await pilot.press("m")
        assert (
            app.state.cursor[0] == index.main_lane(1)
            and _text_of(app, app.state.cursor) == "1RECV_F0"
        )
        assert "rank 1 · 1RECV_F0" in screen_text(app)
        await pilot.press("m")  # the match of the match is where we came from
        assert app.state.cursor == start
        await pilot.press("m", "b")  # and back pops the jump
        assert app.state.cursor == start
        # on the p2p row: op to op
        await pilot.press("down")
        comm = app.state.cursor
        assert index.lanes[comm[0]].role == COMM
        await pilot.press("m")
        assert (
            index.lanes[app.state.cursor[0]].role == COMM
            and index.lanes[app.state.cursor[0]].rank == 1
        )
        await pilot.press("b")
        assert app.state.cursor == comm
        await pilot.press("up", "left", "m")  # 0F0 is no P2P op: the cursor stays
        assert _text_of(app, app.state.cursor) == "0F0"


@run_async
async def test_deadlock_is_shown_on_open_with_the_whole_cycle_highlighted(deadlock_run):
    app = PipetraceApp(deadlock_run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_loaded(pilot)
        index = app.session.index
        assert app.panel == "findings" and app.nav.finding_index == 0
        highlighted = {
            (index.lanes[lane].rank, index.lanes[lane].role) for lane, _ in app.state.highlight
        }
        assert highlighted == {(0, MAIN), (0, COMM), (1, MAIN), (1, COMM)}
        assert _text_of(app, app.state.cursor) == "0RECV_B0"
        vp = app.state.viewport
        for lane, item in app.state.highlight:
            assert vp.start <= index.lanes[lane].begin[item] <= vp.end
        text = screen_text(app)
        assert "ERROR   deadlock deadlock: rank 0 in 0RECV_B0" in text
        assert "rB0╌╌" in text and "rF1╌╌" in text  # open steps drawn to the end of the log
        await pilot.press("escape")
        assert not app.state.highlight
        await pilot.press("n")  # next finding highlights again
        assert app.state.highlight and app.nav.finding_index == 0


@run_async
async def test_picking_a_finding_in_the_list_moves_the_timeline(synthetic_run, deadlock_run):
    app = PipetraceApp(deadlock_run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_loaded(pilot)
        await pilot.press("escape")  # drop the highlight
        app.state.viewport.fit_all()
        await pilot.press("f")  # focuses the list
        assert app.focused.id == "finding-list"
        await pilot.press("enter")
        assert app.state.highlight and app.focused.id == "timeline"
        assert "cause: every rank in the cycle waits" in screen_text(app)


@run_async
async def test_filter_toggles_and_panels(synthetic_run):
    app = PipetraceApp(synthetic_run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_loaded(pilot)
        index = app.session.index
        await pilot.press("slash", *"r=1,2", "enter")
        assert app.nav.filter == parse_filter("rank=1,2")
        assert {index.lanes[i].rank for i in app.state.lane_ids} == {1, 2}
        assert "r0 main" not in screen_text(app) and "filter rank=1,2" in screen_text(app)
        assert index.lanes[app.state.cursor[0]].rank in (1, 2)  # the cursor moved off rank 0
        app.apply_filter("kind=B")
        assert (
            index.lanes[index.main_lane(0)].cat[index.lanes[index.main_lane(0)].base_cat != 1]
            == CAT_DIM
        ).all()
        await pilot.press("escape")  # clears the filter
        assert app.nav.filter.empty and len(app.state.lane_ids) == 8
        await pilot.press("c")
        assert len(app.state.lane_ids) == 4
        await pilot.press("p")
        assert [index.lanes[i].role for i in app.state.lane_ids[:2]] == [MAIN, PLAN]
        assert "   plan" in screen_text(app)
        await pilot.press("s")
        assert "bubble ratio (idle / busy)" in screen_text(app)
        await pilot.press("d")
        assert "plan position" in screen_text(app)
        app.apply_filter("kind=X")  # an error is a notification, the filter is kept
        assert app.nav.filter.empty


@run_async
async def test_help_and_command_palette(synthetic_run):
    app = PipetraceApp(synthetic_run)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_loaded(pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert "jump to the matching op on the peer rank" in screen_text(app)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("ctrl+p", *"iteration 1")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        b1, e1 = app.session.index.iteration_span(1)
        assert app.state.viewport.start <= b1 < e1 <= app.state.viewport.end


@run_async
async def test_mouse_click_selects_and_wheel_zooms(synthetic_run):
    app = PipetraceApp(synthetic_run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_loaded(pilot)
        timeline = app.query_one("#timeline")
        gutter = timeline.gutter_width
        index = app.session.index
        lane = index.lanes[index.main_lane(2)]
        vp = app.state.viewport
        i = int(np.argmax(lane.end - lane.begin))  # a wide step, easy to hit
        column = int(vp.column_of((lane.begin[i] + lane.end[i]) / 2))
        row = app.state.lane_ids.index(index.main_lane(2))
        await pilot.click("#timeline", offset=(gutter + column, row))
        assert app.state.cursor == (index.main_lane(2), i)
        span = vp.span
        await pilot.mouse_down(
            "#timeline", offset=(gutter + 10, 0)
        )  # (a press and release without moving)
        await pilot.mouse_up("#timeline", offset=(gutter + 10, 0))
        timeline.post_message(timeline.Zoom(1.25, 10))
        await pilot.pause()
        assert vp.span == pytest.approx(span / 1.25)


@run_async
async def test_a_run_that_cannot_be_loaded_says_why(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "meta.json").write_text("{}")
    app = PipetraceApp(bad)
    async with app.run_test(size=(80, 24)) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "does not look like a pipetrace run" in app.load_error
        assert "Press q to quit" in screen_text(app)
        await pilot.press("q")
    assert app.return_code == 2


@run_async
async def test_overlap_thread_gets_its_own_row(overlap_run):
    app = PipetraceApp(overlap_run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_loaded(pilot)
        index = app.session.index
        roles = [(index.lanes[i].rank, index.lanes[i].name) for i in app.state.lane_ids]
        assert (0, "ovlp") in roles and (1, "ovlp") in roles
        main0 = index.main_lane(0)
        lane = index.lanes[main0]
        composite = int(np.flatnonzero(lane.base_cat == 6)[0])
        assert app.state.cursor == (main0, 0)
        await pilot.press(*["right"] * composite)  # step by step to the first composite
        await pilot.pause()
        assert app.state.cursor == (main0, composite)
        text = screen_text(app)
        assert "sub-steps" in text and "overlap," in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["tui", "/nonexistent/run"], "no such run directory"),
        (["tui"], "Missing argument"),
    ],
)
def test_cli_errors_exit_2(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_cli_needs_a_terminal(synthetic_run, capsys):
    assert main(["tui", str(synthetic_run)]) == 2  # pytest's stdout is no terminal
    assert "needs a terminal" in capsys.readouterr().err


needs_samples = pytest.mark.skipif(
    not (SAMPLES / "fault-deadlock" / "meta.json").exists(), reason="no sample_traces/"
)


@needs_samples
@run_async
async def test_recorded_deadlock_highlights_its_cycle():
    app = PipetraceApp(SAMPLES / "fault-deadlock")
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_loaded(pilot)
        index = app.session.index
        kinds = [v.finding.kind for v in app.session.findings]
        k = kinds.index("deadlock")
        while app.nav.finding_index != k:
            await pilot.press("n")
        highlighted = {
            (index.lanes[lane].rank, index.lanes[lane].role) for lane, _ in app.state.highlight
        }
        assert {(1, MAIN), (2, MAIN), (1, COMM), (2, COMM)} <= highlighted
        assert _text_of(app, app.state.cursor) in ("1SEND_F1", "2RECV_F0")
        assert all(
            index.lanes[lane].open[i]
            for lane, i in app.state.highlight
            if index.lanes[lane].rank in (1, 2)
        )


@needs_samples
@run_async
async def test_recorded_run_jump_to_peer():
    app = PipetraceApp(SAMPLES / "clean-1f1b")
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_loaded(pilot)
        assert not app.state.highlight  # nothing above info: no finding opened
        main0 = app.session.index.main_lane(0)
        while not _text_of(app, app.state.cursor).startswith("0SEND_F"):
            await pilot.press("right")
        start = app.state.cursor
        await pilot.press("m")
        assert app.state.cursor[0] == app.session.index.main_lane(1)
        assert _text_of(app, app.state.cursor) == "1RECV_F" + _text_of(app, start)[len("0SEND_F") :]
        await pilot.press("b")
        assert app.state.cursor == start and start[0] == main0
