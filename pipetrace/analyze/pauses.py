"""stall_recovered: a watchdog recorded a stall, and the run went on.

A stall the run recovered from is no hang (the hang analyzers read the run's end), but a
rank that made no progress for seconds is worth a line: a process frozen or descheduled, a
slow file system or data loader, swapping. Stalls whose idle times overlap are one episode
(ranks of a pipeline stall together, each in its own iteration), told once, with where the
time went: first on the ranks that recorded no stall (a frozen process's watchdog is frozen
with it, and the others waited for it), their longest step then or, between steps, their
longest gap; else the longest step of any rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetrace import units
from pipetrace.analyze import findings as fk
from pipetrace.analyze.derive import top_level
from pipetrace.analyze.findings import Finding, StepRef
from pipetrace.analyze.model import OPEN, RankTimeline, Run
from pipetrace.recorder import format as fmt


@dataclass(frozen=True)
class _Stall:
    rank: int
    t: int  # when the watchdog recorded it
    idle_s: float  # how long the rank had made no progress then
    iteration: int

    @property
    def since(self) -> int:
        return self.t - int(self.idle_s * 1e9)


def find_recovered_stalls(run: Run) -> list[Finding]:
    """One finding per episode of overlapping stalls that the ranks made progress after."""
    stalls = sorted(_recovered(run), key=lambda s: s.since)
    episodes: list[list[_Stall]] = []
    for stall in stalls:
        if episodes and stall.since <= max(s.t for s in episodes[-1]):
            episodes[-1].append(stall)
        else:
            episodes.append([stall])
    return [_finding(run, episode) for episode in episodes]


def _recovered(run: Run) -> list[_Stall]:
    out = []
    for rank in run.present_ranks:
        progress = rank.last_progress()
        its = rank.iterations
        for stall in rank.events_of(fmt.STALL):
            running = np.flatnonzero(
                (its.begin <= stall.t) & ((its.end == OPEN) | (its.end >= stall.t))
            )
            if progress > stall.t and len(running):  # not `RankTimeline.final_stall`
                idle = stall.fields.get("idle_s")
                idle = float(idle) if isinstance(idle, int | float) and idle >= 0 else 0.0
                out.append(_Stall(rank.rank, stall.t, idle, int(its.it[running[-1]])))
    return out


@dataclass(frozen=True)
class _Where:
    """Where an episode's time went: a step that lasted, or a gap between a rank's steps."""

    rank: int
    step: str  # the step that lasted, or the one after the gap
    iteration: int | None
    begin: int
    duration: int
    gap: bool

    def said(self) -> str:
        if self.gap:
            return (
                f": rank {self.rank} made no progress between its steps for "
                f"{units.duration(self.duration)}, until {self.step}"
            )
        return (
            f": the longest step then was {self.step} on rank {self.rank}, "
            f"{units.duration(self.duration)}"
        )


def _finding(run: Run, stalls: list[_Stall]) -> Finding:
    ranks = sorted({s.rank for s in stalls})
    iterations = sorted({s.iteration for s in stalls})
    since, until = min(s.since for s in stalls), max(s.t for s in stalls)
    # where the time went is looked for on the stalled ranks' own pipelines: another
    # replica's ranks may be waiting outside any step (a data-parallel all-reduce), unseen
    replicas = {run.pipelines.replica_of(r) for r in ranks}
    quiet = [
        r
        for r in run.present_ranks
        if r.rank not in ranks and run.pipelines.replica_of(r.rank) in replicas
    ]
    where = (
        _longest_step(run, quiet, iterations, since, until)
        or _longest_gap(run, quiet, since, until)
        or _longest_step(run, run.present_ranks, iterations, since, until)
    )
    said = f"rank {ranks[0]}" if len(ranks) == 1 else f"rank(s) {', '.join(map(str, ranks))}"
    during = "iteration" if len(iterations) == 1 else "iterations"
    return Finding(
        fk.STALL_RECOVERED,
        fk.WARNING,
        f"{said} made no progress for {min(s.idle_s for s in stalls):.3g} s or more in "
        f"{during} {', '.join(map(str, iterations))} (the watchdog recorded a stall), then "
        f"went on{'' if where is None else where.said()}",
        "a step or a wait took seconds once: a process frozen or descheduled, a slow file "
        "system or data loader, swapping; not a hang, the run recovered",
        ranks=ranks,
        steps=[]
        if where is None
        else [StepRef(where.rank, where.step, where.iteration, None, where.begin)],
        iterations=iterations,
        time_ns=(min(s.t for s in stalls), until),
        details={
            "stalls": [
                {"rank": s.rank, "t_ns": s.t, "idle_s": s.idle_s}
                for s in sorted(stalls, key=lambda s: (s.rank, s.t))
            ],
            "longest": None
            if where is None
            else {
                "rank": where.rank,
                "step": where.step,
                "duration_ns": where.duration,
                "between_steps": where.gap,
            },
        },
    )


def _longest_step(
    run: Run, ranks: list[RankTimeline], iterations: list[int], since: int, until: int
) -> _Where | None:
    """The longest ended step of ``iterations`` overlapping [since, until] on ``ranks``."""
    best = None
    for rank in ranks:
        top = top_level(rank, run.catalog)
        s = rank.steps
        rows = top[
            np.isin(s.it[top], iterations)
            & (s.end[top] != OPEN)
            & (s.begin[top] <= until)
            & (s.end[top] >= since)
        ]
        if not len(rows):
            continue
        row = int(rows[np.argmax(s.end[rows] - s.begin[rows])])
        duration = int(s.end[row] - s.begin[row])
        if best is None or duration > best.duration:
            text = run.catalog.texts[int(s.code[row])]
            best = _Where(rank.rank, text, int(s.it[row]), int(s.begin[row]), duration, False)
    return best


def _longest_gap(run: Run, ranks: list[RankTimeline], since: int, until: int) -> _Where | None:
    """The longest time without a step's begin or end that covers [since, until] on
    ``ranks``: a rank that stopped between its steps, and the step it went on with."""
    best = None
    for rank in ranks:
        s = rank.steps
        marks = np.sort(np.concatenate([s.begin, s.end[s.end != OPEN]]))
        after = int(np.searchsorted(marks, until, side="left"))
        if after == 0 or after == len(marks) or marks[after - 1] > since:
            continue
        gap = int(marks[after] - marks[after - 1])
        following = np.flatnonzero(s.begin >= marks[after])
        if not len(following) or (best is not None and gap <= best.duration):
            continue
        row = int(following[0])
        text = run.catalog.texts[int(s.code[row])]
        best = _Where(rank.rank, text, int(s.it[row]), int(s.begin[row]), gap, True)
    return best
