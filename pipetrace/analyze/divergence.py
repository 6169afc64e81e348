"""plan_divergence: the first place where a rank's execution departs from its plan.

Two checks per rank:

1. The plan the rank ran (`run_start.plan`) against its row of meta.json's plan (bubbles
   removed): a rank handed a different plan than the others is an error.
2. The steps it executed (main thread, composites' sub-steps folded in) against the plan it
   ran, iteration by iteration, vectorized: the k-th step of an iteration must be plan[k]
   at position k; a finished iteration must hold every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetrace.analyze import findings as fk
from pipetrace.analyze.derive import position_in_run, run_bounds, run_starts, top_level
from pipetrace.analyze.findings import Finding, StepRef
from pipetrace.analyze.model import OPEN, RankTimeline, Run


def find_divergence(run: Run) -> list[Finding]:
    differs = {r.rank: _plan_differs(run, r) for r in run.present_ranks}
    author = _odd_author(run, differs)
    out = [] if author is None else [author]
    for rank in run.present_ranks:
        found = (None if author else differs[rank.rank]) or _executed_vs_plan(run, rank)
        if found is not None:
            out.append(found)
    return out


def _odd_author(run: Run, differs: dict[int, Finding | None]) -> Finding | None:
    """meta.json's plan is global rank 0's: when most ranks ran other plans than it and
    rank 0 ran it, rank 0 is the one given another schedule, not the majority."""
    others = [r for r in differs if r != 0]
    against = [(r, found) for r in others if (found := differs[r]) is not None]
    if 0 not in differs or differs[0] is not None or len(against) * 2 <= len(differs):
        return None
    rank, first = against[0]
    where = first.details
    return Finding(
        fk.PLAN_DIVERGENCE,
        fk.ERROR,
        f"rank 0 ran a different plan than the other ranks: {len(against)} of the "
        f"{len(others)} others ran plans that differ from meta.json's, which rank 0 wrote "
        f"from its own (rank {rank}: position {where['position']} is {where['ran_plan']}, "
        f"meta.json says {where['planned']})",
        "rank 0 was given another schedule than the rest of the job (different flags or "
        "version on that rank?); meta.json, and the plan views, show rank 0's",
        ranks=[0, *(r for r, _ in against)],
        steps=first.steps,
        details={
            **where,
            "source": "meta",
            "odd_rank": 0,
            "differing": [r for r, _ in against],
        },
    )


def _plan_differs(run: Run, rank: RankTimeline) -> Finding | None:
    """The rank ran another plan than its row of meta.json's (bubbles removed)."""
    rows = run.meta.get("plan") if run.plan is not None else None
    row = run.pipelines.pipeline_rank(rank.rank)  # every replica runs the plan's rows
    if rows is None or not rank.plan or row >= len(rows):
        return None
    expected = [t for t in rows[row] if t]
    if expected == rank.plan:
        return None
    k = next(
        (i for i, (a, b) in enumerate(zip(expected, rank.plan)) if a != b),
        min(len(expected), len(rank.plan)),
    )
    meant = expected[k] if k < len(expected) else "(end of plan)"
    ran = rank.plan[k] if k < len(rank.plan) else "(end of plan)"
    return Finding(
        fk.PLAN_DIVERGENCE,
        fk.ERROR,
        f"rank {rank.rank} ran a different plan than meta.json's: position {k} is {ran}, "
        f"meta.json says {meant}",
        "the rank was given another schedule (different flags or version on that rank?)",
        ranks=[rank.rank],
        steps=[StepRef(rank.rank, ran, None, k, None, f"meta.json: {meant}")],
        details={"position": k, "planned": meant, "ran_plan": ran, "source": "meta"},
    )


@dataclass(frozen=True)
class _Departure:
    """The first place a rank's execution left its plan."""

    index: int  # its row among the rank's checked rows: the earlier departure is reported
    iteration: int
    position: int
    planned: str
    executed: str | None  # None: the step never ran (the iteration ended early)
    time_ns: int
    message: str
    cause: str

    @property
    def step(self) -> str:
        """The step the finding points at: the one run out of order, or the one never run."""
        return self.planned if self.executed is None else self.executed


def _executed_vs_plan(run: Run, rank: RankTimeline) -> Finding | None:
    plan_codes = rank.plan_codes
    if not len(plan_codes):
        return None
    rows = top_level(rank, run.catalog)
    # a step outside any iteration (-1: e.g. rebuilt from an old stall record) has no place
    # in the plan to be checked against
    rows = rows[rank.steps.it[rows] >= 0]
    if not len(rows):
        return None
    starts = run_starts(rank.steps.it[rows])
    within = position_in_run(starts, len(rows))
    found = [
        d
        for d in (
            _out_of_order(run, rank, rows, within),
            _ended_early(rank, rows, starts),
        )
        if d is not None
    ]
    if not found:
        return None
    first = min(found, key=lambda d: d.index)  # on a tie, out of order
    step = run.catalog.step(run.catalog.code(first.step))
    mbs = [leaf.microbatch for leaf in step.leaves() if leaf.microbatch is not None] if step else []
    note = "never ran" if first.executed is None else f"planned: {first.planned}"
    return Finding(
        fk.PLAN_DIVERGENCE,
        fk.WARNING,
        first.message,
        first.cause,
        ranks=[rank.rank],
        steps=[
            StepRef(rank.rank, first.step, first.iteration, first.position, first.time_ns, note)
        ],
        microbatches=mbs,
        iterations=[first.iteration],
        time_ns=(first.time_ns, first.time_ns),
        details={
            "iteration": first.iteration,
            "position": first.position,
            "planned": first.planned,
            "executed": first.executed,
            "source": "executed",
        },
    )


def _out_of_order(
    run: Run, rank: RankTimeline, rows: np.ndarray, within: np.ndarray
) -> _Departure | None:
    """The first step that is not the one its plan has at its place in the iteration."""
    steps, n = rank.steps, len(rank.plan_codes)
    code, pos = steps.code[rows], steps.pos[rows]
    expected = rank.plan_codes[np.minimum(within, n - 1)]
    bad = (within >= n) | (code != expected) | (pos != within)
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    k, it = int(within[i]), int(steps.it[rows[i]])
    ran = run.catalog.texts[int(code[i])]
    meant = rank.plan[k] if k < n else "(end of plan)"
    return _Departure(
        i,
        it,
        k,
        meant,
        ran,
        int(steps.begin[rows[i]]),
        f"rank {rank.rank}, iteration {it}: step {k} of its plan should be {meant} but it ran "
        f"{ran}" + (f" (recorded at position {int(pos[i])})" if pos[i] != k else ""),
        "the runtime executed steps out of plan order (a custom step function or a runtime bug)",
    )


def _ended_early(rank: RankTimeline, rows: np.ndarray, starts: np.ndarray) -> _Departure | None:
    """The first finished iteration that holds fewer steps than the plan."""
    steps, n = rank.steps, len(rank.plan_codes)
    ended = set(rank.iterations.it[rank.iterations.end != OPEN].tolist())
    bounds = run_bounds(starts, len(rows))
    for s, e in zip(bounds, bounds[1:]):
        it = int(steps.it[rows[s]])
        if it in ended and e - s < n:
            count = e - s
            missing = rank.plan[count]
            return _Departure(
                e - 1,
                it,
                count,
                missing,
                None,
                int(steps.end[rows[e - 1]]),
                f"rank {rank.rank}, iteration {it}: the iteration ended after {count} of {n} "
                f"planned steps; {missing} and later never ran",
                "steps were skipped (a custom step function, or the runtime left the loop early)",
            )
    return None
