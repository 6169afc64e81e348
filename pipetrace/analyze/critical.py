"""The cross-rank critical path of one iteration, through send-to-recv edges.

Walk backwards from the last step end of the iteration. On a rank at time t, take the step
running before t (a gap before t is *idle*). If the step finished by waiting for a message
(a RECV, a consumer waiting on an early-posted recv, a send waiting for its receiver) and the
peer posted its side after the wait began, the path spends [peer post, done] on the message
and jumps to the peer at its post time; otherwise the step's own time is on the path (a wait
at its start for a message already on its way counted as p2p) and the walk continues before
it. Time strictly decreases at each step, so the walk ends.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipetrace.analyze.derive import containing_rows, counterpart_values, top_level
from pipetrace.analyze.model import (
    COMPOSITE_CODES,
    COMPUTE_CODES,
    KINDS,
    OPEN,
    RECV_CODES,
    SEND_CODES,
    Run,
)
from pipetrace.records import JsonRecord


@dataclass
class Segment(JsonRecord):
    rank: int
    start_ns: int
    end_ns: int
    what: str  # "compute", "p2p", "idle", "other"
    step: str | None  # step text (compute / p2p in a step)
    kind: str | None  # F, B, I, W, OVERLAP_F_B, SEND_F, ... or None


@dataclass
class CriticalPath:
    """The critical path of one iteration and where its time went (ns on the aligned clock).

    Computed once by `pipetrace.analyze.analysis.analyze`; the report, the diff and the JSON
    read these totals rather than adding up the segments again."""

    iteration: int
    start_ns: int
    end_ns: int
    length_ns: int
    by_what_ns: dict[str, int]  # "compute", "p2p", "idle", "other" -> time
    compute_by_kind_ns: dict[str, int]  # F, B, ... -> compute time on the path
    by_rank_ns: dict[int, int]  # rank -> time on the path, by rank
    rank_hops: int  # times the path moves to another rank
    segments: list[Segment]  # in time order
    complete: bool = True  # False: the iteration never completed (its path so far)

    @classmethod
    def of(cls, iteration: int, begin: int, end: int, segments: list[Segment]) -> CriticalPath:
        """The totals of a walked path."""
        by_what: dict[str, int] = defaultdict(int)
        by_kind: dict[str, int] = defaultdict(int)
        by_rank: dict[int, int] = defaultdict(int)
        for s in segments:
            d = s.end_ns - s.start_ns
            by_what[s.what] += d
            if s.what == "compute" and s.kind:
                by_kind[s.kind] += d
            by_rank[s.rank] += d
        hops = sum(1 for a, b in zip(segments, segments[1:]) if a.rank != b.rank)
        return cls(
            iteration,
            begin,
            end,
            sum(by_what.values()),
            dict(by_what),
            dict(by_kind),
            dict(sorted(by_rank.items())),
            hops,
            segments,
        )

    def to_json(self, *, segments: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "iteration": self.iteration,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "length_ns": self.length_ns,
            "by_what_ns": self.by_what_ns,
            "compute_by_kind_ns": self.compute_by_kind_ns,
            "by_rank_ns": {str(k): v for k, v in self.by_rank_ns.items()},
            "rank_hops": self.rank_hops,
            "complete": self.complete,
        }
        if segments:
            out["segments"] = [s.to_json() for s in self.segments]
        return out


_Label = tuple[str, str, str | None]  # (what, step text, kind) of a step on the path


class _RankView:
    """One rank's top-level steps and completed P2P ops in the iteration; ``partner_post``:
    per P2P row of the rank, when its matched op was posted (-1: unmatched)."""

    def __init__(self, run: Run, rank: int, iteration: int, partner_post: np.ndarray) -> None:
        r = run.ranks[rank]
        self.rank = rank
        self.texts = run.catalog.texts
        self.kinds = run.catalog.kind
        top = top_level(r, run.catalog)
        top = top[r.steps.it[top] == iteration]
        self.begin = r.steps.begin[top]
        self.end = r.steps.end[top]
        self.code = r.steps.code[top]
        self.kind = run.catalog.kind[self.code]
        p = r.p2p
        sel = np.flatnonzero((p.it == iteration) & (p.done != OPEN))
        self.op_done = p.done[sel]
        self.op_post = p.post[sel]
        self.op_peer = p.match_rank[sel]
        self.op_partner_post = partner_post[sel]
        self.op_code = p.code[sel]
        self.op_holder = containing_rows(self.begin, self.end, self.op_done, ending=True)

    def label(self, i: int) -> _Label:
        """What step ``i`` counts as on the path, its text and its kind."""
        k = int(self.kind[i])
        what = (
            "compute"
            if (k in COMPUTE_CODES or k in COMPOSITE_CODES)
            else "p2p"
            if (k in SEND_CODES or k in RECV_CODES)
            else "other"
        )
        return what, self.texts[int(self.code[i])], KINDS[k].value if k >= 0 else None

    def jump(self, i: int, b: int, t: int) -> tuple[int, int, int] | None:
        """(peer, its post time, done) of the latest message step ``i`` (begun at ``b``)
        waited for before ``t`` whose other side was posted after the wait began."""
        ops = np.flatnonzero((self.op_holder == i) & (self.op_done <= t) & (self.op_peer >= 0))
        for j in ops[np.argsort(-self.op_done[ops])]:
            wait_from = max(b, int(self.op_post[j]))
            partner = int(self.op_partner_post[j])
            if partner > wait_from and partner < t:
                return int(self.op_peer[j]), partner, int(self.op_done[j])
        return None

    def gap_wait(self, e: int, t: int) -> tuple[list[Segment], tuple[int, int] | None] | None:
        """The gap (e, t] between two steps when a message was waited for in it, outside
        every step (torch's GPipe and 1F1B wait a recv between its RECV step and the
        compute): its segments, latest first (idle after the wait, the wait on P2P), and
        (peer, its post time) when the peer posted its side after the wait began, to jump
        to as `jump` does. None: no message was waited for in the gap."""
        ops = np.flatnonzero((self.op_holder < 0) & (self.op_done > e) & (self.op_done <= t))
        if not len(ops):
            return None
        ops = ops[np.argsort(-self.op_done[ops])]
        chosen, to = ops[0], None
        for j in ops:
            partner = int(self.op_partner_post[j])
            if self.op_peer[j] >= 0 and max(e, int(self.op_post[j])) < partner < self.op_done[j]:
                chosen, to = j, (int(self.op_peer[j]), partner)
                break
        done = int(self.op_done[chosen])
        code = int(self.op_code[chosen])
        k = int(self.kinds[code])
        label = (self.texts[code], KINDS[k].value if k >= 0 else None)
        segments = [Segment(self.rank, done, t, "idle", None, None)] if done < t else []
        wait_from = e if to is None else to[1]
        return [*segments, Segment(self.rank, wait_from, done, "p2p", *label)], to

    def own_time(self, i: int, b: int, t: int, label: _Label) -> list[Segment]:
        """Step ``i``'s own time [b, t], latest first. A compute step that first waited for
        a message already on its way (posted by an earlier RECV, overlap mode) spent that
        wait on P2P, the rest on compute."""
        what = label[0]
        waited = np.flatnonzero(
            (self.op_holder == i) & (self.op_done <= t) & (self.op_done > b) & (self.op_post < b)
        )
        if what == "compute" and len(waited):
            arrived = int(self.op_done[waited].max())
            return [
                Segment(self.rank, arrived, t, *label),
                Segment(self.rank, b, arrived, "p2p", *label[1:]),
            ]
        return [Segment(self.rank, b, t, *label)]


class _Views:
    """Each rank's `_RankView`, built when the walk first reaches the rank."""

    def __init__(self, run: Run, iteration: int) -> None:
        self.run, self.iteration = run, iteration
        self.partners = counterpart_values(run.ranks, "post")
        self.views: dict[int, _RankView] = {}

    def __call__(self, rank: int) -> _RankView:
        if rank not in self.views:
            self.views[rank] = _RankView(self.run, rank, self.iteration, self.partners[rank])
        return self.views[rank]


def critical_path(run: Run, iteration: int, max_segments: int = 200_000) -> CriticalPath | None:
    """The iteration's critical path, or None when no step of it ended."""
    view = _Views(run, iteration)
    start_rank, t = -1, -1
    for r in run.present_ranks:
        v = view(r.rank)
        ended = v.end[v.end != OPEN]
        if len(ended) and ended.max() > t:
            start_rank, t = r.rank, int(ended.max())
    if start_rank < 0:
        return None
    begin_t = min(
        (int(view(r.rank).begin.min()) for r in run.present_ranks if len(view(r.rank).begin)),
        default=t,
    )
    segments = _walk(view, start_rank, t, begin_t, max_segments)
    return CriticalPath.of(iteration, begin_t, t, segments)


def _walk(view: _Views, rank: int, t: int, begin_t: int, max_segments: int) -> list[Segment]:
    """The path's segments, in time order, walking back from ``t`` on ``rank``."""
    segments: list[Segment] = []
    while len(segments) < max_segments:
        v = view(rank)
        i = int(np.searchsorted(v.begin, t, side="left")) - 1
        if i < 0:
            if t > begin_t:
                segments.append(Segment(rank, begin_t, t, "idle", None, None))
            break
        b = int(v.begin[i])
        e = int(v.end[i]) if v.end[i] != OPEN and v.end[i] < t else t
        if e < t:
            gap = v.gap_wait(e, t)
            if gap is None:
                segments.append(Segment(rank, e, t, "idle", None, None))
            else:
                segments += gap[0]
                if gap[1] is not None:
                    rank, t = gap[1]
                    continue
            t = e
        label = v.label(i)
        jump = v.jump(i, b, t)
        if jump is not None:
            peer, partner, done = jump
            if done < t:
                segments.append(Segment(rank, done, t, *label))
            segments.append(Segment(rank, partner, min(done, t), "p2p", *label[1:]))
            rank, t = peer, partner
            continue
        segments += v.own_time(i, b, t, label)
        if b >= t and i == 0:
            break
        t = b if b < t else t - 1
    segments.reverse()
    return segments
