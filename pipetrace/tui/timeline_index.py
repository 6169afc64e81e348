"""Every lane of a run and the queries the timeline, details and findings views make (no UI):
building the lanes from the run model, neighbours, the step at a time, the peer of a P2P op,
a finding's step reference, the filter's dimming.
"""

from __future__ import annotations

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


class TimelineIndex:
    """Every lane of a run and the queries the timeline and details views make."""

    def __init__(self, run: Run, *, plan_lanes: dict[int, Lane] | None = None) -> None:
        self.run = run
        self.lanes: list[Lane] = []
        self.lanes_of_rank: dict[int, list[int]] = {}
        self.log_end: dict[int, int] = {}
        for rank in run.ranks:
            self.log_end[rank.rank] = rank.last_time()
            lanes = _rank_lanes(run, rank.rank, self.log_end[rank.rank])
            if plan_lanes and rank.rank in plan_lanes:
                lanes.insert(1, plan_lanes[rank.rank])
            self.lanes_of_rank[rank.rank] = list(
                range(len(self.lanes), len(self.lanes) + len(lanes))
            )
            self.lanes.extend(lanes)
        begins = [int(ln.begin[0]) for ln in self.lanes if len(ln)]
        ends = [int(ln.end.max()) for ln in self.lanes if len(ln)]
        self.t_min = min(begins, default=0)
        self.t_max = max(ends + [self.t_min + 1])
        self.iterations, self.iter_begin, self.iter_end = _global_iterations(run)
        self._filter_mask: dict[int, np.ndarray] = {}

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
                if shown[self.lanes[i].role] and (len(self.lanes[i]) or self.lanes[i].role == MAIN)
            )
        return out

    def main_lane(self, rank: int) -> int:
        return self.lanes_of_rank[rank][0]

    def lane_of(self, rank: int, role: str) -> int | None:
        return next(
            (i for i in self.lanes_of_rank.get(rank, []) if self.lanes[i].role == role), None
        )

    # -- filter ----------------------------------------------------------------------------

    def set_filter(self, matches_code: np.ndarray | None) -> None:
        """Dim every item whose step code is not in ``matches_code`` (bool per catalog code);
        None clears the filter."""
        self._filter_mask.clear()
        for lane_id, lane in enumerate(self.lanes):
            if matches_code is None:
                lane.set_categories(lane.base_cat)
                continue
            ok = np.where(lane.code >= 0, matches_code[np.maximum(lane.code, 0)], False)
            self._filter_mask[lane_id] = ok
            lane.set_categories(np.where(ok, lane.base_cat, CAT_DIM).astype(np.int8))

    def selectable(self, lane_id: int) -> np.ndarray | None:
        """Bool per item: not dimmed by the filter (None: every item)."""
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
            lane = self.lanes[lane_id]
            if lane.source != STEPS:
                continue
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
            lane = self.lanes[lane_id]
            if lane.source != STEPS:
                continue
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


def _iteration_spans(rank) -> tuple[np.ndarray, np.ndarray]:
    t = rank.iterations
    ok = t.begin != OPEN
    begin, end = t.begin[ok], t.end[ok]
    end = np.where(end == OPEN, rank.last_time(), end)
    order = np.argsort(begin, kind="stable")
    return begin[order].astype(np.int64), end[order].astype(np.int64)


def _rank_lanes(run: Run, rank_id: int, log_end: int) -> list[Lane]:
    rank = run.ranks[rank_id]
    catalog = run.catalog
    spans = _iteration_spans(rank)
    steps = rank.steps
    lanes = []
    top = top_level(rank, catalog) if len(steps) else np.empty(0, np.int64)
    lanes.append(_step_lane(run, rank_id, MAIN, "main", top, log_end, spans))
    for thread in np.unique(steps.thread):
        if int(thread) == MAIN_THREAD:
            continue
        rows = np.flatnonzero(steps.thread == thread)
        name = run.threads[int(thread)]
        lanes.append(
            _step_lane(
                run, rank_id, THREAD, SHORT_THREAD_NAMES.get(name, name[:4]), rows, log_end, spans
            )
        )
    lanes.append(_device_lane(run, rank_id))
    lanes.append(_memory_lane(run, rank_id, log_end))
    p = rank.p2p
    order = np.argsort(p.post, kind="stable")
    done = p.done[order]
    is_open = done == OPEN
    code = p.code[order]
    cat = np.where(p.op[order] == 0, CAT_SEND, CAT_RECV).astype(np.int8)
    lanes.append(
        Lane(
            rank_id,
            COMM,
            "p2p",
            P2P,
            order.astype(np.int64),
            p.post[order].astype(np.int64),
            np.where(is_open, max(log_end, 0), done).astype(np.int64),
            is_open,
            code.astype(np.int32),
            p.it[order].astype(np.int32),
            cat,
        )
    )
    del catalog
    return lanes


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


def _memory_lane(run: Run, rank_id: int, log_end: int) -> Lane:
    """The rank's memory samples (empty without): each holds until the next, the last until
    the log ends; its level is the bytes of all the rank's stages (saved plus in flight).
    Items carry the step after which they were taken, so the filter dims them with it."""
    memory = run.ranks[rank_id].memory
    begin = memory.t.astype(np.int64)
    end = np.r_[begin[1:], max(log_end, int(begin[-1]))] if len(begin) else begin.copy()
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
        end.astype(np.int64),
        np.zeros(len(begin), bool),
        code.astype(np.int32),
        it.astype(np.int32),
        np.full(len(begin), CAT_OTHER, np.int8),
        levels=memory.saved.sum(axis=1) + memory.inflight.sum(axis=1),
    )


def _step_lane(
    run: Run,
    rank_id: int,
    role: str,
    name: str,
    rows: np.ndarray,
    log_end: int,
    spans: tuple[np.ndarray, np.ndarray],
) -> Lane:
    steps = run.ranks[rank_id].steps
    begin = steps.begin[rows]
    order = np.argsort(begin, kind="stable")
    rows = rows[order].astype(np.int64)
    begin = begin[order].astype(np.int64)
    end = steps.end[rows]
    is_open = end == OPEN
    end = np.where(is_open, np.maximum(log_end, begin), end).astype(np.int64)
    code = steps.code[rows].astype(np.int32)
    cat = CATEGORY_OF_KIND_CODE[run.catalog.kind[code].astype(np.int64) + 1]
    return Lane(
        rank_id,
        role,
        name,
        STEPS,
        rows,
        begin,
        end,
        is_open,
        code,
        steps.it[rows].astype(np.int32),
        cat,
        iter_spans=spans,
    )


def _global_iterations(run: Run) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per iteration seen on any rank: the earliest begin and the latest end over ranks."""
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
        stop = np.where(t.end == OPEN, rank.last_time(), t.end)
        np.maximum.at(end, idx, stop)
    begin = np.where(begin == np.iinfo(np.int64).max, np.maximum(end, 0), begin)
    end = np.maximum(end, begin)
    order = np.argsort(begin, kind="stable")
    return its[order], begin[order], end[order]
