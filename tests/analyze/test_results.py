"""The typed analysis results: computed once by `analyze`, each with its own JSON form."""

from __future__ import annotations

import io

from pipetrace.analyze.critical import CriticalPath, Segment
from pipetrace.analyze.ideal import ideal_timeline
from pipetrace.analyze.report import render
from pipetrace.schedule.builders import build_plan

from .conftest import analyzed


def test_the_json_metrics_are_the_summary_and_its_parts(clean_run):
    result = analyzed(clean_run)
    summary = result.summary
    metrics = result.to_json()["metrics"]
    assert metrics == summary.to_json()
    assert metrics["bubble"]["ideal"] == summary.bubble.ideal.to_json()
    assert metrics["critical_path"] == summary.critical_path.to_json()
    assert [s["kind"] for s in metrics["stages"]] == [s.kind for s in summary.stages]
    assert "segments" not in summary.to_json(segments=False)["critical_path"]


def test_the_report_prints_the_summary_numbers(clean_run):
    result = analyzed(clean_run)
    out = io.StringIO()
    render(result, out)
    bubble = result.summary.bubble
    assert f"measured {bubble.measured_ratio:.3f}, ideal {bubble.ideal.bubble_ratio:.3f}" in (
        out.getvalue()
    )
    assert f"{result.summary.critical_path.rank_hops} hops between ranks" in out.getvalue()


def test_the_ideal_timeline_says_why_it_is_unavailable():
    no_plan = ideal_timeline(None, {(0, "F"): 1.0})
    assert not no_plan.available
    assert no_plan.to_json() == {"available": False, "reason": "no plan"}
    no_costs = ideal_timeline(build_plan("1f1b", num_ranks=2, num_microbatches=2), {})
    assert no_costs.to_json() == {"available": False, "reason": "no measured step"}
    assert no_costs.simulation is None and no_costs.explanation


def test_the_ideal_timeline_keeps_its_simulation_and_takes_overrides():
    plan = build_plan("1f1b", num_ranks=2, num_microbatches=4)
    costs = {(s, k): 1.0 for s in range(2) for k in "FB"}
    ideal = ideal_timeline(plan, costs)
    assert ideal.available and ideal.simulation is not None
    assert ideal.makespan_ns == ideal.simulation.makespan
    assert len(ideal.per_rank_bubble_ratio) == 2
    slower = ideal_timeline(plan, costs, override={(1, "B"): 5.0})
    assert slower.makespan_ns > ideal.makespan_ns


def test_critical_path_totals_come_from_its_segments():
    segments = [
        Segment(0, 0, 10, "compute", "0F0", "F"),
        Segment(0, 10, 15, "p2p", "0SEND_F0", "SEND_F"),
        Segment(1, 15, 40, "compute", "1F0", "F"),
        Segment(1, 40, 42, "idle", None, None),
    ]
    path = CriticalPath.of(3, 0, 42, segments)
    assert path.length_ns == 42
    assert path.by_what_ns == {"compute": 35, "p2p": 5, "idle": 2}
    assert path.compute_by_kind_ns == {"F": 35}
    assert path.by_rank_ns == {0: 15, 1: 27}
    assert path.rank_hops == 1
    assert path.to_json()["by_rank_ns"] == {"0": 15, "1": 27}
    assert path.to_json()["segments"][2] == {
        "rank": 1,
        "start_ns": 15,
        "end_ns": 40,
        "what": "compute",
        "step": "1F0",
        "kind": "F",
    }
