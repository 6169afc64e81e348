"""Putting several hosts on rank 0's clock: one offset per host, and how sure it is.

The ranks of one host read one clock, so a run spread over hosts has one unknown per host
(not per rank), and the messages between hosts bound it:

1. **Recorded offset.** Each host takes the recorded offset model (`clocks.offset_models`:
   drift when the start and end exchanges differ, else a constant) of its most certain rank,
   and all its ranks use it; the exchange says the true offset lies within ± its
   uncertainty, a first interval for the host's correction ``c``.
2. **Causal order.** A message between hosts cannot complete on its receiver before its
   sender posted it: a matched pair (post ``p`` on host a, done ``d`` on host b, on the
   recorded offsets) gives ``c_a - c_b <= d - p``. With the reference host (rank 0's) fixed
   at 0, shortest paths over these difference constraints (Bellman-Ford) give each host's
   interval ``[lo, hi]`` of corrections consistent with every message and the exchange.
3. **Choice.** Hosts are fixed one after another at the middle of their interval (given the
   ones already fixed, so the result is consistent as a whole); the **uncertainty** reported
   is half the interval's width, plus the drift a constant model leaves unmodelled. If the
   recorded offsets contradict the messages (no correction within their ± satisfies them), the
   messages alone are used; if even they cannot be satisfied, the recorded offsets are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipetrace.analyze.clocks import (
    OffsetFn,
    apply_offsets,
    message_pairs,
    offsets_recorded,
    preference,
    tightest_bounds,
)
from pipetrace.analyze.model import RankTimeline
from pipetrace.records import JsonRecord

UNBOUNDED = 2**62
"""A bound no constraint sets (an interval open on that side)."""


@dataclass
class HostClock(JsonRecord):
    """One host's alignment (an entry of ``metrics.clocks.hosts``)."""

    host: str
    ranks: list[int]
    offset_ns: int | None
    """The recorded offset (start of the run) of its most certain rank; None: not recorded."""
    correction_ns: int
    """Added to the recorded offset's times so that messages keep their causal order."""
    uncertainty_ns: int | None
    """± of the aligned times: half the consistent interval (None: unbounded on a side)."""


def host_groups(ranks: list[RankTimeline]) -> list[tuple[str, list[int]]]:
    """The hosts of the present ranks (header ``host``), in order of their lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank in ranks:
        groups.setdefault(str(rank.header.get("host", "?")), []).append(rank.rank)
    return list(groups.items())


def align_hosts(
    ranks: list[RankTimeline], models: dict[int, dict[str, OffsetFn]]
) -> tuple[dict[int, OffsetFn], dict[str, Any]]:
    """Each rank's offset function (its host's) and correction, and the alignment quality
    with a ``hosts`` list (`HostClock`); the keys otherwise as `clocks.align`'s."""
    groups = host_groups(ranks)
    by_rank = {r.rank: r for r in ranks}
    leaders = [min(members, key=lambda r: _certainty(by_rank[r])) for _, members in groups]
    names = {lead: preference(models[lead], 0) for lead in leaders}
    host_of = {r: h for h, (_, members) in enumerate(groups) for r in members}
    fns = {r: models[leaders[host_of[r]]][names[leaders[host_of[r]]]] for r in by_rank}
    src, dst, post, done = message_pairs(ranks)
    slack = apply_offsets(fns, dst, done) - apply_offsets(fns, src, post)
    host_index = np.zeros(max(host_of) + 1, np.int64)
    host_index[list(host_of)] = list(host_of.values())
    h_src, h_dst = host_index[src], host_index[dst]
    across = h_src != h_dst  # within a host one clock: nothing to learn
    bounds = tightest_bounds(h_src[across], h_dst[across], slack[across])
    recorded = [0] + [_uncertainty(by_rank[lead]) for lead in leaders[1:]]
    solved = _solve(len(groups), bounds, recorded)
    corrections, halves, model = solved if solved else ([0] * len(groups), recorded, None)
    hosts = []
    for h, (host, members) in enumerate(groups):
        lead = by_rank[leaders[h]]
        for r in members:
            by_rank[r].clock.applied = names[leaders[h]]
            by_rank[r].clock.correction_ns = corrections[h]
        unmodelled = abs(lead.clock.drift_ns) if names[leaders[h]] != "interpolated" else 0
        half = None if halves[h] is None or halves[h] >= UNBOUNDED else halves[h] + unmodelled
        hosts.append(
            HostClock(host, members, lead.clock.offset_start_ns, corrections[h], half).to_json()
        )
    if model == "recorded" and all(name == "none" for name in names.values()):
        model = "messages only"  # no host recorded an offset: the messages did it all
    quality = _quality(slack[across], bounds, corrections, model)
    quality["offsets_recorded"] = offsets_recorded(models)
    quality["hosts"] = hosts
    return fns, quality


def one_host(ranks: list[RankTimeline]) -> list[dict[str, Any]]:
    """``hosts`` for a run on one host: the reference itself (its ranks are aligned one by
    one, `clocks.align`)."""
    (host, members), *_ = host_groups(ranks) or [("?", [])]
    lead = min(ranks, key=_certainty, default=None)
    offset = lead.clock.offset_start_ns if lead is not None else None
    return [HostClock(host, members, offset, 0, 0).to_json()]


def _certainty(rank: RankTimeline) -> int:
    return _uncertainty(rank) if rank.rank else -1  # rank 0 is the reference itself


def _uncertainty(rank: RankTimeline) -> int:
    u = rank.clock.uncertainty_ns
    return u if u is not None and u >= 0 else UNBOUNDED


def _quality(
    slack: np.ndarray,
    bounds: tuple[np.ndarray, ...],
    corrections: list[int],
    model: str | None,
) -> dict[str, Any]:
    """The keys of `clocks.align`'s quality, for hosts."""
    b_src, b_dst, w = bounds
    c = np.array(corrections, np.int64)
    early = slack < 0
    return {
        "message_pairs_checked": len(w),
        "early_receives_before": int(early.sum()),
        "worst_early_ns": int(-slack.min()) if early.any() else 0,
        "refined": bool(c.any()),
        "feasible": model is not None,
        "model": model or "recorded (no consistent alignment)",
        "min_slack_ns": int((w + c[b_dst] - c[b_src]).min()) if len(w) else None,
        "max_correction_ns": int(np.abs(c).max()),
    }


def _solve(
    n: int, bounds: tuple[np.ndarray, ...], recorded: list[int]
) -> tuple[list[int], list[int], str] | None:
    """Corrections (host 0 fixed at 0), the half-width of each host's interval, and which
    constraints were used; None when the messages admit no correction."""
    src, dst, w = bounds
    # c_s - c_d <= w is an edge d -> s of weight w; the exchange's ± bounds host h to 0's
    known = [h for h in range(1, n) if recorded[h] < UNBOUNDED]
    exchange = (
        np.array([0] * len(known) + known, np.int64),
        np.array(known + [0] * len(known), np.int64),
        np.array([recorded[h] for h in known] * 2, np.int64),
    )
    messages = (dst.astype(np.int64), src.astype(np.int64), w.astype(np.int64))
    for edges, model in ((_join(messages, exchange), "recorded"), (messages, "messages only")):
        first = _intervals(n, edges)
        if first is None:
            continue
        corrections = [0] * n
        for h in range(1, n):
            lo, hi = _intervals(n, edges)[h]  # feasible: the host fixed before keep it so
            corrections[h] = _middle(lo, hi)
            edges = _join(edges, _fix(h, corrections[h]))
        halves = [UNBOUNDED if max(-lo, hi) >= UNBOUNDED else (hi - lo) // 2 for lo, hi in first]
        halves[0] = 0
        return corrections, halves, model
    return None


def _join(*edge_sets: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    return tuple(np.concatenate(parts) for parts in zip(*edge_sets))


def _fix(h: int, value: int) -> tuple[np.ndarray, ...]:
    """Edges that hold host h at ``value`` (c_h - c_0 <= value and c_0 - c_h <= -value)."""
    return np.array([0, h]), np.array([h, 0]), np.array([value, -value])


def _middle(lo: int, hi: int) -> int:
    if lo > -UNBOUNDED and hi < UNBOUNDED:
        return (lo + hi) // 2
    return min(0, hi) if hi < UNBOUNDED else max(0, lo) if lo > -UNBOUNDED else 0


def _intervals(n: int, edges: tuple[np.ndarray, ...]) -> list[tuple[int, int]] | None:
    """Each host's [lo, hi] with host 0 at 0; None when the constraints are inconsistent."""
    frm, to, w = edges
    hi = _distances(n, frm, to, w)
    back = _distances(n, to, frm, w)
    if hi is None or back is None:
        return None
    return [(-int(b), int(a)) for a, b in zip(hi, back)]


def _distances(n: int, frm: np.ndarray, to: np.ndarray, w: np.ndarray) -> np.ndarray | None:
    """Shortest path lengths from node 0 (`UNBOUNDED` where unreachable); None on a
    negative cycle."""
    dist = np.full(n, UNBOUNDED, np.int64)
    dist[0] = 0
    for _ in range(n + 1):
        before = dist.copy()
        reached = dist[frm] < UNBOUNDED
        np.minimum.at(dist, to[reached], dist[frm[reached]] + w[reached])
        if np.array_equal(before, dist):
            return dist
    return None
