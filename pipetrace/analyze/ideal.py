"""The ideal timeline: this run's plan simulated with its measured per-stage step costs.

It is computed once, in `pipetrace.analyze.metrics.compute_metrics`, and every view reads it
from there: the bubble metric compares with it, the straggler finding re-runs it with one
stage at its peers' speed, and the TUI draws its steps as the planned lanes (``simulation``)
instead of simulating the plan a second time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipetrace.analyze.model import LazyField
from pipetrace.schedule.ir import Plan
from pipetrace.schedule.simulate import Costs, SimResult, simulate


@dataclass
class IdealTimeline:
    """The simulated run, or why there is none (``reason`` is set exactly when unavailable).

    ``reason`` is the short form the JSON carries; ``explanation`` says the same to a person
    (the TUI shows it where the planned lanes would be)."""

    reason: str | None = None
    explanation: str = ""
    makespan_ns: float | None = None
    bubble_ratio: float | None = None
    idle_fraction: float | None = None
    per_rank_bubble_ratio: list[float | None] = field(default_factory=list)
    rows: list[PlannedRow] = field(default_factory=list)
    """Per rank of the plan, its simulated steps' places and times: what a view needs to
    place and describe the planned steps without reading the simulation (which a kept
    analysis makes again, `kept_analysis`)."""
    simulation: SimResult | None = LazyField(None)  # type: ignore[assignment]
    """A kept analysis's is simulated again when first read (`kept_analysis`)."""

    @property
    def available(self) -> bool:
        return self.reason is None

    def to_json(self) -> dict[str, Any]:
        if not self.available:
            return {"available": False, "reason": self.reason}
        return {
            "available": True,
            "makespan_ns": self.makespan_ns,
            "bubble_ratio": self.bubble_ratio,
            "idle_fraction": self.idle_fraction,
            "per_rank_bubble_ratio": self.per_rank_bubble_ratio,
        }


def ideal_timeline(
    plan: Plan | None,
    costs: dict[tuple[int, str], float],
    *,
    override: dict[tuple[int, str], float] | None = None,
) -> IdealTimeline:
    """The simulator's timeline for ``plan`` with these per-stage costs (ns), free
    communication and eager sends; ``override`` replaces some stages' costs (what-if)."""
    if plan is None:
        return IdealTimeline("no plan", "meta.json has no readable plan")
    if not costs:
        return IdealTimeline(
            "no measured step", "no compute step finished, so there are no costs to simulate with"
        )
    per_stage = {**costs, **(override or {})}
    by_kind = {kind: _mean([c for (_, k), c in per_stage.items() if k == kind]) for kind in "FBIW"}
    try:
        result = simulate(plan, Costs(**by_kind, per_stage=per_stage), semantics="eager")
    except Exception as exc:  # a plan the simulator rejects: the run is still analyzed
        return IdealTimeline(f"simulation failed: {exc}", f"the plan cannot be simulated: {exc}")
    return IdealTimeline(
        makespan_ns=float(result.makespan),
        bubble_ratio=_finite(result.bubble_ratio),
        idle_fraction=float(result.idle_fraction),
        per_rank_bubble_ratio=[_finite(r.bubble_ratio) for r in result.per_rank],
        rows=[_planned_row(result, row) for row in range(result.plan.num_ranks)],
        simulation=result,
    )


@dataclass(frozen=True)
class PlannedRow:
    """One simulated rank's steps: each one's position in the rank's plan without bubbles
    (what recorded steps carry), planned start and end from the iteration start (ns)."""

    pos: np.ndarray
    start: np.ndarray
    end: np.ndarray


def _planned_row(result: SimResult, row: int) -> PlannedRow:
    _, positions, start, end = result.rank_steps(row)
    plan = result.plan.ranks[row]
    at = np.asarray(positions, np.int64).reshape(-1)
    if plan:
        nonbubble = np.cumsum([s is not None for s in plan]) - 1
        inside = at < len(nonbubble)
        at = np.where(inside, nonbubble[np.minimum(at, len(nonbubble) - 1)], at)
    return PlannedRow(at, np.array(start, np.float64), np.array(end, np.float64))


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None
