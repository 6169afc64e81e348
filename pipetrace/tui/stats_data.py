"""The stats panel's tables, as plain rows built from the analyzers' metrics (no UI).

Every number comes from `pipetrace.analyze.analysis.metrics_json`; this module only chooses
columns and formats them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipetrace.tui import units
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
    m: dict[str, Any] = session.metrics
    run = session.run
    out = []
    bubble = m.get("bubble", {})
    it = m.get("iteration_time", {})
    summary = Table("Run", ["", "measured", "ideal (simulated)"])
    summary.rows.append(
        [
            "iteration time (steady mean)",
            _ms(it.get("steady_mean_ns")),
            _ms(bubble.get("ideal_makespan_ns")),
        ]
    )
    summary.rows.append(
        [
            "bubble ratio (idle / busy)",
            _ratio(bubble.get("measured_ratio")),
            _ratio(bubble.get("ideal_ratio")),
        ]
    )
    steady = it.get("steady_iterations") or []
    summary.notes.append(
        f"steady iterations: {len(steady)} of {len(m.get('iterations', []))}"
        + (" (the first is warm-up)" if len(steady) < len(m.get("iterations", [])) else "")
        + ("; overlapped P2P" if m.get("overlap_mode") else "; plain P2P")
    )
    if not (bubble.get("ideal") or {}).get("available", True):
        summary.notes.append(f"no ideal: {bubble['ideal'].get('reason')}")
    out.append(summary)
    ideal_per_rank = (bubble.get("ideal") or {}).get("per_rank_bubble_ratio") or []
    ranks = Table(
        "Per rank (steady iterations, mean)",
        ["rank", "stages", "state", "busy", "p2p wait", "bubble", "ratio", "ideal", "exposed"],
    )
    for row in m.get("ranks", []):
        r = int(row["rank"])
        rank = run.ranks[r]
        ideal = ideal_per_rank[r] if r < len(ideal_per_rank) else None
        ranks.rows.append(
            [
                str(r),
                ",".join(map(str, rank.stages)) or "-",
                rank.status.state,
                _ms(row.get("busy_ns")),
                _ms(row.get("p2p_wait_ns")),
                _ms(row.get("bubble_ns")),
                _ratio(row.get("bubble_ratio")),
                _ratio(ideal),
                _ms(row.get("exposed_comm_ns")),
            ]
        )
    listed = {int(row["rank"]) for row in m.get("ranks", [])}
    for rank in run.ranks:
        if rank.rank not in listed:
            ranks.rows.append([str(rank.rank), "-", rank.status.state] + ["-"] * 6)
    out.append(ranks)
    stages = Table("Per stage step cost", ["stage", "kind", "count", "mean", "p50", "p95", "max"])
    for row in m.get("stages", []):
        stages.rows.append(
            [
                str(row["stage"]),
                str(row["kind"]),
                str(row["count"]),
                _ms(row.get("mean_ns")),
                _ms(row.get("p50_ns")),
                _ms(row.get("p95_ns")),
                _ms(row.get("max_ns")),
            ]
        )
    out.append(stages)
    return out
