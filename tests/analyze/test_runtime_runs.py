"""Runs recorded by the real torch runtime (`pipetrace.runtime.launch`, gloo on local ranks,
the real recorder), with faults injected through `register_custom_function`."""

from __future__ import annotations

import pytest

from pipetrace.analyze import findings as fk
from pipetrace.schedule.ir import StepKind
from tests.ranks import BlockAt, RaiseAt, SlowRank, SwapSends

from . import runtime_faults as rf
from .conftest import analyzed, untimed_problems

pytestmark = pytest.mark.multiproc

SCHEDULES = [
    ("gpipe", None, False),
    ("1f1b", None, True),
    ("interleaved-1f1b", 2, False),
    ("zb1p", None, True),
    ("zbv", 2, False),
    ("dualpipev", 2, True),
]


def test_clean_runs_of_every_schedule(tmp_path):
    configs = [
        dict(schedule=s, microbatches=8, steps=2, stages_per_rank=v, overlap_p2p=o)
        for s, v, o in SCHEDULES
    ]
    result = rf.run_many(tmp_path, configs, ranks=4)
    assert not result.failures
    for i, (schedule, _, overlap) in enumerate(SCHEDULES):
        analysis = analyzed(tmp_path / f"case-{i}")
        assert untimed_problems(analysis.findings) == [], schedule
        assert {r.status.state for r in analysis.run.ranks} == {"finished"}
        assert all((r.p2p.match_rank >= 0).all() for r in analysis.run.ranks), schedule
        metrics = analysis.to_json()["metrics"]
        assert metrics["overlap_mode"] == overlap, schedule
        assert metrics["bubble"]["ideal"]["available"] and metrics["critical_path"]["length_ns"] > 0
        assert analysis.run.clock_quality["feasible"]


def test_straggler_rank(tmp_path):
    custom = [(StepKind.F, SlowRank(1, 0.01)), (StepKind.B, SlowRank(1, 0.02))]
    rf.run(tmp_path, ranks=2, microbatches=4, steps=2, custom=custom)
    analysis = analyzed(tmp_path)
    stragglers = [f for f in analysis.findings if f.kind == fk.STRAGGLER]
    assert [(f.ranks, f.severity) for f in stragglers] == [([1], fk.WARNING)]
    assert not [f for f in analysis.findings if f.severity == fk.ERROR]


def test_stage_0s_empty_dx_steps_make_no_straggler_of_the_others(tmp_path):
    """Stage 0 has no input gradient: its I steps are empty, ~50x cheaper than any other
    stage's, by design (a clean zb1p run on 2 ranks read as a straggler warning)."""
    rf.run(tmp_path, schedule="zb1p", ranks=2, microbatches=8, steps=3)
    analysis = analyzed(tmp_path)
    costs = {(s["stage"], s["kind"]): s["mean_ns"] for s in analysis.to_json()["metrics"]["stages"]}
    assert costs[(1, "I")] > 5 * costs[(0, "I")]  # what the comparison must not read as slow
    assert not [
        f for f in analysis.findings if f.kind == fk.STRAGGLER and "I" in f.details["kinds"]
    ]


def test_raising_rank_is_the_first_failure(tmp_path):
    rf.run(tmp_path, ranks=2, microbatches=4, steps=2, custom=[(StepKind.F, RaiseAt(1, "1F1"))])
    analysis = analyzed(tmp_path)
    first = analysis.findings[0]
    assert first.kind == fk.RANK_FAILED and first.ranks == [1]
    assert "injected failure in 1F1" in first.message and first.steps[0].step == "1F1"
    others = [f for f in analysis.findings if f.kind == fk.RANK_FAILED and f.ranks != [1]]
    assert all("follows rank 1's failure" in f.cause for f in others)


def test_swapped_sends_deadlock_on_gloo(tmp_path):
    swap = SwapSends(0, "0SEND_F1", "0SEND_F2")
    rf.run(
        tmp_path, ranks=2, microbatches=4, steps=1, timeout=4.0, custom=[(StepKind.SEND_F, swap)]
    )
    analysis = analyzed(tmp_path)
    # 1F1B on 2 ranks: rank 0 holds 0SEND_F1 back until 0SEND_F2, which comes after 0RECV_B0;
    # rank 1 needs micro-batch 1 before it can send B0: a cycle. Both ranks' gloo waits then
    # time out, which is a symptom (warning), not the cause.
    seen = [(f.severity, f.kind, f.message, f.cause) for f in analysis.findings]
    assert analysis.findings[0].kind == fk.DEADLOCK, seen  # the findings, should it fail
    deadlock = analysis.findings[0]
    assert sorted(deadlock.details["cycle"]) == [0, 1]
    assert deadlock.details["blocked"]["0"]["step"] == "0RECV_B0"
    assert deadlock.details["blocked"]["1"]["step"] == "1RECV_F1"
    timeouts = [f for f in analysis.findings if f.kind == fk.RANK_FAILED]
    # each rank's wait times out, or the second one sees the first one's connection close
    assert timeouts and all(f.severity == fk.WARNING for f in timeouts)
    assert all("symptom" in f.cause or "follows rank" in f.cause for f in timeouts)
    unmatched = next(f for f in analysis.findings if f.kind == fk.UNMATCHED_RECV)
    assert "0SEND_F1 without posting" in unmatched.cause


def test_rank_that_never_returns_ends_the_wait_chain(tmp_path):
    # 2 s + 2 s: rank 1 must not give up on a rank 0 that starts late on a busy host (a 3 s
    # skew was seen under overload) before it gets to 1B1
    rf.run(
        tmp_path,
        ranks=2,
        microbatches=4,
        steps=1,
        custom=[(StepKind.B, BlockAt(1, "1B1"))],
        stall_timeout=2.0,
        abort_timeout=2.0,
    )
    analysis = analyzed(tmp_path)
    stalled = next(f for f in analysis.findings if f.kind == fk.RANK_STALLED)
    assert stalled.details["chain"] == [0, 1] and stalled.details["terminal_state"] == "computing"
    assert "1B1" in stalled.message
    assert analysis.run.ranks[1].status.state == "aborted"


def test_peer_that_gave_up_before_the_sender_came_is_no_deadlock(tmp_path):
    # rank 0 computes 0F0 for 4 s (its watchdog is patient); rank 1's ends it in 1RECV_F0
    # (still exchanging the first message's shape) after 2 s; rank 0 then sends to a closed
    # connection. Both logs end in the two sides of one message: no cycle of waits, a peer
    # that left before the sender came.
    rf.run(
        tmp_path,
        ranks=2,
        microbatches=4,
        steps=1,
        custom=[(StepKind.F, SlowRank(0, 4.0))],
        stall_timeout=(30.0, 1.0),
        abort_timeout=(30.0, 1.0),
        # the launcher must not end rank 0 before it gets to its send (on a loaded host its
        # start and its 4 s step can take longer than rank 1's 2 s and a short grace)
        kill_grace=15.0,
    )
    analysis = analyzed(tmp_path)
    seen = [(f.severity, f.kind, f.message, f.cause) for f in analysis.findings]
    assert not [f for f in analysis.findings if f.kind == fk.DEADLOCK], seen
    stalled = analysis.findings[0]
    assert stalled.kind == fk.RANK_STALLED and sorted(stalled.ranks) == [0, 1], seen
    assert stalled.details["terminal_state"] == "transfer"
    assert "rank 1's log ends (aborted)" in stalled.cause and "0SEND_F0" in stalled.message
    failed = [f for f in analysis.findings if f.kind == fk.RANK_FAILED]
    assert [(f.ranks, f.severity) for f in failed] == [([0], fk.WARNING)], seen
