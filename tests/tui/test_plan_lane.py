"""The planned lanes are the analysis's ideal timeline, not a second simulation."""

from __future__ import annotations

from pipetrace.analyze.ideal import IdealTimeline
from pipetrace.tui.plan_lane import planned_run
from pipetrace.tui.session import open_session


def test_planned_lanes_use_the_ideal_simulation(synthetic_run):
    session = open_session(synthetic_run, workers=0)
    ideal = session.analysis.summary.bubble.ideal
    assert session.planned is not None and session.plan_note == ""
    assert session.planned.makespan_ns == ideal.makespan_ns
    simulated = {(s.rank, s.step) for s in ideal.simulation.timeline}
    assert set(session.planned.lanes) == {rank for rank, _ in simulated}


def test_without_an_ideal_timeline_the_note_says_why(synthetic_run):
    session = open_session(synthetic_run, workers=0)
    missing = IdealTimeline("no plan", "meta.json has no readable plan")
    assert planned_run(session.run, session.analysis.metrics, missing) == (
        "meta.json has no readable plan"
    )
