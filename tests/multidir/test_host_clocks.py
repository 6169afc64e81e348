"""Clocks of several hosts: one offset per host, recovered within the uncertainty reported."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pipetrace.analyze.load import load_run
from pipetrace.testing.cluster import FakeCluster
from tests.multidir.conftest import split_run

HOSTS = ["node-a", "node-a", "node-b", "node-b", "node-c", "node-c"]
SHAPE = dict(ranks=6, microbatches=8, iterations=3, hosts=HOSTS)


def per_host(values: list) -> list:
    """One value per host, given to each of its two ranks."""
    return [v for v in values for _ in range(2)]


CASES = {
    # host offsets and skews, the exchange right (within its ±5 us)
    "offsets and skew": dict(
        clock_offsets_ns=per_host([0, 5_000_000, -2_000_000]),
        clock_skews=per_host([0.0, 1e-3, -5e-4]),
    ),
    # the exchange off by milliseconds on two hosts: only the messages can place them
    "wrong exchange": dict(
        clock_offsets_ns=per_host([0, 5_000_000, -2_000_000]),
        clock_errors_ns=per_host([0, 3_000_000, -1_500_000]),
        clock_skews=per_host([0.0, 2e-5, 0.0]),
    ),
}


@pytest.fixture(scope="module")
def truth(tmp_path_factory):
    """The same run on one true clock: what alignment must recover."""
    path = tmp_path_factory.mktemp("truth") / "run"
    FakeCluster.of("1f1b", **SHAPE).record(path)
    return load_run(path, workers=0)


def absolute_times(run, rank: int) -> np.ndarray:
    r = run.ranks[rank]
    times = np.concatenate([r.steps.begin, r.steps.end, r.p2p.post, r.p2p.done])
    return run.t0_ns + times


@pytest.mark.parametrize("case", CASES)
def test_hosts_are_aligned_within_the_stated_uncertainty(case, truth, tmp_path):
    FakeCluster.of("1f1b", **SHAPE, **CASES[case]).record(tmp_path / "run")
    run = load_run(tmp_path / "run", workers=0)
    hosts = run.clock_quality["hosts"]
    assert [h["host"] for h in hosts] == ["node-a", "node-b", "node-c"]
    assert [h["ranks"] for h in hosts] == [[0, 1], [2, 3], [4, 5]]
    assert run.clock_quality["feasible"] and run.clock_quality["min_slack_ns"] >= 0
    for host in hosts:
        stated = host["uncertainty_ns"]
        assert stated is not None and stated < 100_000  # the messages bound every host
        for rank in host["ranks"]:
            error = np.abs(absolute_times(run, rank) - absolute_times(truth, rank)).max()
            assert error <= stated, (host, rank, error)
    model = run.clock_quality["model"]
    assert model == ("recorded" if case == "offsets and skew" else "messages only")


def test_a_wrong_exchange_is_said_per_host(tmp_path):
    FakeCluster.of("1f1b", **SHAPE, **CASES["wrong exchange"]).record(tmp_path / "run")
    run = load_run(tmp_path / "run", workers=0)
    notes = [p.message for p in run.problems if p.message.startswith("clocks: host")]
    assert len(notes) == 2
    assert re.search(r"host node-b \(2 ranks\) moved \+(2999|3000) us", notes[0])
    assert re.search(r"node-c \(2 ranks\) moved -1500 us.*now \+-\d+ us", notes[1])


def test_one_host_is_the_reference_and_ranks_align_one_by_one(tmp_path):
    FakeCluster.of(
        "1f1b", ranks=2, microbatches=2, iterations=1, clock_errors_ns=[0, 3_000_000]
    ).record(tmp_path / "run")
    run = load_run(tmp_path / "run", workers=0)
    [host] = run.clock_quality["hosts"]
    assert host["ranks"] == [0, 1] and host["correction_ns"] == host["uncertainty_ns"] == 0
    assert run.ranks[1].clock.correction_ns != 0  # the per-rank refinement, as before


def test_a_run_split_by_host_is_aligned_as_one(tmp_path, truth):
    FakeCluster.of("1f1b", **SHAPE, **CASES["wrong exchange"]).record(tmp_path / "run")
    whole = load_run(tmp_path / "run", workers=0)
    node0, node1 = split_run(tmp_path / "run", tmp_path / "nodes", [2, 3, 4, 5])
    split = load_run([node0, node1], workers=0)
    assert split.clock_quality == whole.clock_quality
    for rank in range(6):
        assert np.array_equal(absolute_times(split, rank), absolute_times(whole, rank))


def test_a_run_without_clock_events_is_aligned_by_its_messages_and_says_so(tmp_path):
    from tests.diagnosis.handwritten import HandRun

    run_dir = HandRun().drop(0, e="clock").drop(1, e="clock").write(tmp_path / "run")
    run = load_run(run_dir, workers=0)
    assert {r.clock.applied for r in run.ranks} == {"none"}
    assert run.clock_quality["model"] == "messages only"  # it said "recorded"
