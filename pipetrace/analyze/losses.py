"""nonfinite_loss: the loss became NaN or infinite.

JSON has no such numbers, so the recorder writes the loss as null with ``nonfinite`` saying
which (`iter_end`, docs/trace-format.md); without this finding a diverged run reads as one
that recorded no loss. It is told once per run, from the first iteration it happened in:
every update after it is wrong, and the first is where to look.
"""

from __future__ import annotations

from pipetrace.analyze import findings as fk
from pipetrace.analyze.findings import Finding
from pipetrace.analyze.model import Run
from pipetrace.recorder import format as fmt


def find_nonfinite_loss(run: Run) -> list[Finding]:
    seen = sorted(
        (ev.fields.get("it"), ev.t, rank.rank, ev.fields["nonfinite"])
        for rank in run.present_ranks
        for ev in rank.events_of(fmt.ITER_END)
        if "nonfinite" in ev.fields and isinstance(ev.fields.get("it"), int)
    )
    if not seen:
        return []
    first, t, _, value = seen[0]
    ranks = sorted({rank for it, _, rank, _ in seen if it == first})
    iterations = sorted({it for it, *_ in seen})
    said = f"rank {ranks[0]}" if len(ranks) == 1 else f"rank(s) {', '.join(map(str, ranks))}"
    later = len(iterations) - 1
    return [
        Finding(
            fk.NONFINITE_LOSS,
            fk.ERROR,
            f"the loss was {value} in iteration {first} on {said}{_last_stage(run, ranks)}"
            + (f", and in {later} later iteration(s)" if later else ""),
            "the training diverged or met a bad value (a learning rate too high, a bad batch, "
            "an overflow in a forward or backward): every update from then on is wrong",
            ranks=ranks,
            iterations=iterations,
            time_ns=(t, t),
            details={
                "first_iteration": first,
                "value": value,
                "losses": [{"rank": rank, "iteration": it, "value": v} for it, _, rank, v in seen],
            },
        )
    ]


def _last_stage(run: Run, ranks: list[int]) -> str:
    """`` (the last stage)`` when every one of ``ranks`` holds it, as the loss's rank does."""
    last = run.plan.num_stages - 1 if run.plan is not None else None
    holds = last is not None and all(last in run.stages_of(r) for r in ranks)
    return " (the last stage)" if holds else ""
