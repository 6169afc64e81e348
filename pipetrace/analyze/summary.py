"""The metrics summary: per-iteration `Metrics` reduced to what every view shows.

Computed once by `pipetrace.analyze.analysis.analyze`; the text report, the JSON, the diff
and the TUI's stats panel all read these records, so a number (the bubble ratio, a stage's
p95) has one definition. Means are over the steady iterations (`Metrics.steady`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipetrace.analyze.critical import CriticalPath
from pipetrace.analyze.device_times import DeviceTiming
from pipetrace.analyze.ideal import IdealTimeline
from pipetrace.analyze.memory import MemoryReport
from pipetrace.analyze.metrics import OVERLAPPED, Metrics, reduce_groups
from pipetrace.analyze.model import Run
from pipetrace.records import JsonRecord, record_json


@dataclass
class Stats(JsonRecord):
    """Count, mean, median, 95th percentile, min and max of some durations (ns; None
    without any)."""

    count: int
    mean_ns: float | None = None
    p50_ns: float | None = None
    p95_ns: float | None = None
    min_ns: float | None = None
    max_ns: float | None = None


@dataclass
class IterationSpan(JsonRecord):
    iteration: int
    start_ns: int
    end_ns: int | None  # None: it never completed (no end to measure to)
    time_ns: int | None
    complete: bool  # every present rank began and ended it


@dataclass
class IterationTime:
    """Iteration time over the complete iterations, and its mean over the steady ones."""

    stats: Stats
    steady_mean_ns: float | None
    steady_iterations: list[int]

    def to_json(self) -> dict[str, Any]:
        return {
            **self.stats.to_json(),
            "steady_mean_ns": self.steady_mean_ns,
            "steady_iterations": self.steady_iterations,
        }


@dataclass
class RankBubble(JsonRecord):
    """One rank's mean time per steady iteration; ``bubble_ratio`` = bubble / busy."""

    rank: int
    busy_ns: float | None
    p2p_wait_ns: float | None
    bubble_ns: float | None
    bubble_ratio: float | None
    exposed_comm_ns: float | None
    blocking_transfer_ns: float | None


@dataclass
class StageCost:
    """The cost of one stage's steps of one kind; ``overlapped``: run inside an overlapped
    pair (OVERLAP_F_B or OVERLAP_B_F)."""

    stage: int
    kind: str
    overlapped: bool
    stats: Stats

    def to_json(self) -> dict[str, Any]:
        out = record_json(self)
        out.update(out.pop("stats").to_json())  # flat: the stats beside the stage and kind
        return out


@dataclass
class Bubble:
    """The measured bubble ratio (all ranks' bubble / busy) next to the ideal one."""

    measured_ratio: float | None
    measured_iteration_ns: float | None
    ideal: IdealTimeline

    def to_json(self) -> dict[str, Any]:
        return {
            "measured_ratio": self.measured_ratio,
            "ideal_ratio": self.ideal.bubble_ratio,
            "ideal_makespan_ns": self.ideal.makespan_ns,
            "measured_iteration_ns": self.measured_iteration_ns,
            "ideal": self.ideal.to_json(),
        }


@dataclass
class MetricsSummary:
    """Everything ``metrics`` holds in `pipetrace analyze --json` (docs/analyze.md)."""

    iterations: list[IterationSpan]
    iteration_time: IterationTime
    ranks: list[RankBubble]
    bubble: Bubble
    overlap_mode: bool
    stages: list[StageCost]
    critical_path: CriticalPath | None
    clocks: dict[str, Any]  # the run's clock quality, plus each rank's `ClockInfo`
    timing: DeviceTiming  # host or device times, launch/device-bound steps, stuck device work
    memory: MemoryReport | None = None  # peaks from the memory samples; None without any

    def to_json(self, *, segments: bool = True) -> dict[str, Any]:
        """``segments=False`` leaves the critical path's segments out (they can be many)."""
        cp = self.critical_path
        return {
            "iterations": [i.to_json() for i in self.iterations],
            "iteration_time": self.iteration_time.to_json(),
            "ranks": [r.to_json() for r in self.ranks],
            "bubble": self.bubble.to_json(),
            "overlap_mode": self.overlap_mode,
            "stages": [s.to_json() for s in self.stages],
            "critical_path": cp.to_json(segments=segments) if cp is not None else None,
            "clocks": self.clocks,
            "timing": self.timing.to_json(),
            "memory": self.memory.to_json() if self.memory is not None else None,
        }


def summarize(
    run: Run,
    m: Metrics,
    ideal: IdealTimeline,
    critical: CriticalPath | None,
    timing: DeviceTiming,
    memory: MemoryReport | None = None,
) -> MetricsSummary:
    steady = m.steady()
    times = m.iteration_time
    iteration = float(np.mean(times[steady])) if len(steady) else None
    ranks = _rank_bubbles(m, steady, iteration)
    counted = [r for r in ranks if r.busy_ns is not None and r.bubble_ns is not None]
    busy_total = sum(r.busy_ns for r in counted)  # type: ignore[misc]
    bubble_total = sum(r.bubble_ns for r in counted)  # type: ignore[misc]
    return MetricsSummary(
        iterations=[
            IterationSpan(it, int(m.start_ns[i]), int(m.end_ns[i]), int(times[i]), True)
            if m.complete[i]
            else IterationSpan(it, int(m.start_ns[i]), None, None, False)
            for i, it in enumerate(m.iterations)
        ],
        iteration_time=IterationTime(
            _stats([times[np.flatnonzero(m.complete)].astype(np.float64)])[0],
            iteration,
            [m.iterations[i] for i in steady],
        ),
        ranks=ranks,
        bubble=Bubble(bubble_total / busy_total if busy_total else None, iteration, ideal),
        overlap_mode=m.overlap_mode,
        stages=_stage_costs(m),
        critical_path=critical,
        clocks={
            **run.clock_quality,
            "ranks": [{"rank": r.rank, **r.clock.to_json()} for r in run.ranks],
        },
        timing=timing,
        memory=memory,
    )


def _rank_bubbles(m: Metrics, steady: np.ndarray, iteration: float | None) -> list[RankBubble]:
    """Each rank's means over the steady iterations; bubble = iteration time - busy."""
    per_rank = sorted(m.per_rank.items())
    fields = ("busy", "p2p_wait", "exposed", "blocking_transfer")
    means = zip(
        *(
            _means([getattr(r, name)[steady] for _, r in per_rank])
            if len(steady)
            else [None] * len(per_rank)
            for name in fields
        )
    )
    out = []
    for (rank, _), (busy, wait, exposed, blocking) in zip(per_rank, means):
        bubble = (iteration - busy) if iteration is not None and busy is not None else None
        ratio = (bubble / busy) if busy and bubble is not None else None
        out.append(RankBubble(rank, busy, wait, bubble, ratio, exposed, blocking))
    return out


def _stage_costs(m: Metrics) -> list[StageCost]:
    costs = sorted(m.stage_costs.items())
    return [
        StageCost(stage, kind.removesuffix(OVERLAPPED), kind.endswith(OVERLAPPED), stats)
        for ((stage, kind), _), stats in zip(costs, _stats([v for _, v in costs]))
    ]


def _per_group(groups: list[np.ndarray], reduce: Callable[[np.ndarray], np.ndarray]) -> list[Any]:
    """`reduce_groups` over each group's finite values; None for a group without any. A big
    run has thousands of groups (ranks, stages): one numpy call each would cost more."""
    groups = [v[np.isfinite(v)] if v.dtype.kind == "f" else v for v in groups]
    filled = [i for i, v in enumerate(groups) if len(v)]
    out: list = [None] * len(groups)
    for i, value in zip(filled, reduce_groups([groups[i] for i in filled], reduce).tolist()):
        out[i] = value
    return out


def _stats(groups: list[np.ndarray]) -> list[Stats]:
    """`Stats` of each group's finite values."""
    found = _per_group(
        groups,
        lambda rows: np.column_stack(
            (
                np.full(len(rows), rows.shape[1]),
                rows.mean(axis=1),
                *np.percentile(rows, [50, 95], axis=1),
                rows.min(axis=1),
                rows.max(axis=1),
            )
        ),
    )
    return [Stats(int(row[0]), *row[1:]) if row is not None else Stats(0) for row in found]


def _means(groups: list[np.ndarray]) -> list[float | None]:
    """The mean of each group's finite values (None without any)."""
    return _per_group(groups, lambda rows: rows.mean(axis=1))
