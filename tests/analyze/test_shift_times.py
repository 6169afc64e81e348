"""`load._shift_times` moves a rank with a constant clock offset in one pass per column; the
result must be the two passes' (shift every time, then move every time by the earliest),
whatever the times: OPEN ends, times near 0 that a shift would take to OPEN, negative device
times, drifting offsets beside constant ones."""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrace.analyze.clocks import ConstantOffset
from pipetrace.analyze.load import _shift_times
from pipetrace.analyze.model import (
    OPEN,
    ClockInfo,
    IterationTable,
    LifecycleEvent,
    MemoryTable,
    P2PTable,
    RankState,
    RankStatus,
    RankTimeline,
    StepTable,
)
from tests.analyze.model_equality import assert_same

_TIMES = st.lists(st.one_of(st.just(OPEN), st.integers(-5, 40)), max_size=6)


def _column(values: list[int]) -> np.ndarray:
    return np.array(values, np.int64)


@st.composite
def _rank(draw, number: int) -> RankTimeline:
    steps, ops, its = draw(_TIMES), draw(_TIMES), draw(_TIMES)
    n, m, k = len(steps), len(ops), len(its)
    zeros = np.zeros
    p2p = P2PTable.empty()
    p2p = P2PTable(
        *(
            _column(ops) if name in ("post", "done", "dbegin", "dend") else zeros(m, a.dtype)
            for name, a in vars(p2p).items()
        )
    )
    timeline = RankTimeline(
        rank=number,
        present=draw(st.booleans()) or number == 0,
        steps=_steps(_column(steps), _column(draw(st.permutations(steps))), n),
        p2p=p2p,
        iterations=IterationTable(zeros(k, np.int32), _column(its), _column(its), zeros(k)),
        status=RankStatus(RankState.ENDED, ""),
        clock=ClockInfo(None, None, None, 0, correction_ns=draw(st.integers(-30, 30))),
        lifecycle=[LifecycleEvent("clock", t, {}) for t in draw(st.lists(st.integers(0, 40)))],
    )
    timeline.memory = MemoryTable.empty()
    return timeline


def _steps(begin: np.ndarray, device: np.ndarray, n: int):
    zeros = np.zeros
    return StepTable(
        begin, begin.copy(), zeros(n, np.int32), zeros(n, np.int32), zeros(n, np.int32),
        zeros(n, np.int8), device, device.copy(),
    )  # fmt: skip


def _two_passes(ranks, offsets) -> int:
    """The loader's former way: every time shifted, then every time moved by t0."""
    present = [r for r in ranks if r.present]
    for rank in present:
        fn, correction = offsets[rank.rank], rank.clock.correction_ns
        for arr in rank.time_columns():
            ended = arr != OPEN
            arr[ended] += correction - fn(arr[ended])
        for ev in rank.lifecycle:
            ev.t = int(ev.t - fn(np.array([ev.t]))[0] + correction)
    firsts = [
        int(arr[arr != OPEN].min())
        for rank in present
        for arr in (rank.steps.begin, rank.p2p.post, rank.iterations.begin)
        if (arr != OPEN).any()
    ] + [ev.t for rank in present for ev in rank.lifecycle]
    t0 = min(firsts) if firsts else 0
    for rank in present:
        for arr in rank.time_columns():
            np.subtract(arr, t0, out=arr, where=arr != OPEN)
        for ev in rank.lifecycle:
            ev.t -= t0
    return t0


def _drifting(t: np.ndarray) -> np.ndarray:
    return (3 + t.astype(np.float64) * 0.5).astype(np.int64)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), count=st.integers(1, 3))
def test_one_pass_per_column_equals_two(data, count):
    ranks = [data.draw(_rank(number)) for number in range(count)]
    offsets = {
        r.rank: data.draw(st.one_of(st.integers(-30, 30).map(ConstantOffset), st.just(_drifting)))
        for r in ranks
    }
    expected = copy.deepcopy(ranks)
    assert _shift_times(ranks, offsets) == _two_passes(expected, offsets)
    assert_same(ranks, expected)
