"""Series the export shows that the run model does not hold: bubbles and in-flight counts.

All computed per rank from the model's columns (numpy, no loop over steps), on the model's
clock (ns since `Run.t0_ns`). Spans still open are taken to end at ``t_end``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetrace.analyze.model import (
    COMPOSITE_CODES,
    COMPUTE_CODES,
    KIND_CODE,
    OPEN,
    RankTimeline,
    StepCatalog,
)
from pipetrace.schedule.ir import StepKind

MIN_BUBBLE_NS = 10_000
"""Idle gaps shorter than this (Python overhead between two steps) are not shown as bubbles."""

_F, _B, _I, _W = (KIND_CODE[k] for k in (StepKind.F, StepKind.B, StepKind.I, StepKind.W))
_LOW, _HIGH = np.iinfo(np.int64).min, np.iinfo(np.int64).max


@dataclass
class Bubbles:
    begin: np.ndarray  # int64
    end: np.ndarray  # int64
    iteration: np.ndarray  # int32
    unfinished: np.ndarray  # bool: the gap runs into the end of an iteration that never ended


def ended(end: np.ndarray, t_end: int) -> np.ndarray:
    """End times with OPEN replaced by ``t_end``."""
    return np.where(end == OPEN, t_end, end)


def bubbles(
    rank: RankTimeline, catalog: StepCatalog, t_end: int, min_ns: int = MIN_BUBBLE_NS
) -> Bubbles:
    """Idle gaps on the rank's compute (no compute step running on any thread) inside its
    iterations, from each iteration's begin to its end."""
    steps, its = rank.steps, rank.iterations
    empty = Bubbles(
        np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, bool)
    )
    if not len(its):
        return empty
    kinds = catalog.kind[steps.code]
    busy = np.isin(kinds, COMPUTE_CODES) | np.isin(kinds, COMPOSITE_CODES)
    b = steps.begin[busy]
    e = ended(steps.end[busy], t_end)
    order = np.argsort(b, kind="stable")
    b, e = b[order], e[order]
    reach = np.maximum.accumulate(e) if len(e) else e
    g0 = np.r_[np.int64(_LOW), reach]  # idle from the end of everything so far ...
    g1 = np.r_[b, np.int64(_HIGH)]  # ... to the next begin
    gap = g1 > g0
    g0, g1 = g0[gap], g1[gap]
    iorder = np.argsort(its.begin, kind="stable")
    ib = its.begin[iorder]
    ie = ended(its.end[iorder], t_end)
    ie_reach = np.maximum.accumulate(ie)
    first = np.searchsorted(ie_reach, g0, side="right")  # first iteration ending after g0
    last = np.searchsorted(ib, g1, side="left")  # iterations beginning before g1
    count = np.clip(last - first, 0, None)
    gi = np.repeat(np.arange(len(g0)), count)
    offset = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    ii = np.repeat(first, count) + offset
    pb = np.maximum(g0[gi], ib[ii])
    pe = np.minimum(g1[gi], ie[ii])
    keep = pe - pb >= min_ns
    ii = ii[keep]
    pe = pe[keep]
    unfinished = (its.end[iorder][ii] == OPEN) & (pe == ie[ii])
    return Bubbles(pb[keep], pe, its.it[iorder][ii].astype(np.int32), unfinished)


def _step_function(t: np.ndarray, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(times, values) of a running sum of +-1 changes; one sample per distinct time."""
    if not len(t):
        return t.astype(np.int64), np.empty(0, np.int64)
    order = np.lexsort((delta, t))  # at equal times, decrements first: no false spikes
    t = t[order]
    value = np.cumsum(delta[order])
    last = np.r_[t[1:] != t[:-1], True]
    return t[last], value[last]


def messages_in_flight(rank: RankTimeline) -> tuple[np.ndarray, np.ndarray]:
    """P2P ops posted and not yet completed, as a step function over time."""
    p2p = rank.p2p
    done = p2p.done[p2p.done != OPEN]
    t = np.r_[p2p.post, done]
    delta = np.r_[np.ones(len(p2p.post), np.int64), -np.ones(len(done), np.int64)]
    return _step_function(t, delta)


def activations_in_flight(
    rank: RankTimeline, catalog: StepCatalog
) -> tuple[np.ndarray, np.ndarray]:
    """Micro-batches whose forward finished and whose activations are still held: +1 when an
    F ends, -1 when the step that frees them ends (the W of a backward split into I and W,
    else the B). A step that never ended never frees them."""
    steps = rank.steps
    kind = catalog.kind[steps.code].astype(np.int64)
    stage = catalog.stage[steps.code].astype(np.int64)
    mb = catalog.microbatch[steps.code].astype(np.int64)
    it = steps.it.astype(np.int64)
    pos = steps.pos.astype(np.int64)
    end = steps.end
    extra = _composite_leaves(steps, catalog, kind, it, pos)
    if extra is not None:
        kind, stage, mb, it, end = (np.r_[a, x] for a, x in zip((kind, stage, mb, it, end), extra))
    leaf = np.isin(kind, (_F, _B, _I, _W)) & (stage >= 0) & (mb >= 0)
    key = ((it + 1) << 42) | (stage << 21) | mb
    # micro-batches whose backward is split in I and W (by the plan, else by what ran): W frees them
    plan = rank.plan_codes[rank.plan_codes >= 0]
    planned_w = plan[catalog.kind[plan] == _W]
    planned = (catalog.stage[planned_w].astype(np.int64) << 21) | catalog.microbatch[planned_w]
    split = np.isin((stage << 21) | mb, planned) | np.isin(key, key[leaf & (kind == _W)])
    frees = np.where(split, kind == _W, (kind == _B) | (kind == _I))
    done = end != OPEN
    hold = leaf & (kind == _F) & done
    free = leaf & frees & done & np.isin(key, key[hold])
    # one release per micro-batch: the last freeing step that ended
    fkey, fend = key[free], end[free]
    order = np.lexsort((fend, fkey))
    fkey, fend = fkey[order], fend[order]
    last = np.r_[fkey[1:] != fkey[:-1], True] if len(fkey) else np.empty(0, bool)
    t = np.r_[end[hold], fend[last]]
    delta = np.r_[np.ones(int(hold.sum()), np.int64), -np.ones(int(last.sum()), np.int64)]
    return _step_function(t, delta)


def _composite_leaves(steps, catalog: StepCatalog, kind, it, pos):
    """Leaves of composite steps recorded without their sub-steps (kind, stage, mb, it, end),
    timed like the composite; None when every composite has its sub-steps."""
    comp = np.flatnonzero(np.isin(kind, COMPOSITE_CODES))
    if not len(comp):
        return None
    leaf_rows = np.isin(kind, (_F, _B, _I, _W))
    have = set(zip(it[leaf_rows].tolist(), pos[leaf_rows].tolist()))
    rows: list[tuple[int, int, int, int, int]] = []
    for row in comp.tolist():
        if (int(it[row]), int(pos[row])) in have:
            continue
        step = catalog.step(int(steps.code[row]))
        if step is None:
            continue
        for sub in step.leaves():
            rows.append(
                (
                    KIND_CODE[sub.kind],
                    sub.stage if sub.stage is not None else -1,
                    sub.microbatch if sub.microbatch is not None else -1,
                    int(it[row]),
                    int(steps.end[row]),
                )
            )
    if not rows:
        return None
    cols = np.array(rows, np.int64).T
    return cols[0], cols[1], cols[2], cols[3], cols[4]
