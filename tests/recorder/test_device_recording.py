"""Device timing end to end on CPU: runs recorded through fake devices
(`pipetrace.testing.device_replay`), loaded and analyzed as `pipetrace analyze` does."""

from __future__ import annotations

import io

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
