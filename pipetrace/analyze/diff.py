"""Two runs side by side: per-stage step times, bubbles and iteration time, with the changes.

`diff_runs(a, b)` returns plain data (also the `--json` form, docs/analyze.md); `render`
prints it. Changes are B relative to A: ``delta`` = B - A, ``change`` = B / A - 1.

The headline says it in words ("B is 2.09x faster than A per iteration"), because a bare
"-52 %" was read the wrong way round. It also says how many steady iterations each side
measured and how long the busiest rank computed: wall-clock iteration time on a shared
machine varies from run to run by more than a slowed stage adds (the straggler sample ran
faster overall than the clean one, while its slowed rank computed longer), so the headline
names what moved the wall clock.
"""

from __future__ import annotations

import shlex
from typing import IO, Any

from pipetrace.analyze.analysis import Analysis, run_summary
from pipetrace.analyze.findings import counts
from pipetrace.analyze.report import ms, ratio
from pipetrace.analyze.summary import MetricsSummary, RankBubble, StageCost
from pipetrace.printable import printable

DIFF_FORMAT = "pipetrace-diff"


def _pair(a: float | None, b: float | None) -> dict[str, float | None]:
    delta = (b - a) if a is not None and b is not None else None
    change = (b / a - 1) if a and b is not None else None
    return {"a": a, "b": b, "delta": delta, "change": change}


def diff_runs(a: Analysis, b: Analysis) -> dict[str, Any]:
    ma, mb = a.summary, b.summary
    return {
        "format": DIFF_FORMAT,
        "version": 1,
        "a": run_summary(a.run),
        "b": run_summary(b.run),
        "iteration_time_ns": _pair(
            ma.iteration_time.steady_mean_ns, mb.iteration_time.steady_mean_ns
        ),
        "bubble_ratio": _pair(ma.bubble.measured_ratio, mb.bubble.measured_ratio),
        "ideal_bubble_ratio": _pair(ma.bubble.ideal.bubble_ratio, mb.bubble.ideal.bubble_ratio),
        "critical_path_ns": _pair(_path_length(ma), _path_length(mb)),
        "busiest_rank_busy_ns": _pair(_busiest(ma), _busiest(mb)),
        "steady_iterations": {
            "a": len(ma.iteration_time.steady_iterations),
            "b": len(mb.iteration_time.steady_iterations),
        },
        "first_iteration_only": {"a": _first_only(a), "b": _first_only(b)},
        "timing": {"a": ma.timing.source, "b": mb.timing.source},
        "stages": _stage_changes(ma.stages, mb.stages),
        "ranks": _rank_changes(ma.ranks, mb.ranks),
        "findings": {"a": counts(a.findings), "b": counts(b.findings)},
    }


def _first_only(analysis: Analysis) -> bool:
    """Whether the run's steady figures rest on its first iteration alone (no later one
    completed): start-up included, so not comparable with another run's steady ones."""
    steady = analysis.summary.iteration_time.steady_iterations
    iterations = analysis.run.iterations()
    return bool(iterations) and steady == iterations[:1]


def _path_length(m: MetricsSummary) -> int | None:
    """The critical path of a complete iteration (an incomplete one's is only its part)."""
    path = m.critical_path
    return path.length_ns if path is not None and path.complete else None


def _busiest(m: MetricsSummary) -> float | None:
    """The compute time per steady iteration of the rank that computes longest."""
    return max((r.busy_ns for r in m.ranks if r.busy_ns is not None), default=None)


def _ratio(p: dict[str, float | None], more: str, less: str, same: str) -> str | None:
    """B against A in words: "1.52x slower than" / "2.09x faster than" (``more`` / ``less``),
    or ``same`` within half a percent; None when either side is missing."""
    a, b = p["a"], p["b"]
    if not a or not b:
        return None
    if abs(b / a - 1) < 0.005:
        return same
    return f"{b / a:.2f}x {more} than" if b > a else f"{a / b:.2f}x {less} than"


def headline(d: dict[str, Any]) -> list[str]:
    """The comparison in words: iteration time, the busiest rank's compute, and how many
    steady iterations each side rests on."""
    it, busy, steady = d["iteration_time_ns"], d["busiest_rank_busy_ns"], d["steady_iterations"]
    words = _ratio(it, "slower", "faster", "as fast as")
    first_only = [side.upper() for side in "ab" if d["first_iteration_only"][side]]
    if words is None:
        lines = ["iteration time: not measured in both runs (no complete iteration)"]
    elif first_only:  # a start-up iteration against steady ones: no ratio to lead with
        lines = [
            f"iteration time: not comparable ({' and '.join(first_only)} completed only its "
            f"first iteration: {ms(it['b'])} for B, {ms(it['a'])} for A)"
        ]
    else:
        lines = [
            f"B is {words} A per iteration ({ms(it['b'])} vs {ms(it['a'])}, mean of "
            f"{steady['b']} and {steady['a']} steady iterations)"
        ]
    words = _ratio(busy, "longer", "shorter", "as long as")
    if words is not None:
        lines.append(
            f"B's busiest rank computes {words} A's ({ms(busy['b'])} vs {ms(busy['a'])} "
            "per iteration)"
        )
    for side in ("a", "b"):
        errors = d["findings"][side].get("error", 0)
        if errors:
            where = " ".join(shlex.quote(p) for p in d[side]["directories"])
            lines.append(
                f"{side.upper()} did not run cleanly: {errors} error finding(s) (pipetrace "
                f"analyze {where})"
            )
        if d["first_iteration_only"][side]:
            lines.append(
                f"{side.upper()}'s figures come from its first iteration alone (no later one "
                "completed): start-up is in them, so they are not comparable"
            )
    timing = d["timing"]
    if timing["a"] != timing["b"]:
        lines.append(
            f"A's figures are {timing['a']} times, B's {timing['b']} times: a step's device "
            "time is its kernels', its host time the launch's (docs/device-timing.md), so "
            "they are not comparable"
        )
    if min(steady["a"], steady["b"]) < 3:
        lines.append(
            "few steady iterations: run-to-run noise can outweigh the difference; "
            "compare the per-stage step times below"
        )
    return lines


def _stage_changes(a: list[StageCost], b: list[StageCost]) -> list[dict[str, Any]]:
    """Per (stage, kind, overlapped) of either run: its mean and p95 step time in both."""
    stages_a = {(s.stage, s.kind, s.overlapped): s.stats for s in a}
    stages_b = {(s.stage, s.kind, s.overlapped): s.stats for s in b}
    out = []
    for key in sorted(set(stages_a) | set(stages_b)):
        sa, sb = stages_a.get(key), stages_b.get(key)
        out.append(
            {
                "stage": key[0],
                "kind": key[1],
                "overlapped": key[2],
                **{name: _pair(_get(sa, name), _get(sb, name)) for name in ("mean_ns", "p95_ns")},
            }
        )
    return out


def _rank_changes(a: list[RankBubble], b: list[RankBubble]) -> list[dict[str, Any]]:
    """Per rank of either run: its busy, P2P wait and bubble in both."""
    ranks_a = {r.rank: r for r in a}
    ranks_b = {r.rank: r for r in b}
    names = ("busy_ns", "p2p_wait_ns", "bubble_ns", "bubble_ratio")
    return [
        {
            "rank": rank,
            **{
                name: _pair(_get(ranks_a.get(rank), name), _get(ranks_b.get(rank), name))
                for name in names
            },
        }
        for rank in sorted(set(ranks_a) | set(ranks_b))
    ]


def _get(record: object | None, name: str) -> float | None:
    """A field of a record one run lacks (None)."""
    return getattr(record, name) if record is not None else None


def _change(p: dict[str, float | None], fmt=ms) -> str:
    if p["delta"] is None:
        return ""
    pct = f" ({p['change']:+.1%})" if p["change"] is not None else ""
    sign = "+" if p["delta"] >= 0 else "-"
    return f"{sign}{fmt(abs(p['delta']))}{pct}"


def _run_line(label: str, run: dict[str, Any]) -> str:
    name = (run["schedule"] or {}).get("name", "?")
    return f"{label}: {run['path']} ({name}, {run['world_size']} ranks)"


def render(d: dict[str, Any], out: IO[str]) -> None:
    w = 14
    lines = [
        _run_line("A", d["a"]),
        _run_line("B", d["b"]),
        "",
        *headline(d),
        "",
        f"{'':<22}{'A':>{w}}{'B':>{w}}  change (B vs A)",
    ]
    for label, key, f in (
        ("iteration time", "iteration_time_ns", ms),
        ("critical path", "critical_path_ns", ms),
        ("bubble ratio", "bubble_ratio", ratio),
        ("ideal bubble ratio", "ideal_bubble_ratio", ratio),
    ):
        p = d[key]
        lines.append(f"{label:<22}{f(p['a']):>{w}}{f(p['b']):>{w}}  {_change(p, f)}")
    fa, fb = d["findings"]["a"], d["findings"]["b"]
    lines.append(
        f"{'findings (err/warn)':<22}{fa['error']:>{w - 4}}/{fa['warning']:<3}"
        f"{fb['error']:>{w - 4}}/{fb['warning']:<3}"
    )
    lines += ["", "per stage mean step time:"]
    for s in d["stages"]:
        p = s["mean_ns"]
        label = f"{s['kind']}{'*' if s['overlapped'] else ''}"
        lines.append(
            f"  stage {s['stage']:>3} {label:<3}{'':<9}{ms(p['a']):>{w}}{ms(p['b']):>{w}}  "
            f"{_change(p)}"
        )
    if any(s["overlapped"] for s in d["stages"]):
        lines.append("  (* inside overlapped pairs: OVERLAP_F_B or OVERLAP_B_F)")
    lines += ["", "per rank bubble (mean per steady iteration):"]
    for r in d["ranks"][:64]:
        p = r["bubble_ns"]
        lines.append(
            f"  rank {r['rank']:>4}{'':<12}{ms(p['a']):>{w}}{ms(p['b']):>{w}}  {_change(p)}"
        )
    out.write(printable("\n".join(lines)) + "\n")
