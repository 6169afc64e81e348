"""Device timing end to end on CPU: runs recorded through fake devices
(`pipetrace.testing.device_replay`), loaded and analyzed as `pipetrace analyze` does."""

from __future__ import annotations

import io

import orjson
import pytest

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.device_times import DEVICE, HOST
from pipetrace.analyze.load import load_run
from pipetrace.analyze.model import OPEN
from pipetrace.analyze.report import render
from pipetrace.runtime.faults import Hang
from pipetrace.testing.cluster import FakeCluster
from pipetrace.testing.device_replay import (
    SLOW_F_NS,
    quick,
    record_device_run,
    slow_forward_on_rank_1,
)
from pipetrace.testing.fake_device import NEVER

MS = 1_000_000
"""Rank 1's forward kernels: three times the host's 1 ms forward step (device-bound)."""


def report(analysis) -> str:
    out = io.StringIO()
    render(analysis, out)
    return out.getvalue()


@pytest.fixture(scope="module")
def launch_bound(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("device") / "launch-bound"
    record_device_run(run_dir, quick)
    return analyze(load_run(run_dir, workers=0))


def test_every_step_and_op_is_joined_to_its_device_times(launch_bound):
    for rank in launch_bound.run.ranks:
        ended = rank.steps.end != OPEN
        assert (rank.steps.dbegin[ended] != OPEN).all()
        assert (rank.steps.dend[ended] >= rank.steps.dbegin[ended]).all()
        assert (rank.p2p.dend != OPEN).all()
        # the device cannot start a step before the host began enqueuing it (within the
        # float32 resolution of CUDA's elapsed times, far below 1 µs over a run this short)
        early = rank.steps.begin[ended] - rank.steps.dbegin[ended]
        assert early.max() < 1_000


def test_the_analysis_says_it_used_device_times_and_steps_kept_up(launch_bound):
    timing = launch_bound.to_json()["metrics"]["timing"]
    assert timing["source"] == DEVICE
    for rank in timing["ranks"]:
        assert rank["source"] == DEVICE
        assert rank["device_steps"] > 0 and rank["device_bound_steps"] == 0
    assert timing["device_pending"] == []
    assert "times: device" in report(launch_bound)


def test_a_step_whose_kernels_ran_long_after_it_was_enqueued_is_device_bound(tmp_path):
    record_device_run(tmp_path, slow_forward_on_rank_1)
    analysis = analyze(load_run(tmp_path, workers=0))
    ranks = {r["rank"]: r for r in analysis.to_json()["metrics"]["timing"]["ranks"]}
    assert ranks[0]["device_bound_steps"] == 0
    assert ranks[1]["device_bound_steps"] > 0
    assert ranks[1]["worst_step"].startswith("1F")
    # the metrics use the device's 3 ms forwards, not the host's 1 ms enqueue time
    costs = {(s["stage"], s["kind"]): s for s in analysis.to_json()["metrics"]["stages"]}
    assert costs[(1, "F")]["min_ns"] >= SLOW_F_NS
    assert costs[(0, "F")]["max_ns"] < SLOW_F_NS
    assert "device-bound" in report(analysis)


def test_work_that_never_completed_on_the_device_is_named_from_the_stall(tmp_path):
    def hangs_in_1b1(rank: int, iteration: int, text: str) -> float:
        return NEVER if (rank, iteration, text) == (1, 1, "1B1") else quick(rank, iteration, text)

    stuck = Hang(rank=1, step=1, microbatch=3, phase="F")
    record_device_run(tmp_path, hangs_in_1b1, faults=[stuck], stall_after_ns=41_000 * MS)
    analysis = analyze(load_run(tmp_path, workers=0))
    (pending,) = analysis.summary.timing.device_pending
    assert pending.rank == 1 and pending.work.label == "1B1"
    assert pending.behind > 0  # what rank 1 enqueued after it waits behind it
    message = "rank 1: 1B1 enqueued 4"
    assert pending.message.startswith(message)
    assert pending.message.endswith("s ago, started on the device but never completed")
    assert message in report(analysis)
    stall = analysis.run.ranks[1].last_of("stall")
    assert stall is not None and stall.fields["device_pending"][0]["step"] == "1B1"


def test_a_run_without_device_times_says_host(tmp_path):
    FakeCluster.of(ranks=2, microbatches=2, iterations=1).record(tmp_path)
    analysis = analyze(load_run(tmp_path, workers=0))
    timing = analysis.to_json()["metrics"]["timing"]
    assert timing["source"] == HOST
    assert {r["source"] for r in timing["ranks"]} == {HOST}
    assert "times: host" in report(analysis)


def test_messages_are_aligned_by_device_times_when_the_host_never_waited(tmp_path):
    """An NCCL ``wait()`` returns at once: a recv's host `p2p_done` may precede its send's
    post on the peer. With the ops timed on the device, the clocks are checked against the
    send's device begin and the recv's device end, so such a run reads clean."""
    record_device_run(tmp_path, quick)
    for log in tmp_path.glob("rank-*.ndjson"):
        lines = [orjson.loads(line) for line in log.read_bytes().splitlines()]
        recvs = {e["id"]: e["t"] for e in lines if e.get("e") == "p2p_post" and e["op"] == "recv"}
        for event in lines:
            if event.get("e") == "p2p_done" and event["id"] in recvs:
                event["t"] = recvs[event["id"]]  # the host's wait returned as it was posted
        log.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in lines))
    run = load_run(tmp_path, workers=0, cache=False)
    assert not [p.message for p in run.problems if "clocks" in p.message]
    quality = analyze(run).to_json()["metrics"]["clocks"]
    assert quality["feasible"] and quality["message_pairs_checked"] > 0


def test_impossible_device_times_are_damage_not_metrics(tmp_path):
    """A device span that ends before it begins, a negative one, one an hour before its
    step was launched, a second span for an id and one for an id never begun: each is
    reported, and none of them reaches the step's times."""
    record_device_run(tmp_path, quick)
    log = tmp_path / "rank-00001.ndjson"
    lines = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    device = [e for e in lines if e.get("e") == "device"]
    ended_before, negative, early, twice = device[:4]
    ended_before["de"] = ended_before["db"] - 1
    negative["db"] = -5
    early["db"] -= 3600 * 10**9
    lines += [{**twice, "de": twice["de"] + 10**9}, {**twice, "id": 10**9}]
    log.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in lines))
    run = load_run(tmp_path, workers=0, cache=False)
    messages = [p.message for p in run.problems if p.rank == 1]
    for damage in (
        "2 corrupt line(s) skipped",
        "1 event(s) with a value outside its documented set",
        "1 id(s) begun or completed more than once",
        "1 completion(s) of an id the log never began",
    ):
        assert any(damage in m for m in messages), (damage, messages)
    rank = run.ranks[1]
    for table, launched in ((rank.steps, rank.steps.begin), (rank.p2p, rank.p2p.post)):
        timed = table.dbegin != OPEN
        assert (table.dbegin[timed] >= launched[timed] - 1_000).all()  # none an hour early
        assert (table.dend - table.dbegin)[timed].max() < 10**9  # the first span of an id


def test_a_run_that_ended_with_device_work_never_completed_is_a_device_hang(tmp_path):
    """Every host finished and closed the recording, but rank 1's device never got through
    1B1: the drain gave up and listed it in run_end. Without this finding the run read as
    clean (exit 0)."""

    def hangs_in_1b1(rank: int, iteration: int, text: str) -> float:
        return NEVER if (rank, iteration, text) == (1, 1, "1B1") else quick(rank, iteration, text)

    record_device_run(tmp_path, hangs_in_1b1)
    analysis = analyze(load_run(tmp_path, workers=0))
    assert {r.status.state for r in analysis.run.ranks} == {"finished"}
    (hang,) = [f for f in analysis.findings if f.severity == "error"]
    assert hang.kind == "device_hang" and hang.ranks == [1]
    assert "rank 1: 1B1 enqueued" in hang.message and hang.steps[0].step == "1B1"
