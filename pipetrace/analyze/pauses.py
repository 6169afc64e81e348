"""stall_recovered: a watchdog recorded a stall, and the run went on.

A stall the run recovered from is no hang (the hang analyzers read the run's end), but a
rank that made no progress for seconds is worth a line: a process frozen or descheduled, a
slow file system or data loader, swapping. One warning per iteration with such stalls, with
the step that took longest across the ranks while they stalled: usually the one they waited
for.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from pipetrace import units
from pipetrace.analyze import findings as fk
from pipetrace.analyze.derive import top_level
from pipetrace.analyze.findings import Finding, StepRef
from pipetrace.analyze.model import OPEN, RankTimeline, Run
from pipetrace.recorder import format as fmt


def find_recovered_stalls(run: Run) -> list[Finding]:
    """Per iteration, the stalls recorded by ranks that made progress after them."""
    by_iteration: dict[int, list[tuple[int, int, float]]] = defaultdict(list)
    for rank in run.present_ranks:
        steps = rank.steps
        for stall in rank.events_of(fmt.STALL):
            went_on = (
                (steps.begin > stall.t) | ((steps.end != OPEN) & (steps.end > stall.t))
            ).any()
            running = np.flatnonzero(
                (rank.iterations.begin <= stall.t)
                & ((rank.iterations.end == OPEN) | (rank.iterations.end >= stall.t))
            )
            if went_on and len(running):
                idle = stall.fields.get("idle_s")
                idle = float(idle) if isinstance(idle, int | float) and idle >= 0 else 0.0
                it = int(rank.iterations.it[running[-1]])
                by_iteration[it].append((rank.rank, stall.t, idle))
    return [_finding(run, it, stalls) for it, stalls in sorted(by_iteration.items())]


def _finding(run: Run, iteration: int, stalls: list[tuple[int, int, float]]) -> Finding:
    ranks = sorted({r for r, _, _ in stalls})
    idle = min(i for _, _, i in stalls)
    since = min(t - int(i * 1e9) for _, t, i in stalls)
    until = max(t for _, t, _ in stalls)
    quiet = [r for r in run.present_ranks if r.rank not in ranks]
    longest = _longest_step(run, quiet, iteration, since, until) or _longest_step(
        run, run.present_ranks, iteration, since, until
    )
    then = ""
    steps: list[StepRef] = []
    if longest is not None:
        rank, text, begin, duration = longest
        then = f": the longest step then was {text} on rank {rank}, {units.duration(duration)}"
        steps = [StepRef(rank, text, iteration, None, begin)]
    said = f"rank {ranks[0]}" if len(ranks) == 1 else f"rank(s) {', '.join(map(str, ranks))}"
    return Finding(
        fk.STALL_RECOVERED,
        fk.WARNING,
        f"{said} made no progress for {idle:.3g} s or more in iteration {iteration} (the "
        f"watchdog recorded a stall), then went on{then}",
        "a step or a wait took seconds once: a process frozen or descheduled, a slow file "
        "system or data loader, swapping; not a hang, the run recovered",
        ranks=ranks,
        steps=steps,
        iterations=[iteration],
        time_ns=(min(t for _, t, _ in stalls), until),  # when the watchdogs said so
        details={
            "stalls": [{"rank": r, "t_ns": t, "idle_s": i} for r, t, i in sorted(stalls)],
            "longest": None
            if longest is None
            else {"rank": longest[0], "step": longest[1], "duration_ns": longest[3]},
        },
    )


def _longest_step(
    run: Run, ranks: list[RankTimeline], iteration: int, since: int, until: int
) -> tuple[int, str, int, int] | None:
    """(rank, step, begin, duration) of the iteration's longest ended step overlapping
    [since, until] on ``ranks``. Asked first of the ranks that recorded no stall: a frozen
    process's watchdog is frozen with it, and the others waited for it."""
    best = None
    for rank in ranks:
        top = top_level(rank, run.catalog)
        s = rank.steps
        rows = top[
            (s.it[top] == iteration)
            & (s.end[top] != OPEN)
            & (s.begin[top] <= until)
            & (s.end[top] >= since)
        ]
        if not len(rows):
            continue
        row = int(rows[np.argmax(s.end[rows] - s.begin[rows])])
        duration = int(s.end[row] - s.begin[row])
        if best is None or duration > best[3]:
            best = (rank.rank, run.catalog.texts[int(s.code[row])], int(s.begin[row]), duration)
    return best
