from __future__ import annotations

import pytest

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.load import load_run

from .driver import record_run


@pytest.fixture(scope="session")
def clean_run(tmp_path_factory):
    """One clean 4-rank 1F1B run recorded through the real Recorder (shared, read-only)."""
    path = tmp_path_factory.mktemp("clean") / "run"
    record_run(path, schedule="1f1b", ranks=4, microbatches=4, iterations=3)
    return path


def analyzed(path):
    return analyze(load_run(path, workers=0))


@pytest.fixture(scope="session")
def hung_run(tmp_path_factory):
    """A 4-rank run where rank 3 never returns from 3B1 (stall events, open steps and ops)."""
    from .driver import Fault

    path = tmp_path_factory.mktemp("hung") / "run"
    record_run(path, faults=[Fault("block", 3, "3B1")], timeout=0.8, stall_timeout=0.3)
    return path
