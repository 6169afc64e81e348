"""Every lane of a run and the queries the timeline, details and findings views make (no UI):
building the lanes from the run model, neighbours, the step at a time, the peer of a P2P op,
a finding's step reference, the filter's dimming.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from pipetrace.analyze.derive import top_level
from pipetrace.analyze.device_times import device_rows
from pipetrace.analyze.model import MAIN_THREAD, OPEN, Run
from pipetrace.tui.lanes import (
    CAT_DIM,
    CAT_OTHER,
    CAT_RECV,
    CAT_SEND,
    CATEGORY_OF_KIND_CODE,
    COMM,
    DEVICE,
    MAIN,
    MEMORY,
    P2P,
    PLAN,
    SAMPLES,
    SHORT_THREAD_NAMES,
    STEPS,
    THREAD,
    Lane,
)
from pipetrace.tui.lazy import LazyMap
from pipetrace.tui.plan_lane import PlannedRun


class TimelineIndex:
    """Every lane of a run and the queries the timeline and details views make.

    A lane is built on first lookup (``lanes`` is a `LazyMap` by lane id): start-up only
    needs each lane's role, size and time range (its `LaneSpec`), and a screen shows a few
    dozen of a big run's thousands of lanes."""

    def __init__(self, run: Run, *, planned: PlannedRun | None = None) -> None:
        self.run = run
        self.specs: list[LaneSpec] = []
        self.lanes_of_rank: dict[int, list[int]] = {}
        self.log_end: dict[int, int] = {}
        for rank in run.ranks:
            self.log_end[rank.rank] = rank.last_time()
            specs = _rank_specs(run, rank.rank, self.log_end[rank.rank])
            if planned and rank.rank in planned.lanes:
                specs.insert(1, _plan_spec(planned, rank.rank))
            self.lanes_of_rank[rank.rank] = list(
                range(len(self.specs), len(self.specs) + len(specs))
            )
            self.specs.extend(specs)
        self.lanes: LazyMap[int, Lane] = LazyMap(range(len(self.specs)), self._build)
        spans = [spec.span for spec in self.specs if spec.size]
        self.t_min = min((b for b, _ in spans), default=0)
        self.t_max = max([e for _, e in spans] + [self.t_min + 1])
        self.iterations, self.iter_begin, self.iter_end = _global_iterations(run, self.log_end)
        self._matches: np.ndarray | None = None
        self._filter_mask: dict[int, np.ndarray] = {}

    def _build(self, lane_id: int) -> Lane:
        lane = self.specs[lane_id].build()
        if self._matches is not None:
            self._apply_filter(lane_id, lane)
        return lane

    # -- lanes -----------------------------------------------------------------------------

    def lane_ids(
        self,
        *,
        ranks: set[int] | None = None,
        comm: bool = True,
        plan: bool = False,
        threads: bool = True,
    ) -> list[int]:
        """The lanes to draw, top to bottom, for the given rank filter and sub-row toggles."""
        shown = {
            MAIN: True,
            THREAD: threads,
            DEVICE: threads,
            MEMORY: threads,
            COMM: comm,
            PLAN: plan,
        }
        out = []
        for rank, ids in self.lanes_of_rank.items():
            if ranks is not None and rank not in ranks:
                continue
            out.extend(
                i
                for i in ids
                if shown[self.specs[i].role] and (self.specs[i].size or self.specs[i].role == MAIN)
            )
        return out

    def main_lane(self, rank: int) -> int:
        return self.lanes_of_rank[rank][0]

    def lane_of(self, rank: int, role: str) -> int | None:
        return next(
            (i for i in self.lanes_of_rank.get(rank, []) if self.specs[i].role == role), None
        )

    # -- filter ----------------------------------------------------------------------------

    def set_filter(self, matches_code: np.ndarray | None) -> None:
        """Dim every item whose step code is not in ``matches_code`` (bool per catalog code);
        None clears the filter. Lanes not built yet get it when they are."""
        self._matches = matches_code
        self._filter_mask.clear()
        for lane_id, lane in self.lanes.built().items():
            if matches_code is None:
                lane.set_categories(lane.base_cat)
            else:
                self._apply_filter(lane_id, lane)

    def _apply_filter(self, lane_id: int, lane: Lane) -> None:
        matches = self._matches
        assert matches is not None
        ok = np.where(lane.code >= 0, matches[np.maximum(lane.code, 0)], False)
        self._filter_mask[lane_id] = ok
        lane.set_categories(np.where(ok, lane.base_cat, CAT_DIM).astype(np.int8))

    def selectable(self, lane_id: int) -> np.ndarray | None:
        """Bool per item: not dimmed by the filter (None: every item)."""
        if self._matches is None:
            return None
        self.lanes.get(lane_id)  # building a lane makes its mask
        return self._filter_mask.get(lane_id)

    # -- navigation ------------------------------------------------------------------------

    def neighbour(self, lane_id: int, item: int, step: int) -> int | None:
        """The next (step=+1) or previous (-1) item on the lane that the filter keeps."""
        mask = self.selectable(lane_id)
        n = len(self.lanes[lane_id])
        i = item + step
        while 0 <= i < n:
            if mask is None or mask[i]:
                return i
            i += step
        return None

    def nearest(self, lane_id: int, t: float) -> int | None:
        return self.lanes[lane_id].nearest(t, allowed=self.selectable(lane_id))

    def iteration_at(self, t: float) -> int | None:
        k = int(np.searchsorted(self.iter_begin, t, side="right")) - 1
        if k < 0:
            return int(self.iterations[0]) if len(self.iterations) else None
        return int(self.iterations[k])

    def iteration_span(self, iteration: int) -> tuple[int, int] | None:
        k = int(np.searchsorted(self.iterations, iteration))
        if k >= len(self.iterations) or self.iterations[k] != iteration:
            return None
        return int(self.iter_begin[k]), int(self.iter_end[k])

    # -- cross references ------------------------------------------------------------------

    def p2p_rows(self, lane_id: int, item: int) -> list[tuple[int, int]]:
        """The P2P ops (rank, row) an item stands for: itself on a comm lane, the ops its
        SEND/RECV step posted on a step lane."""
        lane = self.lanes[lane_id]
        if lane.source == P2P:
            return [(lane.rank, int(lane.rows[item]))]
        if lane.source != STEPS or lane.base_cat[item] not in (CAT_SEND, CAT_RECV):
            return []
        p2p = self.run.ranks[lane.rank].p2p
        hits = np.flatnonzero((p2p.code == lane.code[item]) & (p2p.it == lane.it[item]))
        return [(lane.rank, int(r)) for r in hits]

    def step_item(self, rank: int, code: int, iteration: int) -> tuple[int, int] | None:
        """The lane item of a rank's step (by catalog code and iteration), main lane first."""
        for lane_id in self.lanes_of_rank.get(rank, []):
            if self.specs[lane_id].source != STEPS:
                continue
            lane = self.lanes[lane_id]
            hits = np.flatnonzero((lane.code == code) & (lane.it == iteration))
            if len(hits):
                return lane_id, int(hits[0])
        return None

    def peer(self, lane_id: int, item: int) -> tuple[int, int] | None:
        """The matching op on the other rank, in the same kind of lane: a comm lane op jumps
        to the peer's op, a SEND/RECV step to the peer's step that posted the counterpart."""
        lane = self.lanes[lane_id]
        for rank, row in self.p2p_rows(lane_id, item):
            p2p = self.run.ranks[rank].p2p
            other, other_row = int(p2p.match_rank[row]), int(p2p.match_index[row])
            if other < 0:
                continue
            if lane.source == P2P:
                target = self.lane_of(other, COMM)
                if target is not None:
                    found = self.lanes[target].item_of_row(other_row)
                    if found is not None:
                        return target, found
            op = self.run.ranks[other].p2p
            hit = self.step_item(other, int(op.code[other_row]), int(op.it[other_row]))
            if hit is not None:
                return hit
        return None

    def resolve(
        self, rank: int, step_text: str, iteration: int | None, time_ns: int | None
    ) -> tuple[int, int] | None:
        """The lane item a finding's step reference points at (None when the step never ran)."""
        code = self.run.catalog.code(step_text)
        if code < 0 or rank not in self.lanes_of_rank:
            return None
        for lane_id in self.lanes_of_rank[rank]:
            if self.specs[lane_id].source != STEPS:
                continue
            lane = self.lanes[lane_id]
            hits = np.flatnonzero(lane.code == code)
            if iteration is not None and iteration >= 0:
                hits = hits[lane.it[hits] == iteration]
            if not len(hits):
                continue
            if time_ns is not None and len(hits) > 1:
                return lane_id, int(hits[np.argmin(np.abs(lane.begin[hits] - time_ns))])
            return lane_id, int(hits[-1] if iteration is None else hits[0])
        return None


# -- building ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaneSpec:
    """A lane before it is built: what choosing the lanes to draw and the run's time range
    need (``span``: its first begin and last end, as the built lane's ``begin[0]`` and
    ``end.max()``; meaningless when ``size`` is 0), and how to build it."""

    rank: int
    role: str
    source: str
    size: int
    span: tuple[int, int]
    build: Callable[[], Lane]


def _span(begin: np.ndarray, end: np.ndarray) -> tuple[int, int]:
    return (int(begin.min()), int(end.max())) if len(begin) else (0, 0)


def _rank_specs(run: Run, rank_id: int, log_end: int) -> list[LaneSpec]:
    """The rank's lanes top to bottom (without its plan lane): main, other threads, device,
    memory, P2P."""
    rank = run.ranks[rank_id]
    steps = rank.steps
    top = top_level(rank, run.catalog) if len(steps) else np.empty(0, np.int64)
    thread_rows = [  # the threads present, by a count (np.unique sorts: 4x the time)
        (thread, np.flatnonzero(steps.thread == thread))
        for thread in np.flatnonzero(np.bincount(steps.thread)).tolist()
        if thread != MAIN_THREAD
    ]
    device = np.flatnonzero(device_rows(steps.dbegin, steps.dend))
    memory_begin, memory_end = _memory_times(rank, log_end)
    post, done, _ = _p2p_times(rank, log_end)

    def step_spec(role: str, name: str, rows: np.ndarray) -> LaneSpec:
        begin, end, _ = _step_times(steps, rows, log_end)
        lane = partial(_step_lane, run, rank_id, role, name, rows, log_end)
        return LaneSpec(rank_id, role, STEPS, len(rows), _span(begin, end), lane)

    first_memory = (int(memory_begin[0]), int(memory_end.max())) if len(memory_begin) else (0, 0)
    return [
        step_spec(MAIN, "main", top),
        *(step_spec(THREAD, _thread_label(run.threads[t]), rows) for t, rows in thread_rows),
        LaneSpec(
            rank_id,
            DEVICE,
            STEPS,
            len(device),
            _span(steps.dbegin[device], steps.dend[device]),
            partial(_device_lane, run, rank_id),
        ),
        LaneSpec(
            rank_id,
            MEMORY,
            SAMPLES,
            len(memory_begin),
            first_memory,
            partial(_memory_lane, run, rank_id, log_end),
        ),
        LaneSpec(
            rank_id,
            COMM,
            P2P,
            len(post),
            _span(post, done),
            partial(_p2p_lane, run, rank_id, log_end),
        ),
    ]


def _thread_label(name: str) -> str:
    return SHORT_THREAD_NAMES.get(name, name[:4])


def _plan_spec(planned: PlannedRun, rank_id: int) -> LaneSpec:
    size, first, last = planned.extents[rank_id]
    return LaneSpec(rank_id, PLAN, PLAN, size, (first, last), lambda: planned.lanes[rank_id])


def _iteration_spans(rank) -> tuple[np.ndarray, np.ndarray]:
    t = rank.iterations
    ok = t.begin != OPEN
    begin, end = t.begin[ok], t.end[ok]
    end = np.where(end == OPEN, rank.last_time(), end)
    order = np.argsort(begin, kind="stable")
    return begin[order].astype(np.int64), end[order].astype(np.int64)


def _p2p_times(rank, log_end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each P2P op's post, drawn end (an open op runs to the end of the log) and openness,
    in row order."""
    p = rank.p2p
    is_open = p.done == OPEN
    return p.post, np.where(is_open, max(log_end, 0), p.done), is_open


def _p2p_lane(run: Run, rank_id: int, log_end: int) -> Lane:
    p = run.ranks[rank_id].p2p
    post, done, is_open = _p2p_times(run.ranks[rank_id], log_end)
    order = np.argsort(post, kind="stable")
    return Lane(
        rank_id,
        COMM,
        "p2p",
        P2P,
        order.astype(np.int64),
        post[order].astype(np.int64),
        done[order].astype(np.int64),
        is_open[order],
        p.code[order].astype(np.int32),
        p.it[order].astype(np.int32),
        np.where(p.op[order] == 0, CAT_SEND, CAT_RECV).astype(np.int8),
    )


def _device_lane(run: Run, rank_id: int) -> Lane:
    """The rank's steps at the times the device ran them (empty without device timing):
    beside the main lane, a device backlog shows as this lane running behind it."""
    steps = run.ranks[rank_id].steps
    rows = np.flatnonzero(device_rows(steps.dbegin, steps.dend))
    rows = rows[np.argsort(steps.dbegin[rows], kind="stable")].astype(np.int64)
    code = steps.code[rows].astype(np.int32)
    return Lane(
        rank_id,
        DEVICE,
        "dev",
        STEPS,
        rows,
        steps.dbegin[rows].astype(np.int64),
        steps.dend[rows].astype(np.int64),
        np.zeros(len(rows), bool),
        code,
        steps.it[rows].astype(np.int32),
        CATEGORY_OF_KIND_CODE[run.catalog.kind[code].astype(np.int64) + 1],
    )


def _memory_times(rank, log_end: int) -> tuple[np.ndarray, np.ndarray]:
    """Each memory sample's begin and end: it holds until the next, the last until the log
    ends."""
    begin = rank.memory.t.astype(np.int64)
    end = np.r_[begin[1:], max(log_end, int(begin[-1]))] if len(begin) else begin.copy()
    return begin, end.astype(np.int64)


def _memory_lane(run: Run, rank_id: int, log_end: int) -> Lane:
    """The rank's memory samples (empty without); its level is the bytes of all the rank's
    stages (saved plus in flight). Items carry the step after which they were taken, so the
    filter dims them with it."""
    memory = run.ranks[rank_id].memory
    begin, end = _memory_times(run.ranks[rank_id], log_end)
    step = memory.step
    steps = run.ranks[rank_id].steps
    known = step >= 0
    code = np.where(known, steps.code[np.maximum(step, 0)] if len(steps) else -1, -1)
    it = np.where(known, steps.it[np.maximum(step, 0)] if len(steps) else -1, -1)
    return Lane(
        rank_id,
        MEMORY,
        "mem",
        SAMPLES,
        np.arange(len(begin), dtype=np.int64),
        begin,
        end,
        np.zeros(len(begin), bool),
        code.astype(np.int32),
        it.astype(np.int32),
        np.full(len(begin), CAT_OTHER, np.int8),
        levels=memory.saved.sum(axis=1) + memory.inflight.sum(axis=1),
    )


def _step_times(steps, rows: np.ndarray, log_end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The steps' begins, drawn ends (an open step runs to the end of the log) and
    openness, in the order of ``rows``."""
    begin = steps.begin[rows]
    end = steps.end[rows]
    is_open = end == OPEN
    return begin, np.where(is_open, np.maximum(log_end, begin), end), is_open


def _step_lane(
    run: Run, rank_id: int, role: str, name: str, rows: np.ndarray, log_end: int
) -> Lane:
    rank = run.ranks[rank_id]
    steps = rank.steps
    rows = rows[np.argsort(steps.begin[rows], kind="stable")].astype(np.int64)
    begin, end, is_open = _step_times(steps, rows, log_end)
    code = steps.code[rows].astype(np.int32)
    cat = CATEGORY_OF_KIND_CODE[run.catalog.kind[code].astype(np.int64) + 1]
    return Lane(
        rank_id,
        role,
        name,
        STEPS,
        rows,
        begin.astype(np.int64),
        end.astype(np.int64),
        is_open,
        code,
        steps.it[rows].astype(np.int32),
        cat,
        iter_spans=_iteration_spans(rank),
    )


def _global_iterations(
    run: Run, log_end: dict[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per iteration seen on any rank: the earliest begin and the latest end over ranks
    (an open iteration ends where its rank's log ends, ``log_end``)."""
    its = np.array(run.iterations(), np.int64)
    begin = np.full(len(its), np.iinfo(np.int64).max, np.int64)
    end = np.full(len(its), -1, np.int64)
    for rank in run.present_ranks:
        t = rank.iterations
        if not len(t):
            continue
        idx = np.searchsorted(its, t.it)
        ok = t.begin != OPEN
        np.minimum.at(begin, idx[ok], t.begin[ok])
        stop = np.where(t.end == OPEN, log_end[rank.rank], t.end)
        np.maximum.at(end, idx, stop)
    begin = np.where(begin == np.iinfo(np.int64).max, np.maximum(end, 0), begin)
    end = np.maximum(end, begin)
    order = np.argsort(begin, kind="stable")
    return its[order], begin[order], end[order]
