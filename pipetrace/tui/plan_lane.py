"""The planned timeline ("plan vs actual"): the simulator's run of the plan, as timeline lanes.

The plan's simulation with this run's measured mean per-stage step costs and free
communication is the analysis's ideal timeline (`pipetrace.analyze.ideal`, not simulated
again here); it is repeated at the start of every iteration, so each rank's planned order
sits right under what it ran.

A rank's planned lane and offsets are built on first lookup (`LazyMap`): the plan lanes are
hidden until ``p`` and a big run has a thousand of them. What start-up needs of every rank
(how many items, the time range) is read from the simulator's per-rank lists directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from pipetrace.analyze.ideal import IdealTimeline, PlannedRow
from pipetrace.analyze.metrics import Metrics
from pipetrace.analyze.model import Run
from pipetrace.schedule.ir import format_step
from pipetrace.schedule.simulate import SimResult
from pipetrace.tui.lanes import PLAN, Lane, category_of_kind
from pipetrace.tui.lazy import LazyMap


@dataclass(frozen=True)
class _RowPlan:
    """One simulated rank's steps as arrays: plan position (without bubbles), planned start
    and end from the iteration start, catalog code and category."""

    pos: np.ndarray
    b: np.ndarray
    e: np.ndarray
    code: np.ndarray
    cat: np.ndarray


@dataclass
class PlannedRun:
    lanes: LazyMap[int, Lane]  # rank -> its plan lane
    makespan_ns: float  # one iteration as planned
    # rank -> (plan position without bubbles) -> (planned start, end) from the iteration start
    offsets: LazyMap[int, dict[int, tuple[float, float]]]
    extents: dict[int, tuple[int, int, int]]  # rank -> (items, first begin, last end)


def planned_run(run: Run, metrics: Metrics, ideal: IdealTimeline) -> PlannedRun | str:
    """The planned lanes from the analysis's ideal timeline, or a one-line reason why there
    are none."""
    if not ideal.available:
        return ideal.explanation
    starts = (
        np.asarray(metrics.start_ns, np.int64) if len(metrics.start_ns) else np.zeros(1, np.int64)
    )
    its = np.asarray(metrics.iterations, np.int32) if metrics.iterations else np.zeros(1, np.int32)
    rows = ideal.rows
    simulated = [row for row, planned in enumerate(rows) if len(planned.pos)]
    if run.pipelines.several:  # every replica runs the plan: each global rank its row's
        row_of = run.pipelines.pipeline_rank
        present = set(simulated)
        sim_row = {g: row_of(g) for g in range(run.world_size) if row_of(g) in present}
    else:
        sim_row = {rank: rank for rank in simulated}

    # the simulation itself is read only when a plan lane is first drawn (a kept analysis
    # simulates it again then: `kept_analysis`)
    @cache
    def row_plan(rank: int) -> _RowPlan:
        return _row_plan(run, ideal.simulation, sim_row[rank], rows[sim_row[rank]])

    def lane(rank: int) -> Lane:
        return _lane(rank, row_plan(rank), starts, its, ideal.makespan_ns)

    def offsets(rank: int) -> dict[int, tuple[float, float]]:
        p = rows[sim_row[rank]]
        return dict(zip(p.pos.tolist(), zip(p.start.tolist(), p.end.tolist())))

    extents = {rank: _extent(rows[row], starts) for rank, row in sim_row.items()}
    return PlannedRun(
        LazyMap(sim_row, lane), float(ideal.makespan_ns), LazyMap(sim_row, offsets), extents
    )


def _extent(row: PlannedRow, starts: np.ndarray) -> tuple[int, int, int]:
    """A plan lane's item count, first begin and last end, without building it (rounded
    as `_lane` rounds each item, so equal to its ``begin.min()`` and ``end.max()``)."""
    first = np.float64(starts.min()) + np.rint(row.start.min())
    last = np.float64(starts.max()) + np.rint(row.end.max())
    return len(row.pos) * len(starts), int(first), int(last)


def _row_plan(run: Run, result: SimResult, row: int, planned: PlannedRow) -> _RowPlan:
    """One simulated rank's steps: their places and times, and what each step is."""
    steps = result.rank_steps(row)[0]
    return _RowPlan(
        planned.pos,
        planned.start,
        planned.end,
        np.array([run.catalog.code(format_step(s)) for s in steps], np.int32),
        np.array([category_of_kind(s.kind.value) for s in steps], np.int8),
    )


def _lane(rank: int, plan: _RowPlan, starts: np.ndarray, its: np.ndarray, makespan: float) -> Lane:
    """One rank's planned steps (offsets ``b``..``e``) repeated from every iteration start."""
    n, k = len(plan.pos), len(starts)
    begin = (starts[:, None] + np.rint(plan.b)[None, :]).astype(np.int64).ravel()
    end = (starts[:, None] + np.rint(plan.e)[None, :]).astype(np.int64).ravel()
    order = np.argsort(begin, kind="stable")
    return Lane(
        rank,
        PLAN,
        "plan",
        PLAN,
        np.tile(plan.pos, k)[order],
        begin[order],
        end[order],
        np.zeros(n * k, bool),
        np.tile(plan.code, k)[order],
        np.repeat(its, n)[order],
        np.tile(plan.cat, k)[order],
        iter_spans=(starts, starts + int(np.rint(makespan))),
    )
