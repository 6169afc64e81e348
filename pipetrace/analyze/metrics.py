"""Timing metrics: iteration time, per-rank busy / P2P wait / bubble, per-stage step costs,
the ideal bubble from the simulator, and exposed communication.

Definitions (docs/analyze.md), per rank and iteration, on the aligned clock:

- *iteration time*: from the first rank's iter_begin to the last rank's iter_end.
- *busy*: time in compute steps (F, B, I, W, OVERLAP_F_B) minus the part a step spent
  waiting for an input that an earlier RECV posted (overlap mode: the consumer waits).
- *P2P wait*: time in SEND/RECV steps, plus those in-step waits, plus the end-of-iteration
  drain of sends.
- *bubble*: iteration time minus busy (as the simulator counts it: waiting is idle).
  ``bubble_ratio`` = bubble / busy, the simulator's definition, so it compares directly with
  the ideal: `pipetrace.schedule.simulate.simulate` fed this run's mean per-stage F/B/I/W
  costs, with free communication.
- *exposed comm*: in overlap mode, the part of a wait after the peer had already posted its
  side: transfer time that the schedule meant to hide behind compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipetrace.analyze.derive import containing_rows, top_level
from pipetrace.analyze.model import (
    IS_COMM, IS_COMPUTE, IS_COMPUTE_OR_COMPOSITE, KIND_CODE, KINDS, MAIN_THREAD, OPEN, RankTimeline, Run,
)  # fmt: skip
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
    ideal: dict[str, Any] = field(default_factory=dict)
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
        out = {key: float(np.mean(v)) for key, v in self.stage_costs.items() if len(v) and not key[1].endswith(OVERLAPPED)}
        for (stage, kind), v in self.stage_costs.items():
            if kind.endswith(OVERLAPPED) and len(v):
                out.setdefault((stage, kind[: -len(OVERLAPPED)]), float(np.mean(v)))
        return out


def compute_metrics(run: Run) -> Metrics:
    its = run.iterations()
    n = len(its)
    start = np.full(n, np.iinfo(np.int64).max, np.int64)
    end = np.full(n, -1, np.int64)
    complete = np.ones(n, bool)
    for rank in run.present_ranks:
        t = rank.iterations
        idx = np.searchsorted(its, t.it)
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
    for rank in run.present_ranks:
        per_rank[rank.rank], costs, ov = _rank_metrics(run, rank, its)
        overlap |= ov
        for key, values in costs.items():
            stage_costs.setdefault(key, []).append(values)
    merged = {k: np.concatenate(v) for k, v in sorted(stage_costs.items())}
    metrics = Metrics(its, start, end, complete, per_rank, merged, overlap_mode=overlap)
    metrics.ideal = ideal_timeline(run, metrics.mean_costs())
    return metrics


def _rank_metrics(run: Run, rank: RankTimeline, its: list[int]):
    catalog = run.catalog
    n = len(its)
    steps, p2p = rank.steps, rank.p2p
    top = top_level(rank, catalog)
    begin, end = steps.begin[top], steps.end[top]
    kind = catalog.kind[steps.code[top]]
    it_idx = np.clip(np.searchsorted(its, steps.it[top]), 0, max(n - 1, 0))
    ended = end != OPEN
    dur = np.where(ended, end - begin, 0)
    is_compute = IS_COMPUTE_OR_COMPOSITE[kind]
    is_comm = IS_COMM[kind]
    busy = np.bincount(it_idx, weights=np.where(is_compute, dur, 0), minlength=n).astype(np.float64)
    wait = np.bincount(it_idx, weights=np.where(is_comm, dur, 0), minlength=n).astype(np.float64)
    exposed = np.zeros(n)
    blocking = np.zeros(n)
    waited = np.zeros(len(steps), np.int64)  # per step row: time spent waiting for an input
    overlap = False
    if len(p2p) and n:
        done = p2p.done
        ok = done != OPEN
        op_it = np.clip(np.searchsorted(its, p2p.it), 0, n - 1)
        partner = _partner_post(run, rank)
        poster = containing_rows(begin, end, p2p.post)
        ps = np.maximum(poster, 0)
        in_own = ok & (poster >= 0) & ((end[ps] >= done) | (end[ps] == OPEN)) & (done >= begin[ps])
        # plain mode: the op completes inside its own SEND/RECV step
        own = in_own & is_comm[ps] & (partner >= 0)
        np.add.at(blocking, op_it[own], np.maximum(done[own] - np.maximum(p2p.post[own], partner[own]), 0))
        # overlap mode, recvs: the consuming compute step waits for the op at its start
        consumer = _consumers(run, rank)
        late = ok & ~in_own & (consumer >= 0)
        rows = consumer[late]
        wait_from = np.maximum(steps.begin[rows], p2p.post[late])
        inside = (done[late] >= steps.begin[rows]) & ((steps.end[rows] == OPEN) | (done[late] <= steps.end[rows]))
        w = np.where(inside, np.maximum(done[late] - wait_from, 0), 0)
        np.add.at(waited, rows, w)
        on_main = steps.thread[rows] == MAIN_THREAD
        np.add.at(busy, op_it[late][on_main], -w[on_main].astype(np.float64))
        np.add.at(wait, op_it[late][on_main], w[on_main].astype(np.float64))
        hidden_from = np.maximum(wait_from, partner[late])
        np.add.at(exposed, op_it[late], np.where(inside, np.maximum(done[late] - hidden_from, 0), 0).astype(np.float64))
        # overlap mode, sends: drained after the rank's last step of the iteration
        last_end = np.zeros(n, np.int64)
        np.maximum.at(last_end, it_idx[ended], end[ended])
        drained = ok & ~in_own & (consumer < 0) & (done > last_end[op_it])
        drain_from = np.maximum(last_end[op_it], p2p.post)
        drain = np.where(drained, np.maximum(done - drain_from, 0), 0)
        drain_per_it = np.zeros(n, np.int64)
        np.maximum.at(drain_per_it, op_it, drain)
        wait += drain_per_it
        np.add.at(exposed, op_it, np.where(drained, np.maximum(done - np.maximum(drain_from, partner), 0), 0).astype(np.float64))
        overlap = bool((ok & ~in_own).any())
    present = np.zeros(n, bool)
    present[np.searchsorted(its, rank.iterations.it)] = True
    nan = np.where(present, 0.0, np.nan)
    # per-stage costs from leaf compute rows (any thread), without their input waits
    leaf_kind = catalog.kind[steps.code]
    leaf_stage = catalog.stage[steps.code]
    leaf_ok = IS_COMPUTE[leaf_kind] & (leaf_stage >= 0) & (steps.end != OPEN)
    leaf_dur = np.maximum((steps.end - steps.begin).astype(np.int64) - waited, 0)
    standalone = np.zeros(len(steps), bool)
    standalone[top] = True
    costs = {}
    for sub, suffix in ((standalone, ""), (~standalone, OVERLAPPED)):
        sel = leaf_ok & sub
        if not sel.any():
            continue
        key_kind, key_stage, values = leaf_kind[sel], leaf_stage[sel], leaf_dur[sel]
        order = np.lexsort((key_kind, key_stage))
        key_kind, key_stage, values = key_kind[order], key_stage[order], values[order]
        cuts = np.flatnonzero((key_kind[1:] != key_kind[:-1]) | (key_stage[1:] != key_stage[:-1])) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(values)]):
            costs[(int(key_stage[lo]), KINDS[int(key_kind[lo])].value + suffix)] = values[lo:hi]
    return RankIterations(busy + nan, wait + nan, exposed + nan, blocking + nan), costs, overlap


_CONSUMES = {  # recv kind -> the compute kinds that consume its message (same stage, micro-batch)
    "RECV_F": ("F",),
    "RECV_B": ("B", "I"),
}


def _consumers(run: Run, rank: RankTimeline) -> np.ndarray:
    """Per P2P row, the step row (any thread) that consumes a received message: F for a
    RECV_F, B or I for a RECV_B, same stage, micro-batch and iteration (-1: none)."""
    catalog, steps, p2p = run.catalog, rank.steps, rank.p2p
    out = np.full(len(p2p), -1, np.int64)
    if not len(p2p) or not len(steps):
        return out
    kinds = catalog.kind[steps.code]
    fwd = kinds == KIND_CODE[StepKind.F]
    bwd = (kinds == KIND_CODE[StepKind.B]) | (kinds == KIND_CODE[StepKind.I])
    rows = np.flatnonzero(fwd | bwd)
    if not len(rows):
        return out
    stage, mb = catalog.stage[steps.code[rows]].astype(np.int64), catalog.microbatch[steps.code[rows]].astype(np.int64)
    it = steps.it[rows].astype(np.int64)
    key = ((it * 65536 + stage) * 1048576 + mb) * 2 + bwd[rows]
    order = np.argsort(key, kind="stable")
    key, rows = key[order], rows[order]
    rk = catalog.kind[p2p.code]
    recv_f, recv_b = rk == KIND_CODE[StepKind.RECV_F], rk == KIND_CODE[StepKind.RECV_B]
    want = recv_f | recv_b
    p_stage = catalog.stage[p2p.code].astype(np.int64)
    p_mb = catalog.microbatch[p2p.code].astype(np.int64)
    p_key = ((p2p.it.astype(np.int64) * 65536 + p_stage) * 1048576 + p_mb) * 2 + recv_b
    idx = np.clip(np.searchsorted(key, p_key), 0, len(key) - 1)
    hit = want & (key[idx] == p_key)
    out[hit] = rows[idx[hit]]
    return out


def _partner_post(run: Run, rank: RankTimeline) -> np.ndarray:
    """Per P2P row, when the matched op on the peer was posted (-1 when unmatched)."""
    p = rank.p2p
    out = np.full(len(p), -1, np.int64)
    for peer in np.unique(p.match_rank[p.match_rank >= 0]):
        sel = p.match_rank == peer
        out[sel] = run.ranks[int(peer)].p2p.post[p.match_index[sel]]
    return out


def ideal_timeline(run: Run, costs: dict[tuple[int, str], float], *, override: dict[tuple[int, str], float] | None = None) -> dict[str, Any]:
    """The simulator's timeline for this run's plan with these per-stage costs (ns)."""
    if run.plan is None or not costs:
        return {"available": False, "reason": "no plan" if run.plan is None else "no measured step"}
    try:
        from pipetrace.schedule.simulate import Costs, simulate
    except ImportError:  # pragma: no cover - the simulator ships with pipetrace
        return {"available": False, "reason": "simulator unavailable"}
    per_stage = dict(costs)
    if override:
        per_stage.update(override)
    by_kind = {}
    for kind in ("F", "B", "I", "W"):
        values = [c for (s, k), c in per_stage.items() if k == kind]
        by_kind[kind] = float(np.mean(values)) if values else 0.0
    try:
        result = simulate(run.plan, Costs(F=by_kind["F"], B=by_kind["B"], I=by_kind["I"], W=by_kind["W"],
                                          per_stage=per_stage), semantics="eager")  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - a plan the simulator cannot run is reported, not fatal
        return {"available": False, "reason": f"simulation failed: {exc}"}
    return {
        "available": True,
        "makespan_ns": float(result.makespan),
        "bubble_ratio": _finite(result.bubble_ratio),
        "idle_fraction": float(result.idle_fraction),
        "per_rank_bubble_ratio": [_finite(r.bubble_ratio) for r in result.per_rank],
    }


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None
