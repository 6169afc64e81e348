"""The stats panel's tables, as plain rows built from the analyzers' metrics (no UI).

Every number comes from the analysis's `pipetrace.analyze.summary.MetricsSummary`; this
module only chooses columns and formats them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipetrace import units
from pipetrace.analyze.model import Run
from pipetrace.analyze.summary import MetricsSummary, StageCost
from pipetrace.tui.session import Session


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _ms(ns: float | None) -> str:
    return "-" if ns is None else units.duration(ns)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def stats_tables(session: Session) -> list[Table]:
    m = session.analysis.summary
    return [_summary_table(m), _rank_table(m, session.run), _stage_table(m.stages)]


def _summary_table(m: MetricsSummary) -> Table:
    """The run's steady iteration time and bubble ratio, measured and ideal."""
    bubble, it = m.bubble, m.iteration_time
    summary = Table("Run", ["", "measured", "ideal (simulated)"])
    summary.rows.append(
        ["iteration time (steady mean)", _ms(it.steady_mean_ns), _ms(bubble.ideal.makespan_ns)]
    )
    summary.rows.append(
        [
            "bubble ratio (idle / busy)",
            _ratio(bubble.measured_ratio),
            _ratio(bubble.ideal.bubble_ratio),
        ]
    )
    steady, total = len(it.steady_iterations), len(m.iterations)
    summary.notes.append(
        f"steady iterations: {steady} of {total}"
        + (" (the first is warm-up)" if steady < total else "")
        + ("; overlapped P2P" if m.overlap_mode else "; plain P2P")
    )
    if not bubble.ideal.available:
        summary.notes.append(f"no ideal: {bubble.ideal.reason}")
    return summary


def _rank_table(m: MetricsSummary, run: Run) -> Table:
    """Per rank: its stages, how it ended, its mean busy / wait / bubble, and the ideal."""
    ideal_per_rank = m.bubble.ideal.per_rank_bubble_ratio
    ranks = Table(
        "Per rank (steady iterations, mean)",
        ["rank", "stages", "state", "busy", "p2p wait", "bubble", "ratio", "ideal", "exposed"],
    )
    for row in m.ranks:
        rank = run.ranks[row.rank]
        ideal = ideal_per_rank[row.rank] if row.rank < len(ideal_per_rank) else None
        ranks.rows.append(
            [
                str(row.rank),
                ",".join(map(str, rank.stages)) or "-",
                rank.status.state,
                _ms(row.busy_ns),
                _ms(row.p2p_wait_ns),
                _ms(row.bubble_ns),
                _ratio(row.bubble_ratio),
                _ratio(ideal),
                _ms(row.exposed_comm_ns),
            ]
        )
    listed = {row.rank for row in m.ranks}
    for rank in run.ranks:
        if rank.rank not in listed:
            ranks.rows.append([str(rank.rank), "-", rank.status.state] + ["-"] * 6)
    return ranks


def _stage_table(stages: list[StageCost]) -> Table:
    table = Table("Per stage step cost", ["stage", "kind", "count", "mean", "p50", "p95", "max"])
    for row in stages:
        st = row.stats
        table.rows.append(
            [
                str(row.stage),
                row.kind,
                str(st.count),
                _ms(st.mean_ns),
                _ms(st.p50_ns),
                _ms(st.p95_ns),
                _ms(st.max_ns),
            ]
        )
    return table
