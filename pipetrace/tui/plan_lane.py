"""The planned timeline ("plan vs actual"): the simulator's run of the plan, as timeline lanes.

The plan is simulated once with this run's measured mean per-stage step costs and free
communication (as `pipetrace.analyze.metrics.ideal_timeline` does), then repeated at the
start of every iteration, so each rank's planned order sits right under what it ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetrace.analyze.metrics import Metrics
from pipetrace.analyze.model import Run
from pipetrace.tui.lanes import PLAN, Lane, category_of_kind


@dataclass
class PlannedRun:
    lanes: dict[int, Lane]  # rank -> its plan lane
    makespan_ns: float  # one iteration as planned
    # rank -> (plan position without bubbles) -> (planned start, end) from the iteration start
    offsets: dict[int, dict[int, tuple[float, float]]]


def planned_run(run: Run, metrics: Metrics | None) -> PlannedRun | str:
    """The planned lanes, or a one-line reason why there are none."""
    if run.plan is None:
        return "meta.json has no readable plan"
    costs = metrics.mean_costs() if metrics is not None else {}
    if not costs:
        return "no compute step finished, so there are no costs to simulate with"
    from pipetrace.schedule.simulate import Costs, simulate

    by_kind = {
        k: float(np.mean([c for (_, kk), c in costs.items() if kk == k] or [0.0])) for k in "FBIW"
    }
    try:
        result = simulate(
            run.plan,
            Costs(
                F=by_kind["F"],
                B=by_kind["B"],
                I=by_kind["I"],
                W=by_kind["W"],
                per_stage=dict(costs),
            ),
            semantics="eager",
        )
    except Exception as exc:
        return f"the plan cannot be simulated: {exc}"
    starts = (
        np.asarray(metrics.start_ns, np.int64)
        if metrics is not None and len(metrics.start_ns)
        else np.zeros(1, np.int64)
    )
    its = (
        np.asarray(metrics.iterations, np.int32)
        if metrics is not None and len(metrics.iterations)
        else np.zeros(1, np.int32)
    )
    per_rank: dict[int, list] = {}
    for s in result.timeline:
        per_rank.setdefault(s.rank, []).append(s)
    lanes, offsets = {}, {}
    for rank, sim in per_rank.items():
        row = result.plan.ranks[rank] if rank < result.plan.num_ranks else []
        nonbubble = (
            np.cumsum([step is not None for step in row]) - 1 if row else np.empty(0, np.int64)
        )
        pos = np.array(
            [
                int(nonbubble[s.position]) if s.position < len(nonbubble) else s.position
                for s in sim
            ],
            np.int64,
        )
        b = np.array([s.start for s in sim], np.float64)
        e = np.array([s.end for s in sim], np.float64)
        code = np.array([run.catalog.code(s.step_text) for s in sim], np.int32)
        cat = np.array([category_of_kind(s.kind) for s in sim], np.int8)
        offsets[rank] = {int(p): (float(x), float(y)) for p, x, y in zip(pos, b, e)}
        n, k = len(sim), len(starts)
        begin = (starts[:, None] + np.rint(b)[None, :]).astype(np.int64).ravel()
        end = (starts[:, None] + np.rint(e)[None, :]).astype(np.int64).ravel()
        order = np.argsort(begin, kind="stable")
        iter_b = starts
        iter_e = starts + int(round(result.makespan))
        lanes[rank] = Lane(
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
            iter_spans=(iter_b, iter_e),
        )
    return PlannedRun(lanes, float(result.makespan), offsets)
