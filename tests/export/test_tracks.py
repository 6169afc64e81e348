"""Track assignment: nesting lanes for steps, a pool of lanes for P2P ops."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrace.export.tracks import nest_lanes, pool_lanes

spans = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 10)), min_size=0, max_size=30)


def _arrays(pairs):
    b = np.array([p[0] for p in pairs], np.int64)
    return b, b + np.array([p[1] for p in pairs], np.int64)


@settings(max_examples=300)
@given(spans)
def test_pool_gives_each_span_the_lowest_free_lane(pairs):
    begin, end = _arrays(pairs)
    lanes = pool_lanes(begin, end).tolist()
    last_end: dict[int, int] = {}
    for i in sorted(range(len(pairs)), key=lambda i: (begin[i], i)):
        lane = 0
        while (
            lane in last_end and not last_end[lane] < begin[i]
        ):  # free only strictly after its end
            lane += 1
        assert lanes[i] == lane
        last_end[lane] = int(end[i])


@settings(max_examples=300)
@given(spans)
def test_nest_lanes_nest(pairs):
    begin, end = _arrays(pairs)
    lanes = nest_lanes(begin, end)
    for lane in set(lanes.tolist()):
        rows = sorted(
            (i for i in range(len(pairs)) if lanes[i] == lane and end[i] > begin[i]),
            key=lambda i: (begin[i], -end[i], i),
        )
        stack: list[int] = []
        for i in rows:
            while stack and stack[-1] <= begin[i]:
                stack.pop()
            assert not stack or end[i] <= stack[-1]
            stack.append(int(end[i]))
    assert set(lanes.tolist()) <= set(range(len(pairs) + 1))


def test_properly_nested_spans_share_lane_zero():
    begin = np.array([0, 1, 3, 10, 10, 12, 20], np.int64)
    end = np.array([5, 2, 5, 15, 10, 14, 20], np.int64)
    assert nest_lanes(begin, end).tolist() == [0] * 7
    assert nest_lanes(np.array([0, 2]), np.array([5, 8])).tolist() == [0, 1]  # crossing
