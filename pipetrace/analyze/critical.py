"""The cross-rank critical path of one iteration, through send-to-recv edges.

Walk backwards from the last step end of the iteration. On a rank at time t, take the step
running before t (a gap before t is *idle*). If the step finished by waiting for a message
(a RECV, a consumer waiting on an early-posted recv, a send waiting for its receiver) and the
peer posted its side after the wait began, the path spends [peer post, done] on the message
and jumps to the peer at its post time; otherwise the step's own time is on the path (a wait
at its start for a message already on its way counted as p2p) and the walk continues before it. Time strictly decreases at each step, so the walk ends.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipetrace.analyze.derive import containing_rows, counterpart_values, top_level
from pipetrace.analyze.model import (
    COMPOSITE_CODE,
    COMPUTE_CODES,
    KINDS,
    OPEN,
    RECV_CODES,
    SEND_CODES,
    Run,
)


@dataclass
class Segment:
    rank: int
    start_ns: int
    end_ns: int
    what: str  # "compute", "p2p", "idle", "other"
    step: str | None  # step text (compute / p2p in a step)
    kind: str | None  # F, B, I, W, OVERLAP_F_B, SEND_F, ... or None

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "what": self.what,
            "step": self.step,
            "kind": self.kind,
        }


class _RankView:
    """One rank's top-level steps and completed P2P ops in the iteration; ``partner_post``:
    per P2P row of the rank, when its matched op was posted (-1: unmatched)."""

    def __init__(self, run: Run, rank: int, iteration: int, partner_post: np.ndarray) -> None:
        r = run.ranks[rank]
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
        self.op_row = sel
        self.op_partner_post = partner_post[sel]
        self.op_holder = containing_rows(self.begin, self.end, self.op_done)


def critical_path(run: Run, iteration: int, max_segments: int = 200_000) -> dict[str, Any] | None:
    views: dict[int, _RankView] = {}
    partners = counterpart_values(run.ranks, "post")

    def view(rank: int) -> _RankView:
        if rank not in views:
            views[rank] = _RankView(run, rank, iteration, partners[rank])
        return views[rank]

    start_rank, t = -1, -1
    for r in run.present_ranks:
        v = view(r.rank)
        ended = v.end[v.end != OPEN]
        if len(ended) and ended.max() > t:
            start_rank, t = r.rank, int(ended.max())
    if start_rank < 0:
        return None
    end_t = t
    begin_t = min(
        (int(view(r.rank).begin.min()) for r in run.present_ranks if len(view(r.rank).begin)),
        default=t,
    )
    segments: list[Segment] = []
    rank = start_rank
    texts = run.catalog.texts
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
            segments.append(Segment(rank, e, t, "idle", None, None))
            t = e
        k = int(v.kind[i])
        kind = KINDS[k].value if k >= 0 else None
        what = (
            "compute"
            if (k in COMPUTE_CODES or k == COMPOSITE_CODE)
            else "p2p"
            if (k in SEND_CODES or k in RECV_CODES)
            else "other"
        )
        text = texts[int(v.code[i])]
        # a message this step waited for, whose other side was posted after the wait began
        ops = np.flatnonzero((v.op_holder == i) & (v.op_done <= t) & (v.op_peer >= 0))
        jump = None
        for j in ops[np.argsort(-v.op_done[ops])]:
            wait_from = max(b, int(v.op_post[j]))
            partner = int(v.op_partner_post[j])
            if partner > wait_from and partner < t:
                jump = (int(v.op_peer[j]), partner, int(v.op_done[j]))
                break
        if jump is not None:
            peer, partner, done = jump
            if done < t:
                segments.append(Segment(rank, done, t, what, text, kind))
            segments.append(Segment(rank, partner, min(done, t), "p2p", text, kind))
            rank, t = peer, partner
            continue
        # a compute step that first waited for a message already on its way (posted by an
        # earlier RECV, overlap mode): the wait is P2P time, the rest compute
        waited = np.flatnonzero(
            (v.op_holder == i) & (v.op_done <= t) & (v.op_done > b) & (v.op_post < b)
        )
        if what == "compute" and len(waited):
            arrived = int(v.op_done[waited].max())
            segments.append(Segment(rank, arrived, t, what, text, kind))
            segments.append(Segment(rank, b, arrived, "p2p", text, kind))
        else:
            segments.append(Segment(rank, b, t, what, text, kind))
        if b >= t and i == 0:
            break
        t = b if b < t else t - 1
    segments.reverse()
    return _summary(iteration, begin_t, end_t, segments)


def _summary(iteration: int, begin: int, end: int, segments: list[Segment]) -> dict[str, Any]:
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
    return {
        "iteration": iteration,
        "start_ns": begin,
        "end_ns": end,
        "length_ns": sum(by_what.values()),
        "by_what_ns": dict(by_what),
        "compute_by_kind_ns": dict(by_kind),
        "by_rank_ns": {str(k): v for k, v in sorted(by_rank.items())},
        "rank_hops": hops,
        "segments": [s.to_json() for s in segments],
    }
