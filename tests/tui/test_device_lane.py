"""The TUI's device lane: with device timing, each rank gets a ``dev`` lane of its steps at
the times the device ran them, shown with the other sub-rows (recorded on fake devices)."""

from __future__ import annotations

import numpy as np
import pytest

from pipetrace.testing.device_replay import record_device_run, slow_forward_on_rank_1
from pipetrace.tui.describe import describe
from pipetrace.tui.lanes import DEVICE, MAIN
from pipetrace.tui.session import open_session


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("device-tui")
    record_device_run(run_dir, slow_forward_on_rank_1)
    return open_session(run_dir, workers=0)


def test_each_rank_has_a_device_lane_beside_its_main_lane(session):
    index = session.index
    for rank in session.run.ranks:
        lane_id = index.lane_of(rank.rank, DEVICE)
        assert lane_id in index.lane_ids(threads=True)
        assert lane_id not in index.lane_ids(threads=False)
        lane = index.lanes[lane_id]
        assert len(lane) == int((rank.steps.dend != -1).sum())
        assert np.array_equal(lane.begin, rank.steps.dbegin[lane.rows])
        assert (np.diff(lane.begin) >= 0).all()


def test_a_device_item_describes_its_device_times_and_lag(session):
    index = session.index
    lane_id = index.lane_of(1, DEVICE)
    lane = index.lanes[lane_id]
    item = next(i for i in range(len(lane)) if session.run.catalog.texts[lane.code[i]] == "1F1")
    d = describe(session, lane_id, item)
    assert d.title.endswith("· on the device")
    rows = dict(d.rows)
    assert rows["on the device"].endswith("for 3.00 ms")
    assert "device lag" in rows
    main = describe(session, index.lane_of(1, MAIN), 0)
    assert "on the device" not in main.title
