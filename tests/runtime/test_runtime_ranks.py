"""Real ranks: every built-in schedule on 2 and 4 ranks, plain and overlapped P2P, against a
single-process reference; what the recorder is told; a failing rank; an FSDP-sharded run.

Each rank costs ~2 s to start, so each test is one launch that runs many configurations
one after the other in the same process group.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from runtime_helpers import RecorderFiles, read_events, sabotage_forward

from pipetrace.runtime.config import RunConfig
from pipetrace.runtime.launch import launch
from pipetrace.schedule.ir import Plan, parse_step
from pipetrace.testing.cases import parity_case
from tests.ranks import alive, children_of_this_process

pytestmark = pytest.mark.multiproc

SCHEDULES = [
    ("gpipe", None),
    ("1f1b", None),
    ("interleaved-1f1b", 2),
    ("zb1p", 1),
    ("zbv", 2),
    ("dualpipev", 2),
]


def every_schedule(ranks: int) -> list[RunConfig]:
    return [
        parity_case(name, ranks, v, overlap_p2p=overlap)
        for name, v in SCHEDULES
        for overlap in (False, True)
    ]


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_schedule_matches_single_process(ranks, tmp_path):
    cases = every_schedule(ranks)
    result = launch(cases, make_recorder=RecorderFiles(tmp_path))
    assert result.ok, [(f.rank, f.error, f.traceback) for f in result.failures]
    for index, case in enumerate(cases):
        label = f"{case.schedule} {'overlap' if case.overlap_p2p else 'plain'}"
        reports = [result.results[rank][index].parity for rank in range(ranks)]
        assert all(r is not None and r.ok for r in reports), (label, reports)
        assert sum(r.compared for r in reports) == 1 + 2 * 2 * case.plan().num_stages, label
        losses = [result.results[rank][index].losses for rank in range(ranks)]
        reporting = [loss for loss in losses if loss is not None]
        assert len(reporting) == 1 and len(reporting[0]) == 2, label
    for index in range(0, len(cases), 2):  # plain and overlapped P2P compute the same numbers
        plain = [result.results[r][index].losses for r in range(ranks)]
        overlapped = [result.results[r][index + 1].losses for r in range(ranks)]
        assert plain == overlapped
    for index, case in enumerate(cases):
        check_recording(tmp_path, index, case)
        if not case.overlap_p2p:
            check_recvs_in_own_step(tmp_path, index, case)


def check_recvs_in_own_step(directory: Path, index: int, case: RunConfig) -> None:
    """Plain mode, recvs posted ahead on gloo (`pipetrace.runtime.recv_ahead`): the trace
    still shows each recv posted and done inside its own RECV step."""
    for rank in range(case.ranks):
        main: dict[int, str] = {}  # token -> step, of the steps open on the main thread
        recvs: dict[int, dict] = {}  # token -> its p2p_posted event
        for event in read_events(directory / f"rank{rank}-case{index}.jsonl"):
            kind = event["event"]
            open_step = next(reversed(main.values()), None)
            if kind == "begin_step" and event["thread"] == "main":
                main[event["token"]] = event["step"]
            elif kind == "end_step":
                main.pop(event["begin"], None)
            elif kind == "p2p_posted" and event["op"] == "recv":
                assert open_step == event["step"], (case.schedule, rank, event)
                recvs[event["token"]] = event
            elif kind == "p2p_completed" and event["posted"] in recvs:
                assert open_step == recvs[event["posted"]]["step"], (case.schedule, rank, event)


def check_recording(directory: Path, index: int, case: RunConfig) -> None:
    """Steps in plan order with positions that skip bubbles, every P2P op posted and
    completed, sequence numbers per (op, peer, channel) from 0 each iteration, and each send
    matching a recv on its peer with the same size, shape and dtype."""
    plan = case.plan()
    ops: dict[tuple[int, str, int, str, int, int], dict] = {}
    for rank in range(case.ranks):
        events = read_events(directory / f"rank{rank}-case{index}.jsonl")
        assert events[0]["event"] == "begin_run" and events[0]["rank"] == rank
        assert Plan.from_json(events[0]["plan"]).ranks == plan.ranks
        assert events[-1]["event"] == "end_run"
        assert not [e for e in events if e["event"] == "exception"]
        expected = [str(s) for s in plan.steps(rank)]
        iteration = -1
        begun: dict[int, dict] = {}
        completed: set[int] = set()
        for event in events:
            kind = event["event"]
            if kind == "begin_iteration":
                iteration = event["iteration"]
                positions: list[int] = []
                seqs: Counter = Counter()
            elif kind == "begin_step":
                begun[event["token"]] = event
                assert (
                    expected[event["position"]] == event["step"]
                    or event["thread"] != "main"
                    or "(" in expected[event["position"]]
                )
                if event["step"] == expected[event["position"]]:
                    positions.append(event["position"])
            elif kind == "p2p_posted":
                key = (event["op"], event["peer"], event["channel"])
                assert event["seq"] == seqs[key]
                seqs[key] += 1
                ops[
                    (rank, event["op"], event["peer"], event["channel"], iteration, event["seq"])
                ] = event
            elif kind == "p2p_completed":
                completed.add(event["posted"])
            elif kind == "end_iteration":
                assert positions == list(range(len(expected)))
                assert (event["loss"] is not None) == (plan.placement[-1] == rank)
        posted = {e["token"] for (r, *_), e in ops.items() if r == rank}
        assert posted == completed & posted
        assert not set(begun) - {e["begin"] for e in events if e["event"] == "end_step"}
    sends = {k: e for k, e in ops.items() if k[1] == "send"}
    recvs = {k: e for k, e in ops.items() if k[1] == "recv"}
    assert len(sends) == len(recvs) > 0
    for (rank, _, peer, channel, iteration, seq), send in sends.items():
        recv = recvs[(peer, "recv", rank, channel, iteration, seq)]
        assert (send["nbytes"], send["shape"], send["dtype"]) == (
            recv["nbytes"],
            recv["shape"],
            recv["dtype"],
        )
        sent, received = parse_step(send["step"]), parse_step(recv["step"])
        delta = 1 if channel == "F" else -1
        assert (received.stage, received.microbatch) == (sent.stage + delta, sent.microbatch)


def test_a_failing_rank_stops_every_rank(tmp_path):
    """Rank 2 raises in iteration 1; rank 3 sees its peer vanish and fails; rank 0 is stuck
    in Python and rank 1 waits on it, so both are killed after the grace period. Nothing is
    left running."""
    case = RunConfig(schedule="1f1b", ranks=4, microbatches=4, steps=3, timeout=300)
    start = time.monotonic()
    result = launch(
        [case],
        make_recorder=RecorderFiles(tmp_path),
        custom_functions=[("F", sabotage_forward)],
        kill_grace=2.0,
    )
    elapsed = time.monotonic() - start
    assert not result.ok
    first = result.failures[0]
    assert (first.rank, first.error) == (2, "RuntimeError: injected failure in 2F0")
    assert "sabotage_forward" in first.traceback
    by_rank = {f.rank: f for f in result.failures}
    assert sorted(by_rank) == [0, 1, 2, 3]
    assert by_rank[0].error == by_rank[1].error == "killed: still running 2 s after rank 2 failed"
    assert "Connection closed by peer" in by_rank[3].error
    assert elapsed < case.timeout  # nobody waited for the process-group timeout
    assert result.failures[-1].at - first.at < 2.0 + 3.0  # all stopped within the grace (+ slack)
    assert not [pid for pid in result.pids if alive(pid)]
    assert not children_of_this_process()
    failed_log = read_events(tmp_path / "rank2-case0.jsonl")
    assert failed_log[-1] == {
        **failed_log[-1],
        "event": "exception",
        "error": "RuntimeError: injected failure in 2F0",
    }


def test_fsdp_sharded_stages_match_single_process():
    """P=2 pipeline x D=2 replicas, each stage sharded with FSDP2 over its replicas (gloo on
    CPU): UNSHARD/RESHARD/REDUCE_GRAD run for real and gradients match the reference."""
    cases = [
        RunConfig(
            schedule=name,
            ranks=2,
            microbatches=4,
            steps=2,
            data_parallel=2,
            fsdp=True,
            check_parity=True,
        )
        for name in ("1f1b", "zb1p", "dualpipev")
    ]
    result = launch(cases)
    assert result.ok, [(f.rank, f.error, f.traceback) for f in result.failures]
    for index in range(len(cases)):
        reports = [result.results[rank][index].parity for rank in range(4)]
        assert all(r is not None and r.ok for r in reports), reports
        losses = [result.results[rank][index].losses for rank in range(4)]
        last_stage_rank = cases[index].plan().placement[-1]  # in replica 0, ranks 0..P-1
        assert [rank for rank, loss in enumerate(losses) if loss is not None] == [last_stage_rank]
