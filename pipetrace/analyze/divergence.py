"""plan_divergence: the first place where a rank's execution departs from its plan.

Two checks per rank:

1. The plan the rank ran (`run_start.plan`) against its row of meta.json's plan (bubbles
   removed): a rank handed a different plan than the others is an error.
2. The steps it executed (main thread, composites' sub-steps folded in) against the plan it
   ran, iteration by iteration, vectorized: the k-th step of an iteration must be plan[k]
   at position k; a finished iteration must hold every step.
"""

from __future__ import annotations

import numpy as np

from pipetrace.analyze import findings as fk
from pipetrace.analyze.derive import position_in_run, run_bounds, run_starts, top_level
from pipetrace.analyze.findings import Finding, StepRef
from pipetrace.analyze.model import OPEN, Run


def find_divergence(run: Run) -> list[Finding]:
    out = []
    for rank in run.present_ranks:
        rows = run.meta.get("plan") if run.plan is not None else None
        if rows is not None and rank.plan and rank.rank < len(rows):
            expected = [t for t in rows[rank.rank] if t]
            if expected != rank.plan:
                k = next(
                    (i for i, (a, b) in enumerate(zip(expected, rank.plan)) if a != b),
                    min(len(expected), len(rank.plan)),
                )
                meant = expected[k] if k < len(expected) else "(end of plan)"
                ran = rank.plan[k] if k < len(rank.plan) else "(end of plan)"
                out.append(
                    Finding(
                        fk.PLAN_DIVERGENCE,
                        fk.ERROR,
                        f"rank {rank.rank} ran a different plan than meta.json's: position {k} is {ran}, "
                        f"meta.json says {meant}",
                        "the rank was given another schedule (different flags or version on that rank?)",
                        ranks=[rank.rank],
                        steps=[StepRef(rank.rank, ran, None, k, None, f"meta.json: {meant}")],
                        details={
                            "position": k,
                            "planned": meant,
                            "ran_plan": ran,
                            "source": "meta",
                        },
                    )
                )
                continue
        found = _executed_vs_plan(run, rank)
        if found is not None:
            out.append(found)
    return out


def _executed_vs_plan(run: Run, rank) -> Finding | None:
    plan_codes = rank.plan_codes
    if not len(plan_codes):
        return None
    rows = top_level(rank, run.catalog)
    if not len(rows):
        return None
    steps = rank.steps
    it, code, pos = steps.it[rows], steps.code[rows], steps.pos[rows]
    starts = run_starts(it)
    within = position_in_run(starts, len(rows))
    n = len(plan_codes)
    expected = plan_codes[np.minimum(within, n - 1)]
    bad = (within >= n) | (code != expected) | (pos != within)
    first_bad = int(np.argmax(bad)) if bad.any() else None
    # a finished iteration must hold the whole plan
    short = None
    ended = set(rank.iterations.it[rank.iterations.end != OPEN].tolist())
    bounds = run_bounds(starts, len(rows))
    for s, e in zip(bounds, bounds[1:]):
        if int(it[s]) in ended and e - s < n:
            short = (e - 1, e - s)
            break
    if first_bad is None and short is None:
        return None
    if first_bad is not None and (short is None or first_bad <= short[0]):
        r = int(rows[first_bad])
        k = int(within[first_bad])
        ran = run.catalog.texts[int(code[first_bad])]
        meant = rank.plan[k] if k < n else "(end of plan)"
        message = (
            f"rank {rank.rank}, iteration {int(it[first_bad])}: step {k} of its plan should be {meant} "
            f"but it ran {ran}"
            + (f" (recorded at position {int(pos[first_bad])})" if pos[first_bad] != k else "")
        )
        cause = (
            "the runtime executed steps out of plan order (a custom step function or a runtime bug)"
        )
        ref = StepRef(
            rank.rank, ran, int(it[first_bad]), k, int(steps.begin[r]), f"planned: {meant}"
        )
        details = {
            "iteration": int(it[first_bad]),
            "position": k,
            "planned": meant,
            "executed": ran,
            "source": "executed",
        }
    else:
        last, count = short  # type: ignore[misc]
        r = int(rows[last])
        missing = rank.plan[count]
        message = (
            f"rank {rank.rank}, iteration {int(it[last])}: the iteration ended after {count} of "
            f"{n} planned steps; {missing} and later never ran"
        )
        cause = "steps were skipped (a custom step function, or the runtime left the loop early)"
        ref = StepRef(rank.rank, missing, int(it[last]), count, int(steps.end[r]), "never ran")
        details = {
            "iteration": int(it[last]),
            "position": count,
            "planned": missing,
            "executed": None,
            "source": "executed",
        }
    step = run.catalog.step(run.catalog.code(ref.step)) if run.catalog.code(ref.step) >= 0 else None
    mbs = [leaf.microbatch for leaf in step.leaves() if leaf.microbatch is not None] if step else []
    return Finding(
        fk.PLAN_DIVERGENCE,
        fk.WARNING,
        message,
        cause,
        ranks=[rank.rank],
        steps=[ref],
        microbatches=mbs,
        iterations=[details["iteration"]],
        time_ns=(ref.time_ns, ref.time_ns),
        details=details,
    )
