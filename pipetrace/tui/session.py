"""Everything the TUI shows about one run, built off the UI thread (no UI imports).

    session = open_session("runs/demo", progress=lambda phase, done, total: ...)

Loading is the run model's (`load_run`), findings, metrics and the ideal timeline are the
analyzers' (`analyze`, read from `Session.analysis`); this module only adds what a timeline
needs on top: the lanes index, the planned lanes, and each finding's steps resolved to
timeline items.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipetrace.analyze.analysis import Analysis, analyze_cached
from pipetrace.analyze.findings import Finding
from pipetrace.analyze.load import load_run
from pipetrace.analyze.model import Run
from pipetrace.analyze.reader import TraceFormatError
from pipetrace.analyze.source import RunPaths, RunSource
from pipetrace.tui.lanes import STEPS
from pipetrace.tui.plan_lane import PlannedRun, planned_run
from pipetrace.tui.timeline_index import TimelineIndex

Progress = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: phase is "reading", "analyzing" or "indexing"."""


@dataclass
class FindingView:
    """A finding with the timeline items it points at."""

    finding: Finding
    items: list[tuple[int, int]]  # (lane, item) of every step involved, P2P ops included
    focus: tuple[int, int] | None  # where the cursor goes: the first step
    window: tuple[int, int] | None  # time range to show (ns)


@dataclass
class Session:
    path: Path
    run: Run
    analysis: Analysis
    index: TimelineIndex
    planned: PlannedRun | None
    plan_note: str  # why there is no planned timeline ("" when there is one)
    findings: list[FindingView]

    @property
    def title(self) -> str:
        run = self.run
        mb = run.num_microbatches
        return (
            f"{self.path.name} · {run.schedule_name} · {run.world_size} ranks"
            + (f" · {mb} mb" if mb is not None else "")
            + f" · {len(run.iterations())} it · {run.num_events:,} events"
        )


def open_session(
    path: RunPaths | RunSource,
    *,
    progress: Progress | None = None,
    workers: int | None = None,
    **load: Any,
) -> Session:
    """Load, analyze and index a run (one directory or several, as `load_run` takes);
    raises TraceFormatError when unusable. ``load``: more of `load_run`'s options
    (``cache``, ``select``)."""
    report = progress or (lambda phase, done, total: None)
    run = load_run(
        path, progress=lambda done, total: report("reading", done, total), workers=workers, **load
    )
    if not any(rank.events for rank in run.ranks):
        raise TraceFormatError(f"{run.path}: nothing to show: no rank log holds an event")
    report("analyzing", 0, 1)
    analysis = analyze_cached(run)
    report("indexing", 0, 1)
    planned = planned_run(run, analysis.metrics, analysis.summary.bubble.ideal)
    note = planned if isinstance(planned, str) else ""
    planned_ok = planned if not isinstance(planned, str) else None
    index = TimelineIndex(run, planned=planned_ok)
    views = [resolve_finding(index, f) for f in analysis.findings]
    report("indexing", 1, 1)
    return Session(run.path, run, analysis, index, planned_ok, note, views)


def resolve_finding(index: TimelineIndex, finding: Finding) -> FindingView:
    """Map a finding's step references to timeline items, plus the P2P ops those steps
    posted (for a hang: the ops that never completed), so that all can be highlighted."""
    items: list[tuple[int, int]] = []
    for ref in finding.steps:
        hit = index.resolve(ref.rank, ref.step, ref.iteration, ref.time_ns)
        if hit is None:
            continue
        items.append(hit)
        comm = index.lane_of(ref.rank, "comm")
        if comm is None:
            continue
        for _, row in index.p2p_rows(*hit):
            item = index.lanes[comm].item_of_row(row)
            if item is not None:
                items.append((comm, item))
    # a rank the finding names without pointing at one of its steps (e.g. the end of a
    # stalled chain: the rank still computing) is shown where it is stuck: its open steps
    pointed = {index.lanes[lane].rank for lane, _ in items}
    for rank in dict.fromkeys(finding.ranks):
        if rank in pointed or rank not in index.lanes_of_rank:
            continue
        for lane_id in index.lanes_of_rank[rank]:
            if index.specs[lane_id].source == STEPS:
                lane = index.lanes[lane_id]
                items.extend((lane_id, int(i)) for i in np.flatnonzero(lane.open))
    items = list(dict.fromkeys(items))
    # an open span runs to the end of the log (a hang: maybe minutes); its begin is what matters
    times = [
        (
            int(index.lanes[lane].begin[i]),
            int(
                index.lanes[lane].begin[i]
                if index.lanes[lane].open[i]
                else index.lanes[lane].end[i]
            ),
        )
        for lane, i in items
    ]
    if not times:
        times = [
            (int(ref.time_ns), int(ref.time_ns)) for ref in finding.steps if ref.time_ns is not None
        ]
    if not times and finding.time_ns is not None:
        times = [(int(finding.time_ns[0]), int(finding.time_ns[1]))]
    window = (
        _window(index, times, any(bool(index.lanes[lane].open[i]) for lane, i in items))
        if times
        else None
    )
    focus = items[0] if items else None
    return FindingView(finding, items, focus, window)


def _window(index: TimelineIndex, times: list[tuple[int, int]], hung: bool) -> tuple[int, int]:
    """The time range to show for a finding: its steps, with at least a typical iteration of
    context. For a hang (a step never ended) the context is what led to it, before."""
    lo, hi = min(t[0] for t in times), max(t[1] for t in times)
    durations = index.iter_end - index.iter_begin
    complete = durations[durations > 0]
    least = float(np.median(complete)) if len(complete) else 0.0
    if hung:
        least = max(least if len(index.iterations) > 1 else 0.0, (hi - index.t_min) * 1.25)
        width = max(hi - lo, least)
        return int(max(hi - width, index.t_min)), int(hi + width * 0.25)
    width = max(hi - lo, least / 2)
    mid = (lo + hi) / 2
    return int(mid - width / 2), int(mid + width / 2)
