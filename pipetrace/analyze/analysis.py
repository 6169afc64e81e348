"""Run every analyzer on one `Run`: findings plus metrics, as plain data.

from pipetrace.analyze.load import load_run
from pipetrace.analyze.analysis import analyze
result = analyze(load_run("runs/demo"))
result.findings            # sorted, most severe first
result.to_json()           # the documented structure (docs/analyze.md)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipetrace import __version__
from pipetrace.analyze.critical import critical_path
from pipetrace.analyze.deadlock import find_hangs
from pipetrace.analyze.divergence import find_divergence
from pipetrace.analyze.failures import find_failures
from pipetrace.analyze.findings import DEADLOCK, ERROR, RANK_STALLED, Finding, counts, sort_findings
from pipetrace.analyze.messages import find_message_problems
from pipetrace.analyze.metrics import OVERLAPPED, Metrics, compute_metrics, reduce_groups
from pipetrace.analyze.model import Run
from pipetrace.analyze.performance import find_exposed_comm, find_stragglers
from pipetrace.gc_pause import gc_paused

ANALYSIS_FORMAT = "pipetrace-analysis"
ANALYSIS_VERSION = 1


@dataclass
class Analysis:
    run: Run
    findings: list[Finding]
    metrics: Metrics
    critical: dict[str, Any] | None

    @property
    def has_errors(self) -> bool:
        return any(f.severity == ERROR for f in self.findings)

    def to_json(self, *, segments: bool = True) -> dict[str, Any]:
        return {
            "format": ANALYSIS_FORMAT,
            "version": ANALYSIS_VERSION,
            "pipetrace_version": __version__,
            "run": run_summary(self.run),
            "input_problems": [p.to_json() for p in self.run.problems],
            "ranks": [rank_json(r) for r in self.run.ranks],
            "counts": counts(self.findings),
            "findings": [f.to_json() for f in self.findings],
            "metrics": metrics_json(self.run, self.metrics, self.critical, segments=segments),
        }


@gc_paused()  # the analyzers make many small acyclic objects: see gc_paused
def analyze(run: Run) -> Analysis:
    metrics = compute_metrics(run)
    findings: list[Finding] = find_hangs(run)
    hung = {r for f in findings if f.kind in (DEADLOCK, RANK_STALLED) for r in f.ranks}
    findings += find_failures(run, hung)
    findings += find_message_problems(run)
    findings += find_divergence(run)
    findings += find_stragglers(run, metrics)
    findings += find_exposed_comm(run, metrics)
    done = np.flatnonzero(metrics.complete)
    which = (
        metrics.iterations[int(done[-1])]
        if len(done)
        else (metrics.iterations[-1] if metrics.iterations else None)
    )
    critical = critical_path(run, which) if which is not None else None
    return Analysis(run, sort_findings(findings), metrics, critical)


def run_summary(run: Run) -> dict[str, Any]:
    plan = run.plan
    return {
        "path": str(run.path),
        "schedule": run.meta.get("schedule"),
        "world_size": run.world_size,
        "num_stages": plan.num_stages if plan else None,
        "num_microbatches": run.num_microbatches,
        "framework": run.meta.get("framework"),
        "framework_version": run.meta.get("framework_version"),
        "pipetrace_version": run.meta.get("pipetrace_version"),
        "p2p": run.p2p_mode,
        "iterations": len(run.iterations()),
        "events": run.num_events,
        "t0_ns": run.t0_ns,
    }


def rank_json(rank) -> dict[str, Any]:
    st = rank.status
    return {
        "rank": rank.rank,
        "state": st.state,
        "detail": st.detail,
        "last_step": st.last_step,
        "last_iteration": st.last_iteration,
        "error": st.error,
        "events": rank.events,
    }


_STATS = ("mean_ns", "p50_ns", "p95_ns", "min_ns", "max_ns")


def _per_group(groups: list[np.ndarray], reduce: Callable[[np.ndarray], np.ndarray]) -> list[Any]:
    """`reduce_groups` over each group's finite values; None for a group without any. A big
    run has thousands of groups (ranks, stages): one numpy call each would cost more."""
    groups = [v[np.isfinite(v)] if v.dtype.kind == "f" else v for v in groups]
    filled = [i for i, v in enumerate(groups) if len(v)]
    out: list = [None] * len(groups)
    for i, value in zip(filled, reduce_groups([groups[i] for i in filled], reduce).tolist()):
        out[i] = value
    return out


def _stats(groups: list[np.ndarray]) -> list[dict[str, float | None]]:
    """count, mean, median, 95th percentile, min and max of each group's finite values."""
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
    return [
        {"count": int(row[0]), **dict(zip(_STATS, row[1:]))}
        if row is not None
        else {"count": 0, **dict.fromkeys(_STATS)}
        for row in found
    ]


def _means(groups: list[np.ndarray]) -> list[float | None]:
    """The mean of each group's finite values (None without any)."""
    return _per_group(groups, lambda rows: rows.mean(axis=1))  # type: ignore[return-value]


def metrics_json(
    run: Run, m: Metrics, critical: dict[str, Any] | None, *, segments: bool = True
) -> dict[str, Any]:
    steady = m.steady()
    times = m.iteration_time
    iteration = float(np.mean(times[steady])) if len(steady) else None
    per_rank = sorted(m.per_rank.items())

    def steady_means(field: str) -> list[float | None]:
        return (
            _means([getattr(r, field)[steady] for _, r in per_rank])
            if len(steady)
            else [None] * len(per_rank)
        )

    ranks = []
    busy_total = bubble_total = 0.0
    means = zip(
        *(steady_means(field) for field in ("busy", "p2p_wait", "exposed", "blocking_transfer"))
    )
    for (rank, _), (busy, wait, exposed, blocking) in zip(per_rank, means):
        bubble = (iteration - busy) if iteration is not None and busy is not None else None
        if busy is not None and bubble is not None:
            busy_total += busy
            bubble_total += bubble
        ranks.append(
            {
                "rank": rank,
                "busy_ns": busy,
                "p2p_wait_ns": wait,
                "bubble_ns": bubble,
                "bubble_ratio": (bubble / busy) if busy and bubble is not None else None,
                "exposed_comm_ns": exposed,
                "blocking_transfer_ns": blocking,
            }
        )
    ideal = dict(m.ideal)
    measured_ratio = bubble_total / busy_total if busy_total else None
    stage_costs = sorted(m.stage_costs.items())
    stage_rows = [
        {
            "stage": s,
            "kind": k.removesuffix(OVERLAPPED),
            "overlapped": k.endswith(OVERLAPPED),
            **stats,
        }
        for ((s, k), _), stats in zip(stage_costs, _stats([v for _, v in stage_costs]))
    ]
    cp = None
    if critical is not None:
        cp = dict(critical)
        if not segments:
            cp.pop("segments", None)
    return {
        "iterations": [
            {
                "iteration": it,
                "start_ns": int(m.start_ns[i]),
                "end_ns": int(m.end_ns[i]),
                "time_ns": int(times[i]),
                "complete": bool(m.complete[i]),
            }
            for i, it in enumerate(m.iterations)
        ],
        "iteration_time": {
            **_stats([times[np.flatnonzero(m.complete)].astype(np.float64)])[0],
            "steady_mean_ns": iteration,
            "steady_iterations": [m.iterations[i] for i in steady],
        },
        "ranks": ranks,
        "bubble": {
            "measured_ratio": measured_ratio,
            "ideal_ratio": ideal.get("bubble_ratio"),
            "ideal_makespan_ns": ideal.get("makespan_ns"),
            "measured_iteration_ns": iteration,
            "ideal": ideal,
        },
        "overlap_mode": m.overlap_mode,
        "stages": stage_rows,
        "critical_path": cp,
        "clocks": {
            **run.clock_quality,
            "ranks": [{"rank": r.rank, **r.clock.to_json()} for r in run.ranks],
        },
    }
