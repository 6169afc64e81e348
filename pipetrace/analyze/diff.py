"""Two runs side by side: per-stage step times, bubbles and iteration time, with the changes.

`diff_runs(a, b)` returns plain data (also the `--json` form, docs/analyze.md); `render`
prints it. Changes are B relative to A: ``delta`` = B - A, ``change`` = B / A - 1.
"""

from __future__ import annotations

from typing import IO, Any

from pipetrace.analyze.analysis import Analysis, metrics_json, run_summary
from pipetrace.analyze.findings import counts
from pipetrace.analyze.report import ms, ratio

DIFF_FORMAT = "pipetrace-diff"


def _pair(a: float | None, b: float | None) -> dict[str, float | None]:
    delta = (b - a) if a is not None and b is not None else None
    change = (b / a - 1) if a and b is not None else None
    return {"a": a, "b": b, "delta": delta, "change": change}


def diff_runs(a: Analysis, b: Analysis) -> dict[str, Any]:
    ma = metrics_json(a.run, a.metrics, a.critical, segments=False)
    mb = metrics_json(b.run, b.metrics, b.critical, segments=False)
    stages_a = {(s["stage"], s["kind"], s["overlapped"]): s for s in ma["stages"]}
    stages_b = {(s["stage"], s["kind"], s["overlapped"]): s for s in mb["stages"]}
    stages = []
    for key in sorted(set(stages_a) | set(stages_b)):
        sa, sb = stages_a.get(key, {}), stages_b.get(key, {})
        stages.append(
            {
                "stage": key[0],
                "kind": key[1],
                "overlapped": key[2],
                "mean_ns": _pair(sa.get("mean_ns"), sb.get("mean_ns")),
                "p95_ns": _pair(sa.get("p95_ns"), sb.get("p95_ns")),
            }
        )
    ranks_a = {r["rank"]: r for r in ma["ranks"]}
    ranks_b = {r["rank"]: r for r in mb["ranks"]}
    ranks = []
    for rank in sorted(set(ranks_a) | set(ranks_b)):
        ra, rb = ranks_a.get(rank, {}), ranks_b.get(rank, {})
        ranks.append(
            {
                "rank": rank,
                **{
                    name: _pair(ra.get(name), rb.get(name))
                    for name in ("busy_ns", "p2p_wait_ns", "bubble_ns", "bubble_ratio")
                },
            }
        )
    return {
        "format": DIFF_FORMAT,
        "version": 1,
        "a": run_summary(a.run),
        "b": run_summary(b.run),
        "iteration_time_ns": _pair(
            ma["iteration_time"]["steady_mean_ns"], mb["iteration_time"]["steady_mean_ns"]
        ),
        "bubble_ratio": _pair(ma["bubble"]["measured_ratio"], mb["bubble"]["measured_ratio"]),
        "ideal_bubble_ratio": _pair(ma["bubble"]["ideal_ratio"], mb["bubble"]["ideal_ratio"]),
        "critical_path_ns": _pair(
            (ma["critical_path"] or {}).get("length_ns"),
            (mb["critical_path"] or {}).get("length_ns"),
        ),
        "stages": stages,
        "ranks": ranks,
        "findings": {"a": counts(a.findings), "b": counts(b.findings)},
    }


def _change(p: dict[str, float | None], fmt=ms) -> str:
    if p["delta"] is None:
        return ""
    pct = f" ({p['change']:+.1%})" if p["change"] is not None else ""
    sign = "+" if p["delta"] >= 0 else "-"
    return f"{sign}{fmt(abs(p['delta']))}{pct}"


def render(d: dict[str, Any], out: IO[str]) -> None:
    w = 14
    lines = [
        f"A: {d['a']['path']} ({(d['a']['schedule'] or {}).get('name', '?')}, {d['a']['world_size']} ranks)",
        f"B: {d['b']['path']} ({(d['b']['schedule'] or {}).get('name', '?')}, {d['b']['world_size']} ranks)",
        "",
        f"{'':<22}{'A':>{w}}{'B':>{w}}  change",
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
        f"{'findings (err/warn)':<22}{fa['error']:>{w - 4}}/{fa['warning']:<3}{fb['error']:>{w - 4}}/{fb['warning']:<3}"
    )
    lines += ["", "per stage mean step time:"]
    for s in d["stages"]:
        p = s["mean_ns"]
        label = f"{s['kind']}{'*' if s['overlapped'] else ''}"
        lines.append(
            f"  stage {s['stage']:>3} {label:<3}{'':<9}{ms(p['a']):>{w}}{ms(p['b']):>{w}}  {_change(p)}"
        )
    if any(s["overlapped"] for s in d["stages"]):
        lines.append("  (* inside OVERLAP_F_B composites)")
    lines += ["", "per rank bubble (mean per steady iteration):"]
    for r in d["ranks"][:64]:
        p = r["bubble_ns"]
        lines.append(
            f"  rank {r['rank']:>4}{'':<12}{ms(p['a']):>{w}}{ms(p['b']):>{w}}  {_change(p)}"
        )
    out.write("\n".join(lines) + "\n")
