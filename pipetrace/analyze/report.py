"""The human report of `pipetrace analyze`: findings first (most severe first), then metrics.

`render(analysis, out, color=...)` writes plain text, or rich markup on a terminal; the
content is the same either way (tests read the plain form).
"""

from __future__ import annotations

from typing import IO, Any

from pipetrace.analyze.analysis import Analysis, metrics_json, run_summary
from pipetrace.analyze.findings import ERROR, WARNING, counts

_STYLE = {ERROR: "bold red", WARNING: "bold yellow", "info": "cyan"}


def ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f} ms" if abs(ns) < 1e10 else f"{ns / 1e9:.2f} s"


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def report_lines(analysis: Analysis, *, max_findings: int = 50) -> list[tuple[str, str | None]]:
    """(text, style) lines; style is a rich style or None."""
    run = analysis.run
    s = run_summary(run)
    lines: list[tuple[str, str | None]] = []
    sched = s["schedule"] or {}
    lines.append(
        (
            f"{run.path}: {sched.get('name', '?')}, {s['world_size']} ranks, {s['num_stages']} stages, "
            f"{s['num_microbatches']} micro-batches, {s['iterations']} iterations, "
            f"{s['events']:,} events",
            "bold",
        )
    )
    states: dict[str, list[int]] = {}
    for r in run.ranks:
        states.setdefault(r.status.state, []).append(r.rank)
    lines.append(("ranks: " + "; ".join(f"{st} {_ranges(rs)}" for st, rs in states.items()), None))
    for p in run.problems:
        lines.append((f"input {p.severity}: {p.message}", _STYLE.get(p.severity)))
    c = counts(analysis.findings)
    lines.append(("", None))
    lines.append(
        (f"Findings: {c['error']} error(s), {c['warning']} warning(s), {c['info']} info", "bold")
    )
    if not analysis.findings:
        lines.append(("  none", "green"))
    for f in analysis.findings[:max_findings]:
        lines.append((f"  {f.severity.upper():7} [{f.kind}] {f.message}", _STYLE.get(f.severity)))
        lines.append((f"          cause: {f.cause}", None))
    if len(analysis.findings) > max_findings:
        lines.append(
            (f"  ... {len(analysis.findings) - max_findings} more (use --json for all)", None)
        )
    lines.append(("", None))
    lines.extend(
        _metric_lines(metrics_json(run, analysis.metrics, analysis.critical, segments=False))
    )
    return lines


def _ranges(ranks: list[int]) -> str:
    out, start, prev = [], None, None
    for r in ranks + [None]:  # type: ignore[list-item]
        if start is None:
            start = prev = r
        elif r is not None and r == prev + 1:  # type: ignore[operator]
            prev = r
        else:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = r
    return ",".join(out)


def _metric_lines(m: dict[str, Any]) -> list[tuple[str, str | None]]:
    lines: list[tuple[str, str | None]] = [("Metrics", "bold")]
    it = m["iteration_time"]
    lines.append(
        (
            f"  iteration time: steady mean {ms(it['steady_mean_ns'])}, p50 {ms(it['p50_ns'])}, "
            f"min {ms(it['min_ns'])}, max {ms(it['max_ns'])} over {it['count']} complete iteration(s)",
            None,
        )
    )
    b = m["bubble"]
    ideal = b["ideal"]
    ideal_text = (
        f"ideal {ratio(b['ideal_ratio'])} (simulated makespan {ms(b['ideal_makespan_ns'])} with "
        "these step costs)"
        if ideal.get("available")
        else f"ideal unavailable ({ideal.get('reason')})"
    )
    lines.append(
        (f"  bubble ratio (idle/busy): measured {ratio(b['measured_ratio'])}, {ideal_text}", None)
    )
    lines.append((f"  P2P mode: {'overlap' if m['overlap_mode'] else 'plain'}", None))
    lines.append(("  per rank (mean per steady iteration):", None))
    lines.append(
        (
            f"    {'rank':>4} {'busy':>12} {'p2p wait':>12} {'bubble':>12} {'ratio':>7} {'exposed':>12}",
            None,
        )
    )
    rank_rows = m["ranks"]
    if len(rank_rows) > 48:
        lines.append(
            (f"    ({len(rank_rows)} ranks; the 10 with the largest bubble; --json has all)", None)
        )
        rank_rows = sorted(rank_rows, key=lambda r: -(r["bubble_ns"] or 0))[:10]
    for r in rank_rows:
        lines.append(
            (
                f"    {r['rank']:>4} {ms(r['busy_ns']):>12} {ms(r['p2p_wait_ns']):>12} {ms(r['bubble_ns']):>12} "
                f"{ratio(r['bubble_ratio']):>7} {ms(r['exposed_comm_ns']):>12}",
                None,
            )
        )
    if len(m["stages"]) > 48:
        lines.append(
            (
                f"  per stage step time ({len(m['stages'])} stage/kind rows; --json has all): slowest:",
                None,
            )
        )
        lines.append(
            (
                f"    {'stage':>5} {'kind':>4} {'count':>6} {'mean':>12} {'p50':>12} {'p95':>12}",
                None,
            )
        )
        for s in sorted(m["stages"], key=lambda s: -(s["mean_ns"] or 0))[:10]:
            lines.append(
                (
                    f"    {s['stage']:>5} {s['kind']:>4} {s['count']:>6} {ms(s['mean_ns']):>12} "
                    f"{ms(s['p50_ns']):>12} {ms(s['p95_ns']):>12}",
                    None,
                )
            )
    elif m["stages"]:
        lines.append(("  per stage step time:", None))
        lines.append(
            (
                f"    {'stage':>5} {'kind':>4} {'count':>6} {'mean':>12} {'p50':>12} {'p95':>12}",
                None,
            )
        )
        for s in m["stages"]:
            lines.append(
                (
                    f"    {s['stage']:>5} {s['kind']:>4} {s['count']:>6} {ms(s['mean_ns']):>12} "
                    f"{ms(s['p50_ns']):>12} {ms(s['p95_ns']):>12}"
                    + ("  (inside OVERLAP_F_B)" if s.get("overlapped") else ""),
                    None,
                )
            )
    cp = m["critical_path"]
    if cp:
        parts = ", ".join(
            f"{k} {ms(v)}" for k, v in sorted(cp["by_what_ns"].items(), key=lambda kv: -kv[1])
        )
        kinds = ", ".join(
            f"{k} {ms(v)}"
            for k, v in sorted(cp["compute_by_kind_ns"].items(), key=lambda kv: -kv[1])
        )
        lines.append(
            (
                f"  critical path (iteration {cp['iteration']}): {ms(cp['length_ns'])} = {parts}; "
                f"compute: {kinds or '-'}; {cp['rank_hops']} hops between ranks",
                None,
            )
        )
    cl = m["clocks"]
    moved = [r for r in cl["ranks"] if r.get("correction_ns")]
    lines.append(
        (
            f"  clocks: {cl.get('message_pairs_checked', 0)} rank pairs checked, "
            f"{cl.get('early_receives_before', 0)} received before sent with recorded offsets"
            + (
                f" (worst {ms(cl.get('worst_early_ns'))}); refined, {len(moved)} rank(s) moved up to "
                f"{ms(cl.get('max_correction_ns'))}"
                if cl.get("refined")
                else ""
            )
            + (
                f"; min slack {ms(cl.get('min_slack_ns'))}"
                if cl.get("min_slack_ns") is not None
                else ""
            ),
            None,
        )
    )
    return lines


def render(analysis: Analysis, out: IO[str], *, color: bool = False) -> None:
    lines = report_lines(analysis)
    if not color:
        out.write("\n".join(text for text, _ in lines) + "\n")
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(file=out, highlight=False, soft_wrap=True)
    for text, style in lines:
        console.print(Text(text, style=style or ""))
