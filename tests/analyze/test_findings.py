"""Faults injected into runs of the fake cluster (real Recorders on virtual time, the
runtime's fault kinds) are diagnosed with the right kind, ranks and micro-batches; clean runs
of every built-in schedule have nothing above info."""

from __future__ import annotations

import contextlib

import pytest

from pipetrace.analyze import findings as fk
from pipetrace.runtime.faults import (
    Crash,
    DropRecv,
    ExtraSend,
    ShapeMismatch,
    Straggler,
    SwapOrder,
)
from pipetrace.schedule.builders import build_plan
from pipetrace.testing.cluster import FakeCluster

from .conftest import STALL_AFTER_NS, analyzed, hang_in_3b1

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
    FakeCluster.of(schedule, ranks=4, microbatches=m, stages_per_rank=v).record(tmp_path)
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


@pytest.mark.parametrize("schedule,v,m", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_the_critical_path_hops_to_the_sender_at_each_message_it_waited_for(
    tmp_path, schedule, v, m
):
    """On virtual time each recv completes at its step's end, where the next step begins
    (one clock reading): the path must still follow the message to its sender, so it holds
    only compute and one transfer per hop, no waiting."""
    cluster = FakeCluster.of(schedule, ranks=4, microbatches=m, stages_per_rank=v)
    cluster.record(tmp_path)
    cp = analyzed(tmp_path).to_json()["metrics"]["critical_path"]
    assert cp["rank_hops"] > 0
    assert cp["by_what_ns"]["p2p"] == cp["rank_hops"] * cluster.costs.transfer_ns
    assert cp["by_what_ns"]["compute"] + cp["by_what_ns"]["p2p"] == cp["length_ns"]


def kinds(result):
    return {f.kind: f for f in result.findings}


def record_with(path, *faults, **options):
    """A 4-rank 1F1B run (4 micro-batches, 2 iterations) with ``faults``."""
    FakeCluster.of(faults=faults, **options).record(path)


DROP_1RECV_F2 = DropRecv(rank=1, step=0, microbatch=2, channel="F")
SWAP_0SEND_F1 = SwapOrder(rank=0, step=0, microbatch=1, channel="F")


def test_dropped_recv_is_an_unmatched_send_naming_the_receiver(tmp_path):
    record_with(tmp_path, DROP_1RECV_F2)
    found = kinds(analyzed(tmp_path))
    f = found[fk.UNMATCHED_SEND]
    assert f.severity == fk.ERROR and set(f.ranks) == {0, 1} and 2 in f.microbatches
    assert "1RECV_F2" in f.cause and "without posting" in f.cause


def test_dropped_recv_under_rendezvous_is_a_deadlock_plus_the_unmatched_send(tmp_path):
    record_with(tmp_path, DROP_1RECV_F2, semantics="rendezvous")
    found = kinds(analyzed(tmp_path))
    assert found[fk.DEADLOCK].details["cycle"] in ([0, 1], [1, 0])
    assert 2 in found[fk.UNMATCHED_SEND].microbatches


def test_extra_send_is_unmatched_and_called_a_duplicate(tmp_path):
    record_with(tmp_path, ExtraSend(rank=0, step=0, microbatch=1, channel="F"))
    f = kinds(analyzed(tmp_path))[fk.UNMATCHED_SEND]
    assert set(f.ranks) == {0, 1} and f.microbatches == [1] and "more than once" in f.cause
    assert [op["reason"] for op in f.details["ops"]] == [f.cause]  # not what the peer ran


def test_wrong_shape_is_a_message_mismatch(tmp_path):
    record_with(tmp_path, ShapeMismatch(rank=2, step=0, microbatch=1, channel="F", shape=(16, 32)))
    result = analyzed(tmp_path)
    f = kinds(result)[fk.MESSAGE_MISMATCH]
    assert set(f.ranks) == {2, 3} and f.microbatches == [1]
    assert f.details["send"]["shape"] == [16, 32] and f.details["recv"]["shape"] == [32, 32]
    assert [x.kind for x in result.findings if x.severity == fk.ERROR] == [fk.MESSAGE_MISMATCH]


def test_swapped_sends_are_an_order_crossing(tmp_path):
    record_with(tmp_path, SWAP_0SEND_F1)
    result = analyzed(tmp_path)
    f = kinds(result)[fk.ORDER_CROSSING]
    assert set(f.ranks) == {0, 1} and set(f.microbatches) == {1, 2}
    assert f.details["send_order"] == ["0SEND_F2", "0SEND_F1"]
    assert {x.kind for x in result.findings if x.severity == fk.ERROR} == {fk.ORDER_CROSSING}


def test_swapped_sends_under_rendezvous_deadlock(tmp_path):
    record_with(tmp_path, SWAP_0SEND_F1, semantics="rendezvous")
    f = kinds(analyzed(tmp_path))[fk.DEADLOCK]
    assert sorted(f.details["cycle"]) == [0, 1]
    blocked = f.details["blocked"]
    assert blocked["0"]["step"] == "0SEND_F2" and blocked["1"]["step"] == "1RECV_F1"


@pytest.mark.parametrize("factor", [5, 2])  # 2: the documented threshold, "≥ 2x", itself
def test_slow_rank_is_a_straggler_with_its_effect(tmp_path, factor):
    record_with(tmp_path, Straggler(rank=2, step=0, factor=factor, phase="all"))
    f = kinds(analyzed(tmp_path))[fk.STRAGGLER]
    assert f.ranks == [2] and f.details["stage"] == 2 and f.severity == fk.WARNING
    assert f.details["effect_fraction"] > 0.1


def test_raising_rank_fails_and_the_others_stall_behind_it(tmp_path):
    record_with(tmp_path, Crash(rank=2, step=0, microbatch=1, phase="F"))
    result = analyzed(tmp_path)
    found = kinds(result)
    failed = found[fk.RANK_FAILED]
    assert failed.ranks == [2] and "injected crash" in failed.message
    assert failed.steps[0].step == "2F1"
    stalled = found[fk.RANK_STALLED]
    assert stalled.details["terminal_rank"] == 2 and stalled.details["terminal_state"] == "crashed"
    assert result.findings[0].kind == fk.RANK_FAILED  # the root cause first
    assert {f.kind for f in result.findings if f.severity == fk.ERROR} == {
        fk.RANK_FAILED,
        fk.RANK_STALLED,
    }


def test_blocked_rank_ends_the_wait_chain_as_computing(tmp_path):
    record_with(tmp_path, hang_in_3b1(), stall_after_ns=STALL_AFTER_NS)
    result = analyzed(tmp_path)
    f = kinds(result)[fk.RANK_STALLED]
    assert f.details["terminal_rank"] == 3 and f.details["terminal_state"] == "computing"
    assert f.details["chain"] == [0, 1, 2, 3] and "3B1" in f.message
    assert {r.status.state for r in result.run.ranks} <= {"ended", "stalled"}


def test_rank_given_another_plan_is_a_plan_divergence(tmp_path):
    steps = build_plan("1f1b", num_ranks=4, num_microbatches=4, comms=True).steps(1)
    steps[1], steps[2] = steps[2], steps[1]  # rank 1 was launched with another plan
    record_with(tmp_path, rank_steps={1: steps})
    f = kinds(analyzed(tmp_path))[fk.PLAN_DIVERGENCE]
    assert f.ranks == [1] and f.severity == fk.ERROR and f.details["position"] == 1


def test_rank_0_given_another_plan_than_the_rest_is_the_one_named(tmp_path):
    """meta.json holds rank 0's plan: when rank 0 is the odd one, every other rank differs
    from it, and rank 0 is named, not the three that agree with each other."""
    other = build_plan("gpipe", num_ranks=4, num_microbatches=4, comms=True)
    record_with(tmp_path, rank_steps={r: other.steps(r) for r in (1, 2, 3)})
    divergent = [f for f in analyzed(tmp_path).findings if f.kind == fk.PLAN_DIVERGENCE]
    (f,) = [f for f in divergent if f.details["source"] == "meta"]
    assert f.severity == fk.ERROR and f.ranks == [0, 1, 2, 3] and f.details["odd_rank"] == 0
    assert f.message.startswith("rank 0 ran a different plan than the other ranks: 3 of the 3")


def test_the_ranks_endings_are_read_once_per_analysis(hung_run, monkeypatch):
    """Several analyzers (and each stalled chain) ask for every rank's verdict: `analyze`
    reads them once, and the findings are those of reading them at each call."""
    from pipetrace.analyze import endings
    from pipetrace.analyze.analysis import analyze
    from pipetrace.analyze.load import load_run

    run = load_run(hung_run, workers=0)
    read = endings._endings
    reads = []
    monkeypatch.setattr(endings, "_endings", lambda r: reads.append(r) or read(r))
    once = analyze(run).to_json()
    assert reads == [run]
    monkeypatch.setattr(endings, "endings_kept", lambda r: contextlib.nullcontext())
    monkeypatch.setattr("pipetrace.analyze.analysis.endings_kept", endings.endings_kept)
    assert analyze(run).to_json() == once and len(reads) > 2
    assert endings.rank_endings(run) == read(run) and not endings._KEPT


def test_per_stage_step_times_leave_out_the_first_iteration_once_a_later_one_completed(
    tmp_path,
):
    """Its steps pay for start-up, as the steady iteration time leaves it out: 4 F and 4 B
    per stage of the second iteration, not 8."""
    FakeCluster.of("1f1b", ranks=4, microbatches=4, iterations=2).record(tmp_path)
    stages = analyzed(tmp_path).to_json()["metrics"]["stages"]
    assert len(stages) == 8 and {s["count"] for s in stages} == {4}


def test_a_loss_that_became_nan_is_an_error_from_its_first_iteration(tmp_path):
    """JSON has no NaN: the recorder writes the loss as null with ``nonfinite``, which
    without this finding reads as a rank that recorded no loss."""
    nan, inf = float("nan"), float("inf")
    FakeCluster.of(iterations=4, losses=[0.5, nan, inf, nan]).record(tmp_path)
    log = (tmp_path / "rank-00003.ndjson").read_text()
    assert '"loss":null,"nonfinite":"nan"' in log and '"nonfinite":"inf"' in log
    result = analyzed(tmp_path)
    (f,) = [f for f in result.findings if f.kind == fk.NONFINITE_LOSS]
    assert f.severity == fk.ERROR and f.ranks == [3] and f.iterations == [1, 2, 3]
    assert (
        f.message
        == "the loss was nan in iteration 1 on rank 3 (the last stage), and in 2 later iteration(s)"
    )
    FakeCluster.of(iterations=2).record(tmp_path / "clean")
    assert not [f for f in analyzed(tmp_path / "clean").findings if f.kind == fk.NONFINITE_LOSS]


def test_a_rank_without_a_log_that_its_peers_exchanged_messages_with_ran(tmp_path):
    """An empty log (kill -9 before the first flush) is no rank that never started: its
    peers completed messages with it."""
    FakeCluster.of(ranks=4, iterations=2).record(tmp_path)
    (tmp_path / "rank-00002.ndjson").write_bytes(b"")
    (missing,) = [f for f in analyzed(tmp_path).findings if f.kind == fk.RANK_FAILED]
    assert missing.ranks == [2]
    assert missing.cause.startswith(
        "the rank ran (rank 3 completed messages with it until iteration 1)"
    )
