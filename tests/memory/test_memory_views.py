"""The memory timeline in the views: the TUI's ``mem`` lane (levels from the samples, details
of a sample, hidden with the other sub-rows) and the Perfetto export's counter track per
rank, on fake-cluster runs recorded with memory samples."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.load import load_run
from pipetrace.export.chrome_json import write_chrome_json
from pipetrace.export.layout import build_layout
from pipetrace.export.perfetto import write_perfetto
from pipetrace.testing.cluster import FakeCluster
from pipetrace.tui.app import PipetraceApp
from pipetrace.tui.describe import describe
from pipetrace.tui.lanes import MEMORY
from pipetrace.tui.session import open_session
from tests.tui.conftest import wait_loaded

ACTIVATION = 1 << 20


@pytest.fixture(scope="module")
def gpipe_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("memory") / "gpipe"
    FakeCluster.of(
        "gpipe", ranks=2, microbatches=4, iterations=2, activation_bytes=ACTIVATION
    ).record(path)
    return path


def test_each_rank_has_a_memory_lane_with_the_sampled_levels(gpipe_run):
    session = open_session(gpipe_run, workers=0)
    index = session.index
    for rank in session.run.ranks:
        lane_id = index.lane_of(rank.rank, MEMORY)
        assert lane_id in index.lane_ids(threads=True)
        assert lane_id not in index.lane_ids(threads=False)
        lane = index.lanes[lane_id]
        memory = rank.memory
        assert np.array_equal(lane.levels, memory.saved.sum(axis=1) + memory.inflight.sum(axis=1))
        assert (lane.end[:-1] == lane.begin[1:]).all()  # a sample holds until the next
        assert lane.levels.max() >= 4 * ACTIVATION  # GPipe: every micro-batch held at once


def test_a_memory_sample_describes_each_stage_and_the_peak(gpipe_run):
    session = open_session(gpipe_run, workers=0)
    lane_id = session.index.lane_of(0, MEMORY)
    lane = session.index.lanes[lane_id]
    peak = int(np.argmax(lane.levels))
    d = describe(session, lane_id, peak)
    assert d.title == "rank 0 · memory after 0RECV_B0"  # all 4 held, a gradient arrived
    assert dict(d.rows)["stage 0"].startswith("4.0 MiB saved for backward")
    assert d.notes == ["the rank's peak"]


def test_the_memory_lane_draws_levels_up_to_full_blocks(gpipe_run):
    async def screen() -> str:
        app = PipetraceApp(gpipe_run)
        async with app.run_test(size=(120, 30)) as pilot:
            await wait_loaded(pilot)
            await pilot.press("z")  # the whole run
            await pilot.pause()
            strips = app.screen._compositor.render_strips()
            return "\n".join("".join(seg.text for seg in strip) for strip in strips)

    text = asyncio.run(screen())
    rows = [line for line in text.splitlines() if " mem " in line]
    assert len(rows) == 2
    for row in rows:  # GPipe climbs one micro-batch at a time to its peak, then back down
        assert "█" in row and len(set(row) & set("▁▂▃▄▅▆▇")) >= 3


def test_the_export_has_a_memory_counter_per_rank(gpipe_run):
    from tests.export.decode import decode_chrome_json, decode_perfetto

    run = load_run(gpipe_run, workers=0)
    layout = build_layout(run, analyze(run).findings)
    proto, js = io.BytesIO(), io.BytesIO()
    write_perfetto(layout, proto)
    write_chrome_json(layout, js)
    trace = decode_perfetto(proto.getvalue())
    peaks: dict[int, int] = {}
    for c in trace.counters:
        if trace.track_name(c.track) == "activation bytes":
            rank = trace.rank_of(c.track)
            peaks[rank] = max(peaks.get(rank, 0), c.value)
    report = analyze(run).summary.memory
    assert peaks == {r.rank: r.peak_bytes for r in report.ranks}
    names = {x["name"] for x in decode_chrome_json(js.getvalue()).events if x["ph"] == "C"}
    assert "activation bytes" in names


def test_memory_lanes_snapshot(snap_compare, gpipe_run):
    """GPipe's ramp on the ``mem`` lanes of both ranks, the whole run in view."""
    assert snap_compare(
        PipetraceApp(gpipe_run), press=["z"], terminal_size=(100, 24), run_before=wait_loaded
    )
