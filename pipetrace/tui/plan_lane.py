"""The planned timeline ("plan vs actual"): the simulator's run of the plan, as timeline lanes.

The plan's simulation with this run's measured mean per-stage step costs and free
communication is the analysis's ideal timeline (`pipetrace.analyze.ideal`, not simulated
again here); it is repeated at the start of every iteration, so each rank's planned order
sits right under what it ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetrace.analyze.ideal import IdealTimeline
from pipetrace.analyze.metrics import Metrics
from pipetrace.analyze.model import Run
from pipetrace.schedule.simulate import SimStep
from pipetrace.tui.lanes import PLAN, Lane, category_of_kind


@dataclass
class PlannedRun:
    lanes: dict[int, Lane]  # rank -> its plan lane
    makespan_ns: float  # one iteration as planned
    # rank -> (plan position without bubbles) -> (planned start, end) from the iteration start
    offsets: dict[int, dict[int, tuple[float, float]]]


def planned_run(run: Run, metrics: Metrics, ideal: IdealTimeline) -> PlannedRun | str:
    """The planned lanes from the analysis's ideal timeline, or a one-line reason why there
    are none."""
    result = ideal.simulation
    if result is None:
        return ideal.explanation
    starts = (
        np.asarray(metrics.start_ns, np.int64) if len(metrics.start_ns) else np.zeros(1, np.int64)
    )
    its = np.asarray(metrics.iterations, np.int32) if metrics.iterations else np.zeros(1, np.int32)
    per_rank: dict[int, list[SimStep]] = {}
    for s in result.timeline:
        per_rank.setdefault(s.rank, []).append(s)
    if run.pipelines.several:  # every replica runs the plan: each global rank its row's
        row_of = run.pipelines.pipeline_rank
        per_rank = {g: per_rank[row_of(g)] for g in range(run.world_size) if row_of(g) in per_rank}
    lanes, offsets = {}, {}
    for rank, sim in per_rank.items():
        row = run.pipelines.pipeline_rank(rank)
        pos = _plan_positions(result.plan.ranks[row] if row < result.plan.num_ranks else [], sim)
        b = np.array([s.start for s in sim], np.float64)
        e = np.array([s.end for s in sim], np.float64)
        offsets[rank] = {int(p): (float(x), float(y)) for p, x, y in zip(pos, b, e)}
        lanes[rank] = _lane(run, rank, sim, pos, b, e, starts, its, result.makespan)
    return PlannedRun(lanes, float(result.makespan), offsets)


def _plan_positions(row: list, sim: list[SimStep]) -> np.ndarray:
    """Each simulated step's position in the rank's plan without bubbles (what the
    recorded steps carry)."""
    nonbubble = np.cumsum([step is not None for step in row]) - 1 if row else np.empty(0, np.int64)
    return np.array(
        [int(nonbubble[s.position]) if s.position < len(nonbubble) else s.position for s in sim],
        np.int64,
    )


def _lane(
    run: Run,
    rank: int,
    sim: list[SimStep],
    pos: np.ndarray,
    b: np.ndarray,
    e: np.ndarray,
    starts: np.ndarray,
    its: np.ndarray,
    makespan: float,
) -> Lane:
    """One rank's planned steps (offsets ``b``..``e``) repeated from every iteration start."""
    code = np.array([run.catalog.code(s.step) for s in sim], np.int32)
    cat = np.array([category_of_kind(s.kind) for s in sim], np.int8)
    n, k = len(sim), len(starts)
    begin = (starts[:, None] + np.rint(b)[None, :]).astype(np.int64).ravel()
    end = (starts[:, None] + np.rint(e)[None, :]).astype(np.int64).ravel()
    order = np.argsort(begin, kind="stable")
    return Lane(
        rank,
        PLAN,
        "plan",
        PLAN,
        np.tile(pos, k)[order],
        begin[order],
        end[order],
        np.zeros(n * k, bool),
        np.tile(code, k)[order],
        np.repeat(its, n)[order],
        np.tile(cat, k)[order],
        iter_spans=(starts, starts + int(np.rint(makespan))),
    )
