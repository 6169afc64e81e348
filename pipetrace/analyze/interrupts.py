"""interrupted: the user stopped the run (Ctrl-C), and where each rank was at that moment.

An interrupted run is cut short, not broken: the ranks the interrupt ended (`endings` decides
which: every rank that had not finished, failed or hung before it) are no failures, and what
they were waiting in is where they were, not a hang. One warning says so and lists them; a
failure or a hang that came before the interrupt is still reported by its own kind.
"""

from __future__ import annotations

from pipetrace.analyze import endings as en
from pipetrace.analyze import findings as fk
from pipetrace.analyze.findings import Finding
from pipetrace.analyze.model import Run


def find_interrupt(run: Run) -> list[Finding]:
    """The one `interrupted` finding of a run the user interrupted; none otherwise."""
    at = en.interrupted_at(run)
    if at is None:
        return []
    endings = en.rank_endings(run)
    stopped = [run.ranks[r] for r, e in sorted(endings.items()) if e.state == en.INTERRUPTED]
    wheres = {rank.rank: en.where(run, rank) for rank in stopped}
    hung = [r for r in sorted(endings) if en.hung_before(run.ranks[r], at)]
    parts = [f"rank {r} {w.phrase}" for r, w in wheres.items()]
    if hung:
        parts.append(f"rank(s) {', '.join(map(str, hung))} had stalled before it (see the hang)")
    listed = ", ".join(parts) or "every rank had ended before it"
    return [
        Finding(
            fk.INTERRUPTED,
            fk.WARNING,
            f"the run was interrupted by the user (Ctrl-C): {listed}",
            "a SIGINT reached the ranks (Ctrl-C in the terminal, or kill -INT); where they "
            "were is what they were doing then, not a fault",
            ranks=list(wheres),
            steps=[w.ref for w in wheres.values() if w.ref is not None],
            iterations=[i for w in wheres.values() for i in w.iterations],
            time_ns=(at, at),
            details={
                "ranks": [{"rank": r, "step": w.step, "open": w.open} for r, w in wheres.items()],
            },
        )
    ]
