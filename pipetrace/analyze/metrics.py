"""Timing metrics: iteration time, per-rank busy / P2P wait / bubble, per-stage step costs
and exposed communication, per iteration (`pipetrace.analyze.summary` reduces them).

Definitions (docs/analyze.md), per rank and iteration, on the aligned clock:

- *iteration time*: from the first rank's iter_begin to the last rank's iter_end.
- *busy*: time in compute steps (F, B, I, W, OVERLAP_F_B) minus the part a step spent
  waiting for an input that an earlier RECV posted (overlap mode: the consumer waits).
- *P2P wait*: time in SEND/RECV steps, plus those in-step waits, plus the end-of-iteration
  drain of sends.
- *bubble*: iteration time minus busy (as the simulator counts it: waiting is idle).
  ``bubble_ratio`` = bubble / busy, the simulator's definition, so it compares directly with
  the ideal (`pipetrace.analyze.ideal`, fed `Metrics.mean_costs`).
- *exposed comm*: in overlap mode, the part of a wait after the peer had already posted its
  side: transfer time that the schedule meant to hide behind compute. Time, like the P2P
  wait: ops waited together (the sends drained at a step's end) count their overlap once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipetrace.analyze.derive import (
    containing_rows,
    counterpart_values,
    run_bounds,
    run_starts,
    top_level,
)
from pipetrace.analyze.model import (
    IS_COMM,
    IS_COMPUTE,
    IS_COMPUTE_OR_COMPOSITE,
    KIND_CODE,
    KINDS,
    MAIN_THREAD,
    OPEN,
    RankTimeline,
    Run,
    StepCatalog,
    StepTable,
)
from pipetrace.schedule.ir import StepKind

OVERLAPPED = "~overlap"
"""Suffix of a `Metrics.stage_costs` kind for sub-steps run inside an OVERLAP_F_B composite:
they share the CPU with their sibling, so they are kept apart from standalone steps."""


@dataclass
class RankIterations:
    """Per rank, arrays over `Metrics.iterations` (NaN where the rank lacks the iteration)."""

    busy: np.ndarray
    p2p_wait: np.ndarray
    exposed: np.ndarray  # overlap-mode transfer waits
    blocking_transfer: np.ndarray  # plain-mode time in P2P after both sides were posted


@dataclass
class Metrics:
    iterations: list[int]
    start_ns: np.ndarray
    end_ns: np.ndarray
    complete: np.ndarray  # bool: every present rank began and ended it
    per_rank: dict[int, RankIterations]
    stage_costs: dict[tuple[int, str], np.ndarray]  # (stage, kind[+OVERLAPPED]) -> durations (ns)
    overlap_mode: bool = False

    @property
    def iteration_time(self) -> np.ndarray:
        return self.end_ns - self.start_ns

    def steady(self) -> np.ndarray:
        """Indices of complete iterations, without the first when there are more (warm-up)."""
        idx = np.flatnonzero(self.complete)
        return idx[1:] if len(idx) > 1 else idx

    def mean_costs(self) -> dict[tuple[int, str], float]:
        """Mean cost per (stage, kind) of standalone steps; a kind a stage only runs inside
        composites (OVERLAP_F_B) takes its overlapped cost."""
        keys = [key for key, v in self.stage_costs.items() if len(v)]
        means = reduce_groups(
            [self.stage_costs[key] for key in keys], lambda rows: rows.mean(axis=1)
        ).tolist()
        out = {key: m for key, m in zip(keys, means) if not key[1].endswith(OVERLAPPED)}
        for (stage, kind), m in zip(keys, means):
            if kind.endswith(OVERLAPPED):
                out.setdefault((stage, kind[: -len(OVERLAPPED)]), m)
        return out


def reduce_groups(
    groups: list[np.ndarray], reduce: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """``reduce`` applied to every (non-empty) group, one call per distinct group size.

    ``reduce`` gets the groups of one size as the rows of a 2-D array and returns one result
    per row (``lambda rows: np.percentile(rows, [50, 95], axis=1).T``). A big run has
    thousands of small groups (each stage's F steps, ...): a numpy call per group would cost
    more than its work. Each row gets the same arithmetic as a call on that group alone, so
    the results are the same."""
    sizes = np.fromiter(map(len, groups), np.int64, len(groups))
    order = np.argsort(sizes, kind="stable")
    cuts = np.flatnonzero(np.diff(sizes[order])) + 1
    parts = [
        reduce(np.stack([groups[i] for i in same])) for same in np.split(order, cuts) if len(same)
    ]
    if not parts:
        return np.empty(0)
    out = np.empty((len(groups), *parts[0].shape[1:]), parts[0].dtype)
    out[order] = np.concatenate(parts)
    return out


def compute_metrics(run: Run) -> Metrics:
    its = run.iterations()
    it_values = np.array(
        its, np.int64
    )  # searched once per table: not converted from the list each time
    n = len(its)
    start = np.full(n, np.iinfo(np.int64).max, np.int64)
    end = np.full(n, -1, np.int64)
    complete = np.ones(n, bool)
    for rank in run.present_ranks:
        t = rank.iterations
        idx = np.searchsorted(it_values, t.it)
        has = np.zeros(n, bool)
        ended = np.zeros(n, bool)
        has[idx] = t.begin != OPEN
        ended[idx] = t.end != OPEN
        np.minimum.at(start, idx[t.begin != OPEN], t.begin[t.begin != OPEN])
        np.maximum.at(end, idx[t.end != OPEN], t.end[t.end != OPEN])
        complete &= has & ended
    complete &= end >= 0
    start = np.where(start == np.iinfo(np.int64).max, 0, start)
    end = np.where(end < 0, start, end)
    per_rank = {}
    stage_costs: dict[tuple[int, str], list[np.ndarray]] = {}
    overlap = False
    partners = counterpart_values(run.ranks, "post")
    # The first iteration's steps pay for start-up (lazy initialisation, first allocations,
    # a first message's set-up): several times the others'. Left out of the step costs once
    # a later iteration completed, as it is out of the steady iteration time.
    warm_up = int(it_values[0]) if n > 1 and complete[1:].any() else None
    for rank in run.present_ranks:
        per_rank[rank.rank], costs, ov = _rank_metrics(
            run, rank, it_values, partners[rank.rank], warm_up
        )
        overlap |= ov
        for key, values in costs.items():
            stage_costs.setdefault(key, []).append(values)
    merged = {k: np.concatenate(v) for k, v in sorted(stage_costs.items())}
    if run.p2p_mode is not None:  # what the run says it did: on a device, a plain-mode send
        overlap = run.p2p_mode == "overlap"  # may run past its own step on its stream
    return Metrics(its, start, end, complete, per_rank, merged, overlap_mode=overlap)


@dataclass
class _TopSteps:
    """One rank's top-level steps (the plan's, not composites' parts), as `_rank_metrics`
    uses them; ``leaf_kind`` is the kind code of every step row."""

    begin: np.ndarray
    end: np.ndarray
    it_idx: np.ndarray  # index into the run's iterations
    is_comm: np.ndarray
    leaf_kind: np.ndarray

    @property
    def ended(self) -> np.ndarray:
        return self.end != OPEN


@dataclass
class _Waits:
    """A rank's P2P waits: per iteration, exposed (overlap mode) and blocking (plain mode)
    transfer time; per step row, the time it waited for an input; whether it overlapped."""

    exposed: np.ndarray
    blocking: np.ndarray
    waited: np.ndarray
    overlap: bool = False


def _rank_metrics(
    run: Run, rank: RankTimeline, its: np.ndarray, partner: np.ndarray, warm_up: int | None
):
    """One rank's `RankIterations`, its step costs by (stage, kind) and whether it ran in
    overlap mode. ``partner``: per P2P row, when the matched op was posted (-1: unmatched);
    ``warm_up``: the iteration left out of the step costs (None: none)."""
    catalog, steps, n = run.catalog, rank.steps, len(its)
    top = top_level(rank, catalog)
    leaf_kind = catalog.kind[steps.code]
    kind = leaf_kind[top]
    t = _TopSteps(
        steps.begin[top],
        steps.end[top],
        np.minimum(np.searchsorted(its, steps.it[top]), max(n - 1, 0)),  # np.clip is slower
        IS_COMM[kind],
        leaf_kind,
    )
    dur = np.where(t.ended, t.end - t.begin, 0)
    is_compute = IS_COMPUTE_OR_COMPOSITE[kind]
    busy = np.bincount(t.it_idx, weights=np.where(is_compute, dur, 0), minlength=n).astype(
        np.float64
    )
    wait = np.bincount(t.it_idx, weights=np.where(t.is_comm, dur, 0), minlength=n).astype(
        np.float64
    )
    waits = _p2p_waits(run, rank, its, partner, t, busy, wait)
    present = np.zeros(n, bool)
    present[np.searchsorted(its, rank.iterations.it)] = True
    nan = np.where(present, 0.0, np.nan)
    standalone = np.zeros(len(steps), bool)
    standalone[top] = True
    counted = None if warm_up is None else steps.it != warm_up
    timed = steps.dend != OPEN
    if timed.any():  # on a device-timed rank, a step without device times never ran there
        counted = timed if counted is None else counted & timed
    costs = _stage_costs(
        catalog,
        steps,
        leaf_kind,
        np.maximum((steps.end - steps.begin).astype(np.int64) - waits.waited, 0),
        standalone,
        counted,
    )
    iterations = RankIterations(busy + nan, wait + nan, waits.exposed + nan, waits.blocking + nan)
    return iterations, costs, waits.overlap


def _p2p_waits(
    run: Run,
    rank: RankTimeline,
    its: np.ndarray,
    partner: np.ndarray,
    t: _TopSteps,
    busy: np.ndarray,
    wait: np.ndarray,
) -> _Waits:
    """The rank's transfer waits. In plain mode an op completes inside its own SEND/RECV
    step; ops completing outside it mean overlap mode (`_overlap_waits`, which moves the
    in-step input waits from ``busy`` to ``wait``)."""
    n, p2p = len(its), rank.p2p
    waits = _Waits(np.zeros(n), np.zeros(n), np.zeros(len(rank.steps), np.int64))
    if not (len(p2p) and n and len(t.begin)):  # no ops, or (a damaged log) no step to own them
        return waits
    done = p2p.done
    ok = done != OPEN
    op_it = np.minimum(np.searchsorted(its, p2p.it), n - 1)
    poster = containing_rows(t.begin, t.end, p2p.post)
    ps = np.maximum(poster, 0)
    in_own = (
        ok & (poster >= 0) & ((t.end[ps] >= done) | (t.end[ps] == OPEN)) & (done >= t.begin[ps])
    )
    own = in_own & t.is_comm[ps] & (partner >= 0)
    waits.blocking = np.bincount(
        op_it[own],
        weights=np.maximum(done[own] - np.maximum(p2p.post[own], partner[own]), 0),
        minlength=n,
    )
    detached = ok & ~in_own  # none in plain mode
    waits.overlap = bool(detached.any())
    if waits.overlap:
        waits.exposed = _overlap_waits(run, rank, op_it, detached, partner, t, busy, wait, waits)
    return waits


def _overlap_waits(
    run: Run,
    rank: RankTimeline,
    op_it: np.ndarray,
    detached: np.ndarray,
    partner: np.ndarray,
    t: _TopSteps,
    busy: np.ndarray,
    wait: np.ndarray,
    waits: _Waits,
) -> np.ndarray:
    """Overlap mode, per iteration: the exposed transfer time. A received op's consuming
    compute step waits for it at its start (that wait leaves ``busy`` for ``wait`` and is
    added to ``waits.waited``); sends are drained after the iteration's last step."""
    steps, p2p, done, n = rank.steps, rank.p2p, rank.p2p.done, len(busy)
    consumer = _consumers(run, rank, t.leaf_kind)
    late = detached & (consumer >= 0)
    rows = consumer[late]
    wait_from = np.maximum(steps.begin[rows], p2p.post[late])
    inside = (done[late] >= steps.begin[rows]) & (
        (steps.end[rows] == OPEN) | (done[late] <= steps.end[rows])
    )
    w = np.where(inside, np.maximum(done[late] - wait_from, 0), 0)
    np.add.at(waits.waited, rows, w)
    on_main = steps.thread[rows] == MAIN_THREAD
    np.add.at(busy, op_it[late][on_main], -w[on_main].astype(np.float64))
    np.add.at(wait, op_it[late][on_main], w[on_main].astype(np.float64))
    # torch's GPipe and 1F1B wait a recv between its RECV step and the compute, outside
    # every step: the wait is the gap's, from the step before the consumer on
    gap_from = np.maximum(_last_end_before(t, steps.begin[rows]), p2p.post[late])
    in_gap = ~inside & (done[late] < steps.begin[rows]) & (done[late] > gap_from)
    wait_from = np.where(in_gap, gap_from, wait_from)
    inside |= in_gap
    np.add.at(wait, op_it[late][in_gap], (done[late][in_gap] - gap_from[in_gap]).astype(float))
    hidden_from = np.maximum(wait_from, partner[late])
    ended = t.ended
    last_end = _max_per_bin(t.it_idx[ended], t.end[ended], n)
    drained = detached & (consumer < 0) & (done > last_end[op_it])
    drain_from = np.maximum(last_end[op_it], p2p.post)
    drain = np.where(drained, np.maximum(done - drain_from, 0), 0)
    wait += _max_per_bin(op_it, drain, n)
    # exposed intervals: a late recv's wait after its peer posted, a drained send's likewise;
    # ops waited together (a step's sends drained at once) overlap: their time counts once
    late_ok = inside & (done[late] > hidden_from)
    drain_lo = np.maximum(drain_from, partner)
    drain_ok = drained & (done > drain_lo)
    return _union_per_bin(
        np.concatenate((op_it[late][late_ok], op_it[drain_ok])),
        np.concatenate((hidden_from[late_ok], drain_lo[drain_ok])),
        np.concatenate((done[late][late_ok], done[drain_ok])),
        n,
    )


def _last_end_before(t: _TopSteps, times: np.ndarray) -> np.ndarray:
    """For each time, the latest end of a top-level step at or before it (-1: none)."""
    ends = np.sort(t.end[t.ended])
    at = np.searchsorted(ends, times, side="right") - 1
    return np.where(at >= 0, ends[np.maximum(at, 0)], -1) if len(ends) else np.full_like(times, -1)


def _union_per_bin(index: np.ndarray, lo: np.ndarray, hi: np.ndarray, n: int) -> np.ndarray:
    """The time the intervals ``[lo, hi)`` cover (each lo < hi), split into bins 0..n-1:
    time, not the sum over intervals, so the bins add up to the union. An interval's bin
    (``index``) gets the part of it that no interval starting earlier (or at the same time,
    on an earlier row) covers: each bin gets at most the union of its own intervals. One
    stable sort by start (the rows come mostly in order) and a running maximum of the ends,
    no per-bin loop."""
    order = np.argsort(lo, kind="stable")
    start, stop = lo[order], hi[order]
    reach = np.maximum.accumulate(stop)  # the furthest end so far
    covered_to = np.concatenate((start[:1], reach[:-1]))
    fresh = np.maximum(stop - np.maximum(start, covered_to), 0)
    return np.bincount(index[order], weights=fresh, minlength=n)


def _stage_costs(
    catalog: StepCatalog,
    steps: StepTable,
    leaf_kind: np.ndarray,
    leaf_dur: np.ndarray,
    standalone: np.ndarray,
    counted: np.ndarray | None,
) -> dict[tuple[int, str], np.ndarray]:
    """Per-stage costs from the leaf compute rows (any thread), without their input waits:
    (stage, kind) for standalone steps, (stage, kind + OVERLAPPED) for composites' parts;
    ``counted``: the rows to take (None: all)."""
    leaf_stage = catalog.stage[steps.code]
    take = IS_COMPUTE[leaf_kind] & (leaf_stage >= 0) & (steps.end != OPEN)
    rows = np.flatnonzero(take if counted is None else take & counted)
    if not len(rows):
        return {}
    # one sort key per row: stage, kind (4 bits), inside a composite (1 bit)
    key = (
        (leaf_stage[rows].astype(np.int64) << 5)
        | (leaf_kind[rows].astype(np.int64) << 1)
        | ~standalone[rows]
    )
    order = np.argsort(key, kind="stable")  # stable: a group keeps the rows' order
    key, values = key[order], leaf_dur[rows[order]]
    first = run_starts(key)
    bounds = run_bounds(first, len(key))
    return {
        (k >> 5, KINDS[(k >> 1) & 15].value + (OVERLAPPED if k & 1 else "")): values[lo:hi]
        for k, lo, hi in zip(key[first].tolist(), bounds, bounds[1:])
    }


def _max_per_bin(index: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Per bin 0..n-1, the largest of its values and 0: ``np.maximum.at`` on zeros, which is
    slow (a generic per-element loop) while this is a few vectorized passes."""
    out = np.zeros(n, np.int64)
    if len(index):
        order = np.argsort(index, kind="stable")
        bins = index[order]
        first = run_starts(bins)
        out[bins[first]] = np.maximum(np.maximum.reduceat(values[order], first), 0)
    return out


def _consumers(run: Run, rank: RankTimeline, kinds: np.ndarray) -> np.ndarray:
    """Per P2P row, the step row (any thread) that consumes a received message: F for a
    RECV_F, B or I for a RECV_B, same stage, micro-batch and iteration (-1: none).
    ``kinds``: the kind code of each step row."""
    catalog, steps, p2p = run.catalog, rank.steps, rank.p2p
    out = np.full(len(p2p), -1, np.int64)
    if not len(p2p) or not len(steps):
        return out
    fwd = kinds == KIND_CODE[StepKind.F]
    bwd = (kinds == KIND_CODE[StepKind.B]) | (kinds == KIND_CODE[StepKind.I])
    rows = np.flatnonzero(fwd | bwd)
    if not len(rows):
        return out
    codes = steps.code[rows]
    key = _consumer_key(steps.it[rows], catalog.stage[codes], catalog.microbatch[codes], bwd[rows])
    order = np.argsort(key, kind="stable")
    key, rows = key[order], rows[order]
    rk = catalog.kind[p2p.code]
    recv_f, recv_b = rk == KIND_CODE[StepKind.RECV_F], rk == KIND_CODE[StepKind.RECV_B]
    want = recv_f | recv_b
    p_key = _consumer_key(p2p.it, catalog.stage[p2p.code], catalog.microbatch[p2p.code], recv_b)
    idx = np.clip(np.searchsorted(key, p_key), 0, len(key) - 1)
    hit = want & (key[idx] == p_key)
    out[hit] = rows[idx[hit]]
    return out


def _consumer_key(
    it: np.ndarray, stage: np.ndarray, mb: np.ndarray, backward: np.ndarray
) -> np.ndarray:
    """(iteration, stage, micro-batch, forward or backward) as one int64."""
    return ((it.astype(np.int64) * 65536 + stage) * 1048576 + mb) * 2 + backward
