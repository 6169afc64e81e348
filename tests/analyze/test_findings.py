"""Faults injected into runs recorded through the real Recorder are diagnosed with the right
kind, ranks and micro-batches; clean runs of every built-in schedule have nothing above info."""

from __future__ import annotations

import pytest

from pipetrace.analyze import findings as fk

from .conftest import analyzed
from .driver import Fault, record_run

SCHEDULES = [
    ("gpipe", None, 4),
    ("1f1b", None, 4),
    ("interleaved-1f1b", 2, 4),
    ("zb1p", None, 4),
    ("zbv", 2, 4),
    ("dualpipev", 2, 8),
]


@pytest.mark.parametrize("schedule,v,m", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_clean_runs_have_no_finding_above_info(tmp_path, schedule, v, m):
    record_run(
        tmp_path, schedule=schedule, ranks=4, microbatches=m, stages_per_rank=v, compute_s=0.0005
    )
    result = analyzed(tmp_path)
    assert [f.kind for f in result.findings if f.severity != fk.INFO] == []
    assert not result.run.problems
    metrics = result.to_json()["metrics"]
    assert metrics["bubble"]["ideal"]["available"]
    assert metrics["bubble"]["measured_ratio"] > 0
    assert all(it["complete"] for it in metrics["iterations"])
    stages = {(s["stage"], s["kind"]) for s in metrics["stages"]}
    assert len({s for s, _ in stages}) == result.run.plan.num_stages
    cp = metrics["critical_path"]
    assert cp["length_ns"] == pytest.approx(cp["end_ns"] - cp["start_ns"], rel=0.01)


def kinds(result):
    return {f.kind: f for f in result.findings}


def test_dropped_recv_is_an_unmatched_send_naming_the_receiver(tmp_path):
    record_run(tmp_path, faults=[Fault("drop_recv", 1, "1RECV_F2")])
    found = kinds(analyzed(tmp_path))
    f = found[fk.UNMATCHED_SEND]
    assert f.severity == fk.ERROR and set(f.ranks) == {0, 1} and 2 in f.microbatches
    assert "1RECV_F2" in f.cause and "without posting" in f.cause


def test_dropped_recv_under_rendezvous_is_a_deadlock_plus_the_unmatched_send(tmp_path):
    record_run(tmp_path, faults=[Fault("drop_recv", 1, "1RECV_F2")], rendezvous=True, timeout=0.5)
    found = kinds(analyzed(tmp_path))
    assert found[fk.DEADLOCK].details["cycle"] in ([0, 1], [1, 0])
    assert 2 in found[fk.UNMATCHED_SEND].microbatches


def test_extra_send_is_unmatched_and_called_a_duplicate(tmp_path):
    record_run(tmp_path, faults=[Fault("extra_send", 0, "0SEND_F1")])
    f = kinds(analyzed(tmp_path))[fk.UNMATCHED_SEND]
    assert set(f.ranks) == {0, 1} and f.microbatches == [1] and "more than once" in f.cause


def test_wrong_shape_is_a_message_mismatch(tmp_path):
    record_run(tmp_path, faults=[Fault("wrong_shape", 2, "2SEND_F1")])
    result = analyzed(tmp_path)
    f = kinds(result)[fk.MESSAGE_MISMATCH]
    assert set(f.ranks) == {2, 3} and f.microbatches == [1]
    assert f.details["send"]["shape"] == [8, 8] and f.details["recv"]["shape"] == [4, 4]
    assert [x.kind for x in result.findings if x.severity == fk.ERROR] == [fk.MESSAGE_MISMATCH]


def test_swapped_sends_are_an_order_crossing(tmp_path):
    record_run(tmp_path, faults=[Fault("swap_sends", 0, "0SEND_F1")])
    result = analyzed(tmp_path)
    f = kinds(result)[fk.ORDER_CROSSING]
    assert set(f.ranks) == {0, 1} and set(f.microbatches) == {1, 2}
    assert f.details["send_order"] == ["0SEND_F2", "0SEND_F1"]
    assert {x.kind for x in result.findings if x.severity == fk.ERROR} == {fk.ORDER_CROSSING}


def test_swapped_sends_under_rendezvous_deadlock(tmp_path):
    record_run(tmp_path, faults=[Fault("swap_sends", 0, "0SEND_F1")], rendezvous=True, timeout=0.5)
    f = kinds(analyzed(tmp_path))[fk.DEADLOCK]
    assert sorted(f.details["cycle"]) == [0, 1]
    blocked = f.details["blocked"]
    assert blocked["0"]["step"] == "0SEND_F2" and blocked["1"]["step"] == "1RECV_F1"


def test_slow_rank_is_a_straggler_with_its_effect(tmp_path):
    record_run(tmp_path, faults=[Fault("slow", 2, factor=5)], compute_s=0.002)
    f = kinds(analyzed(tmp_path))[fk.STRAGGLER]
    assert f.ranks == [2] and f.details["stage"] == 2 and f.severity == fk.WARNING
    assert f.details["effect_fraction"] > 0.1


def test_raising_rank_fails_and_the_others_stall_behind_it(tmp_path):
    record_run(tmp_path, faults=[Fault("raise", 2, "2F1")], timeout=0.5)
    result = analyzed(tmp_path)
    found = kinds(result)
    failed = found[fk.RANK_FAILED]
    assert failed.ranks == [2] and "injected failure" in failed.message
    assert failed.steps[0].step == "2F1"
    stalled = found[fk.RANK_STALLED]
    assert stalled.details["terminal_rank"] == 2 and stalled.details["terminal_state"] == "crashed"
    assert result.findings[0].kind == fk.RANK_FAILED  # the root cause first
    assert {f.kind for f in result.findings if f.severity == fk.ERROR} == {
        fk.RANK_FAILED,
        fk.RANK_STALLED,
    }


def test_blocked_rank_ends_the_wait_chain_as_computing(tmp_path):
    record_run(tmp_path, faults=[Fault("block", 3, "3B1")], timeout=0.8, stall_timeout=0.3)
    result = analyzed(tmp_path)
    f = kinds(result)[fk.RANK_STALLED]
    assert f.details["terminal_rank"] == 3 and f.details["terminal_state"] == "computing"
    assert f.details["chain"] == [0, 1, 2, 3] and "3B1" in f.message
    assert {r.status.state for r in result.run.ranks} <= {"ended", "stalled"}


def test_rank_given_another_plan_is_a_plan_divergence(tmp_path):
    record_run(tmp_path, faults=[Fault("plan", 1, positions=(1, 2))])
    f = kinds(analyzed(tmp_path))[fk.PLAN_DIVERGENCE]
    assert f.ranks == [1] and f.severity == fk.ERROR and f.details["position"] == 1
