from __future__ import annotations

import pytest

from pipetrace.analyze import findings as fk
from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.load import load_run
from pipetrace.runtime.faults import Hang
from pipetrace.testing.cluster import FakeCluster

STALL_AFTER_NS = 300_000_000
"""When a rank that stopped records the watchdog's stall (the runtime's would, after its
stall timeout)."""


@pytest.fixture(scope="session")
def clean_run(tmp_path_factory):
    """One clean 4-rank 1F1B run recorded by the fake cluster (shared, read-only)."""
    path = tmp_path_factory.mktemp("clean") / "run"
    FakeCluster.of("1f1b", ranks=4, microbatches=4, iterations=3).record(path)
    return path


def analyzed(path):
    return analyze(load_run(path, workers=0))


TIMING_KINDS = (fk.STRAGGLER, fk.EXPOSED_COMM)
"""Findings judged from measured durations: on a busy 2-core host a correct run of real
processes can raise them (a rank descheduled for a few steps), so they come and go."""


def untimed_problems(findings: list[fk.Finding]) -> list[tuple[str, str]]:
    """(kind, message) of the findings above info that are no timing findings: what a clean
    run of real processes must not have, however busy the host."""
    return [
        (f.kind, f.message)
        for f in findings
        if f.severity != fk.INFO and f.kind not in TIMING_KINDS
    ]


def hang_in_3b1() -> Hang:
    """Rank 3 never returns from 3B1 (its first backward) in the first iteration."""
    return Hang(rank=3, step=0, microbatch=1, phase="B")


@pytest.fixture(scope="session")
def hung_run(tmp_path_factory):
    """A 4-rank run where rank 3 never returns from 3B1 (stall events, open steps and ops)."""
    path = tmp_path_factory.mktemp("hung") / "run"
    FakeCluster.of(faults=[hang_in_3b1()], stall_after_ns=STALL_AFTER_NS).record(path)
    return path
