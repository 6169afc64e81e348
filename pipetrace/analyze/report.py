"""The human report of `pipetrace analyze`: findings first (most severe first), then metrics.

`render(analysis, out, color=...)` writes plain text, or rich markup on a terminal; the
content is the same either way (tests read the plain form).
"""

from __future__ import annotations

from typing import IO, Any

from pipetrace.analyze.analysis import Analysis, run_summary
from pipetrace.analyze.critical import CriticalPath
from pipetrace.analyze.device_times import DEVICE, DeviceTiming
from pipetrace.analyze.findings import ERROR, WARNING, Finding, counts
from pipetrace.analyze.memory import MemoryReport, StageMemory
from pipetrace.analyze.model import Run
from pipetrace.analyze.replicas import ReplicaSummary
from pipetrace.analyze.selection import format_rank_list
from pipetrace.analyze.summary import Bubble, MetricsSummary, RankBubble, StageCost
from pipetrace.printable import printable

Line = tuple[str, str | None]
"""One report line and its rich style (None: plain)."""

_STYLE = {ERROR: "bold red", WARNING: "bold yellow", "info": "cyan"}


def ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f} ms" if abs(ns) < 1e10 else f"{ns / 1e9:.2f} s"


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def report_lines(analysis: Analysis, *, max_findings: int = 50) -> list[Line]:
    """(text, style) lines; style is a rich style or None."""
    lines = _run_lines(analysis.run)
    lines += _finding_lines(analysis.findings, max_findings)
    lines.append(("", None))
    return lines + _metric_lines(analysis.summary) + _replica_lines(analysis.replicas)


def _replica_lines(summary: ReplicaSummary | None) -> list[Line]:
    """The cross-replica metrics: each replica, the slowest and the reduction's wait."""
    if summary is None:
        return []
    lines: list[Line] = [(f"Replicas ({summary.count} pipelines)", "bold")]
    arrive = (
        "its last rank begins REDUCE_GRAD"
        if summary.reduction != "iteration end"
        else "its last rank ends the iteration"
    )
    for r in summary.replicas:
        ranks = format_rank_list(r.ranks)
        lines.append(
            (
                f"  replica {r.replica} (global ranks {ranks}): {ms(r.mean_ns)} "
                f"mean from iteration begin until {arrive}",
                None,
            )
        )
    if summary.slowest is not None and summary.slowest_by_fraction is not None:
        lines.append(
            (
                f"  slowest: replica {summary.slowest}, {ms(summary.slowest_by_ns)} "
                f"({summary.slowest_by_fraction:.0%}) behind the fastest",
                None,
            )
        )
    for skew in summary.skew:
        lines.append(
            (
                f"  iteration {skew.iteration}: the gradient reduction waited "
                f"{ms(skew.skew_ns)} for replica {skew.last_replica} "
                f"(replica {skew.first_replica} arrived first)",
                None,
            )
        )
    return lines


def _run_lines(run: Run) -> list[Line]:
    """What ran, how each rank ended and what was wrong with the input."""
    s = run_summary(run)
    sched = s["schedule"] or {}
    count = run.pipelines.count
    replicas = f" ({count} replicas of {s['world_size'] // count})" if count > 1 else ""
    lines: list[Line] = [
        (
            f"{run.path}: {sched.get('name', '?')}, {s['world_size']} ranks{replicas}, "
            f"{_known(s['num_stages'])} stages, {_known(s['num_microbatches'])} micro-batches, "
            f"{s['iterations']} iterations, {s['events']:,} events",
            "bold",
        )
    ]
    states: dict[str, list[int]] = {}
    for r in run.ranks:
        states.setdefault(r.status.state, []).append(r.rank)
    lines.append(
        ("ranks: " + "; ".join(f"{st} {format_rank_list(rs)}" for st, rs in states.items()), None)
    )
    for p in run.problems:
        lines.append((f"input {p.severity}: {p.message}", _STYLE.get(p.severity)))
    return lines


def _finding_lines(findings: list[Finding], max_findings: int) -> list[Line]:
    c = counts(findings)
    lines: list[Line] = [
        ("", None),
        (f"Findings: {c['error']} error(s), {c['warning']} warning(s), {c['info']} info", "bold"),
    ]
    if not findings:
        lines.append(("  none", "green"))
    for f in findings[:max_findings]:
        lines.append((f"  {f.severity.upper():7} [{f.kind}] {f.message}", _STYLE.get(f.severity)))
        lines.append((f"          cause: {f.cause}", None))
    if len(findings) > max_findings:
        lines.append((f"  ... {len(findings) - max_findings} more (use --json for all)", None))
    return lines


def _metric_lines(m: MetricsSummary) -> list[Line]:
    it = m.iteration_time
    lines: list[Line] = [
        ("Metrics", "bold"),
        (
            f"  iteration time: steady mean {ms(it.steady_mean_ns)}, p50 {ms(it.stats.p50_ns)}, "
            f"min {ms(it.stats.min_ns)}, max {ms(it.stats.max_ns)} over {it.stats.count} "
            "complete iteration(s)",
            None,
        ),
        (f"  bubble ratio (idle/busy): {_bubble_text(m.bubble)}", None),
        (f"  P2P mode: {'overlap' if m.overlap_mode else 'plain'}", None),
        *_timing_lines(m.timing),
    ]
    lines += _rank_lines(m.ranks, m.overlap_mode)
    lines += _stage_lines(m.stages)
    if m.memory is not None:
        lines += _memory_lines(m.memory)
    if m.critical_path:
        lines.append(_critical_line(m.critical_path))
    lines.append(_clock_line(m.clocks))
    return lines


def _timing_lines(timing: DeviceTiming) -> list[Line]:
    """Which times the metrics use; on a device, how steps were bound and what never ran."""
    if timing.source != DEVICE:
        return [("  times: host (no device times recorded)", None)]
    lines: list[Line] = [("  times: device (host times where a step has none)", None)]
    for r in timing.ranks:
        if r.source == DEVICE:
            lines.append(
                (
                    f"    rank {r.rank}: {r.device_bound_steps} of {r.device_steps} steps "
                    f"device-bound, {r.launch_bound_steps} launch-bound; longest lag "
                    f"{ms(r.max_lag_ns)} ({r.worst_step})",
                    None,
                )
            )
    for pending in timing.device_pending:
        behind = f" ({pending.behind} more after it)" if pending.behind else ""
        lines.append((f"    {pending.message}{behind}", _STYLE[ERROR]))
    return lines


def _bubble_text(b: Bubble) -> str:
    ideal = b.ideal
    ideal_text = (
        f"ideal {ratio(ideal.bubble_ratio)} (simulated makespan {ms(ideal.makespan_ns)} with "
        "these step costs)"
        if ideal.available
        else f"ideal unavailable ({ideal.reason})"
    )
    return f"measured {ratio(b.measured_ratio)}, {ideal_text}"


def _rank_lines(rank_rows: list[RankBubble], overlap: bool) -> list[Line]:
    """The last column is the P2P time not hidden by compute: exposed (overlap mode) or
    blocking transfer (plain mode, where every wait is exposed and exposed_comm_ns is 0)."""
    lines: list[Line] = [
        ("  per rank (mean per steady iteration):", None),
        (
            f"    {'rank':>4} {'busy':>12} {'p2p wait':>12} {'bubble':>12} {'ratio':>7} "
            f"{'exposed' if overlap else 'blocking':>12}",
            None,
        ),
    ]
    if len(rank_rows) > 48:
        lines.append(
            (f"    ({len(rank_rows)} ranks; the 10 with the largest bubble; --json has all)", None)
        )
        rank_rows = sorted(rank_rows, key=lambda r: -(r.bubble_ns or 0))[:10]
    for r in rank_rows:
        lines.append(
            (
                f"    {r.rank:>4} {ms(r.busy_ns):>12} {ms(r.p2p_wait_ns):>12} "
                f"{ms(r.bubble_ns):>12} {ratio(r.bubble_ratio):>7} "
                f"{ms(r.exposed_comm_ns if overlap else r.blocking_transfer_ns):>12}",
                None,
            )
        )
    return lines


def _stage_lines(stages: list[StageCost]) -> list[Line]:
    """Every stage's step costs, or the 10 slowest of a big run."""
    if not stages:
        return []
    header = f"    {'stage':>5} {'kind':>4} {'count':>6} {'mean':>12} {'p50':>12} {'p95':>12}"
    if len(stages) > 48:
        title = f"  per stage step time ({len(stages)} stage/kind rows; --json has all): slowest:"
        shown = sorted(stages, key=lambda s: -(s.stats.mean_ns or 0))[:10]
        return [(title, None), (header, None)] + [(_stage_row(s), None) for s in shown]
    return [("  per stage step time:", None), (header, None)] + [
        (_stage_row(s) + ("  (inside overlapped pairs)" if s.overlapped else ""), None)
        for s in stages
    ]


def _stage_row(s: StageCost) -> str:
    st = s.stats
    return (
        f"    {s.stage:>5} {s.kind:>4} {st.count:>6} {ms(st.mean_ns):>12} "
        f"{ms(st.p50_ns):>12} {ms(st.p95_ns):>12}"
    )


def _memory_lines(memory: MemoryReport) -> list[Line]:
    """Each stage's peak against the plan's in-flight count, or the 10 largest of a big run."""
    header = (
        f"    {'rank':>4} {'stage':>5} {'peak':>10} {'after':>12} {'micro-batches':>13} "
        f"{'plan':>4} {'swap saves':>10} {'on host':>10}"
    )
    stages = memory.stages
    title = "  peak activation memory per stage (saved for backward + in flight, on the device):"
    if len(stages) > 48:
        title = (
            f"  peak activation memory, the 10 largest of {len(stages)} stages (--json has all):"
        )
        stages = sorted(stages, key=lambda s: -s.peak_bytes)[:10]
    lines: list[Line] = [(title, None), (header, None)]
    lines += [(_memory_row(s), None) for s in stages]
    for r in memory.ranks:
        if r.peak_allocated_bytes is not None:
            lines.append(
                (
                    f"    rank {r.rank}: device allocator peak {_mib(r.peak_allocated_bytes)} "
                    f"allocated, {_mib(r.peak_reserved_bytes)} reserved",
                    None,
                )
            )
    return lines


def _memory_row(s: StageMemory) -> str:
    step = s.peak_step
    after = "-" if step is None else f"{step.step}@{step.iteration}"
    held = "-" if s.peak_microbatches is None else f"{s.peak_microbatches:g}"
    plan = "-" if s.expected_microbatches is None else str(s.expected_microbatches)
    return (
        f"    {s.rank:>4} {s.stage:>5} {_mib(s.peak_bytes):>10} {after:>12} {held:>13} "
        f"{plan:>4} {_mib(s.swap_would_save_bytes):>10} {_mib(s.swapped_bytes):>10}"
    )


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def _critical_line(cp: CriticalPath) -> Line:
    parts = ", ".join(f"{k} {ms(v)}" for k, v in sorted(cp.by_what_ns.items(), key=_longest))
    kinds = ", ".join(
        f"{k} {ms(v)}" for k, v in sorted(cp.compute_by_kind_ns.items(), key=_longest)
    )
    return (
        f"  critical path (iteration {cp.iteration}"
        f"{'' if cp.complete else ', incomplete: its path so far'}): "
        f"{ms(cp.length_ns)} = {parts}; "
        f"compute: {kinds or '-'}; {cp.rank_hops} hops between ranks",
        None,
    )


def _longest(item: tuple[str, int]) -> int:
    return -item[1]


def _clock_line(cl: dict[str, Any]) -> Line:
    moved = [r for r in cl["ranks"] if r.get("correction_ns")]
    refined = (
        f" (worst {ms(cl.get('worst_early_ns'))}); refined, {len(moved)} rank(s) moved up to "
        f"{ms(cl.get('max_correction_ns'))}"
        if cl.get("refined")
        else ""
    )
    slack = (
        f"; min slack {ms(cl.get('min_slack_ns'))}" if cl.get("min_slack_ns") is not None else ""
    )
    return (
        f"  clocks: {cl.get('message_pairs_checked', 0)} "
        + ("host" if len(cl.get("hosts", ())) > 1 else "rank")
        + f" pairs checked (each direction), {cl.get('early_receives_before', 0)} received "
        "before sent with "
        + ("recorded offsets" if cl.get("offsets_recorded", True) else "no offsets recorded")
        + refined
        + slack
        + _hosts_text(cl.get("hosts")),
        None,
    )


def _hosts_text(hosts: list[dict[str, Any]] | None) -> str:
    """Each host's correction and remaining uncertainty (runs over several hosts)."""
    if not hosts or len(hosts) < 2:
        return ""
    parts = [
        f"{h['host']} ({len(h['ranks'])} ranks) "
        + f"{'+' if h['correction_ns'] >= 0 else '-'}{ms(abs(h['correction_ns']))} "
        + ("±?" if h["uncertainty_ns"] is None else f"±{ms(h['uncertainty_ns'])}")
        for h in hosts
    ]
    return "; hosts: " + ", ".join(parts)


def render(analysis: Analysis, out: IO[str], *, color: bool = False) -> None:
    lines = [(printable(text), style) for text, style in report_lines(analysis)]
    if not color:
        out.write("\n".join(text for text, _ in lines) + "\n")
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(file=out, highlight=False, soft_wrap=True)
    for text, style in lines:
        console.print(Text(text, style=style or ""))


def _known(value: object) -> object:
    """A count meta.json may lack, for the report's first line."""
    return "?" if value is None else value
