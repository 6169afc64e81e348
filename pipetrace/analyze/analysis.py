"""Run every analyzer on one `Run`, once: findings, metrics and their summary.

from pipetrace.analyze.load import load_run
from pipetrace.analyze.analysis import analyze_cached
result = analyze_cached(load_run("runs/demo"))   # analyze(run): always the analyzers
result.findings            # sorted, most severe first
result.summary             # typed metrics: bubble, stages, critical path, ideal timeline
result.to_json()           # the documented structure (docs/analyze.md)

Every view (report, JSON, diff, export, TUI) reads an `Analysis` (`analyze_cached`: an
unchanged run's is kept beside its cache entry); none recomputes a metric or re-runs the
simulator (a kept analysis simulates the plan again once, when its simulation is read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipetrace import __version__
from pipetrace.analyze.critical import critical_path
from pipetrace.analyze.deadlock import find_hangs
from pipetrace.analyze.device_hang import find_device_hangs
from pipetrace.analyze.device_times import device_timing, timed_run
from pipetrace.analyze.divergence import find_divergence
from pipetrace.analyze.endings import endings_kept
from pipetrace.analyze.failures import find_failures
from pipetrace.analyze.findings import (
    DEADLOCK,
    ERROR,
    RANK_STALLED,
    UNMATCHED_RECV,
    UNMATCHED_SEND,
    Finding,
    counts,
    sort_findings,
)
from pipetrace.analyze.ideal import IdealTimeline, ideal_timeline
from pipetrace.analyze.interrupts import find_interrupt
from pipetrace.analyze.losses import find_nonfinite_loss
from pipetrace.analyze.memory import memory_report
from pipetrace.analyze.messages import find_message_problems
from pipetrace.analyze.metrics import Metrics, compute_metrics
from pipetrace.analyze.model import Later, RankTimeline, Run
from pipetrace.analyze.pauses import find_recovered_stalls
from pipetrace.analyze.performance import find_exposed_comm, find_stragglers
from pipetrace.analyze.replicas import ReplicaSummary, replica_findings, replica_summary
from pipetrace.analyze.summary import MetricsSummary, summarize
from pipetrace.gc_pause import gc_paused

ANALYSIS_FORMAT = "pipetrace-analysis"
ANALYSIS_VERSION = 1


@dataclass
class Analysis:
    run: Run
    findings: list[Finding]
    metrics: Metrics  # per iteration, per rank
    summary: MetricsSummary  # what the views show, reduced from ``metrics``
    replicas: ReplicaSummary | None = None  # across replicas; None for one pipeline

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
            "ranks": [rank_json(r, self.run) for r in self.run.ranks],
            "counts": counts(self.findings),
            "findings": [f.to_json() for f in self.findings],
            "metrics": self.summary.to_json(segments=segments),
            **({} if self.replicas is None else {"replicas": self.replicas.to_json()}),
        }


@gc_paused()  # the analyzers make many small acyclic objects: see gc_paused
def analyze(run: Run) -> Analysis:
    """Hangs and failures are read from the host times (where a host thread waits); the
    performance analyzers from device times where the run has them (`timed_run`)."""
    timed = timed_run(run)
    metrics = compute_metrics(timed)
    ideal = _ideal(run, metrics)
    with endings_kept(run):
        findings: list[Finding] = find_hangs(run)
        hung = {r for f in findings if f.kind in (DEADLOCK, RANK_STALLED) for r in f.ranks}
        findings += find_failures(run, hung)
        findings += find_interrupt(run)
        findings += find_recovered_stalls(run)
    findings += _caveat_damage(run, find_message_problems(run) + find_divergence(run))
    findings += find_nonfinite_loss(run) + find_device_hangs(run)
    findings += find_stragglers(timed, metrics, ideal)
    findings += find_exposed_comm(timed, metrics)
    findings = replica_findings(run, findings)
    which = _path_iteration(metrics)
    critical = critical_path(timed, which) if which is not None else None
    if critical is not None:
        critical.complete = bool(metrics.complete[metrics.iterations.index(which)])
    summary = summarize(run, metrics, ideal, critical, device_timing(run), memory_report(run))
    return Analysis(run, sort_findings(findings), metrics, summary, replica_summary(run))


def _caveat_damage(run: Run, findings: list[Finding]) -> list[Finding]:
    """Findings read from the records of a rank whose log has input warnings (lines skipped as
    corrupt, ids that do not pair, a log cut short) say so: a lost or damaged record reads
    the same as a message that was never sent or a step run out of order."""
    warned = {
        p.rank for p in run.problems if p.rank is not None and p.severity == "warning" and p.damage
    }
    for f in findings:
        # an op without counterpart (ranks: its own rank, then the peer) lacks the peer's
        # record: only damage there reads the same
        missing = f.ranks[1:] if f.kind in (UNMATCHED_SEND, UNMATCHED_RECV) else f.ranks
        damaged = sorted(warned.intersection(missing))
        if damaged:
            f.cause += (
                f"; or damage in the log of rank(s) {', '.join(map(str, damaged))} (its input "
                "warnings): a lost record reads the same"
            )
    return findings


@gc_paused()
def analyze_cached(run: Run) -> Analysis:
    """The run's analysis: the one kept beside its run entry when there is one (`Run.entry`,
    `kept_analysis`), else the analyzers' (`analyze`), then kept. Every view that shows an
    analysis of a recorded run gets it here, so an unchanged run is analyzed once."""
    entry = run.entry
    kept = entry.analysis() if entry is not None else None
    if kept is not None:
        return _restored(run, *kept)
    result = analyze(run)
    if entry is not None:
        entry.keep_analysis((result.findings, result.metrics, result.summary, result.replicas))
    return result


def _restored(
    run: Run,
    findings: list[Finding],
    metrics: Metrics,
    summary: MetricsSummary,
    replicas: ReplicaSummary | None,
) -> Analysis:
    """A kept analysis given its run back; its ideal timeline's simulation (not kept) is
    made again when first read, as `analyze` made it."""
    ideal = summary.bubble.ideal
    if ideal.available:
        ideal.simulation = Later(lambda: _ideal(run, metrics).simulation)
    return Analysis(run, findings, metrics, summary, replicas)


def _ideal(run: Run, metrics: Metrics) -> IdealTimeline:
    """The plan simulated with the run's measured mean step costs."""
    return ideal_timeline(run.plan, metrics.mean_costs())


def _path_iteration(metrics: Metrics) -> int | None:
    """The iteration whose critical path is shown: the last complete one, else the last."""
    done = np.flatnonzero(metrics.complete)
    if len(done):
        return metrics.iterations[int(done[-1])]
    return metrics.iterations[-1] if metrics.iterations else None


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
        "directories": [str(d) for d in run.directories],
    }


def rank_json(rank: RankTimeline, run: Run) -> dict[str, Any]:
    """With several replicas also the rank's replica, pipeline rank and stages."""
    st = rank.status
    pipelines = run.pipelines
    where = (
        {
            "replica": pipelines.replica_of(rank.rank),
            "pipeline_rank": pipelines.pipeline_rank(rank.rank),
            "stages": run.stages_of(rank.rank),
        }
        if pipelines.several
        else {}
    )
    return {
        "rank": rank.rank,
        "state": st.state,
        "detail": st.detail,
        "last_step": st.last_step,
        "last_iteration": st.last_iteration,
        "error": st.error,
        "events": rank.events,
        **where,
    }
