"""The TUI on runs with nothing, or partly nothing, to show: a one-line failure and a
non-zero exit, or a blank lane; never a crash."""

from __future__ import annotations

import shutil

from pipetrace.recorder import format as fmt
from pipetrace.tui.app import PipetraceApp

from .conftest import SAMPLES, run_async, screen_text, wait_loaded


def header_only(tmp_path, ranks) -> str:
    run = tmp_path / "run"
    shutil.copytree(SAMPLES / "clean-1f1b", run)
    for rank in ranks:
        log = fmt.rank_log_path(run, rank)
        log.write_bytes(log.read_bytes().split(b"\n", 1)[0] + b"\n")
    return run


@run_async
async def test_a_run_without_events_fails_loading_and_exits_non_zero(tmp_path):
    app = PipetraceApp(header_only(tmp_path, range(3)))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_loaded(pilot)
        assert "no events after its header" in (app.load_error or "")
        await pilot.press("q")
    assert app.return_code == 2


@run_async
async def test_a_rank_without_events_draws_an_empty_lane(tmp_path):
    app = PipetraceApp(header_only(tmp_path, [1]))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_loaded(pilot)
        assert app.load_error is None
        assert "r1 main" in screen_text(app)
        await pilot.press("q")
    assert app.return_code == 0
