"""Lanes are built on first lookup: what start-up knows of a lane before building it (its
size, its time range) and a filter set before it is built must agree with the lane itself."""

from __future__ import annotations

import numpy as np
import pytest

from pipetrace.tui.lanes import MAIN
from pipetrace.tui.session import open_session

RUNS = ["synthetic_run", "deadlock_run", "crash_run", "overlap_run"]


@pytest.mark.parametrize("fixture", RUNS)
def test_the_extent_and_sizes_known_up_front_match_the_built_lanes(fixture, request):
    index = open_session(request.getfixturevalue(fixture), workers=0).index
    shown = index.lane_ids(comm=True, plan=True, threads=True)
    lanes = [index.lanes[i] for i in range(len(index.lanes))]
    assert shown == [i for i, lane in enumerate(lanes) if len(lane) or lane.role == MAIN]
    built = [lane for lane in lanes if len(lane)]
    assert index.t_min == min(int(lane.begin[0]) for lane in built)
    assert index.t_max == max(int(lane.end.max()) for lane in built)


def test_a_filter_set_before_a_lane_is_built_dims_it_as_one_set_after(synthetic_run):
    drawn_first, filtered_first = (open_session(synthetic_run, workers=0) for _ in range(2))
    catalog = drawn_first.run.catalog
    forwards = np.array(["F" in text for text in catalog.texts], bool)
    for lane_id in range(len(drawn_first.index.lanes)):
        drawn_first.index.lanes[lane_id].columns(0, 1e6, 40)
    drawn_first.index.set_filter(forwards)
    filtered_first.index.set_filter(forwards)
    dimmed = 0
    for lane_id in range(len(drawn_first.index.lanes)):
        before, after = filtered_first.index.lanes[lane_id], drawn_first.index.lanes[lane_id]
        assert np.array_equal(before.cat, after.cat)
        assert np.array_equal(
            filtered_first.index.selectable(lane_id), drawn_first.index.selectable(lane_id)
        )
        dimmed += int((~drawn_first.index.selectable(lane_id)).sum())
    assert dimmed > 0
