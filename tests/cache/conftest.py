"""Runs the cache tests share."""

from __future__ import annotations

import orjson
import pytest

from pipetrace.recorder import format as fmt
from pipetrace.runtime.faults import Hang
from pipetrace.testing.aging import age_logs
from pipetrace.testing.cluster import FakeCluster


@pytest.fixture
def full_run(tmp_path):
    """Every part of the model and the analysis: memory samples, two replicas of a 2-stage
    pipeline, and a hang on rank 3 (findings with steps); its logs aged (cacheable)."""
    path = tmp_path / "full-run"
    hang = Hang(rank=3, step=0, microbatch=1, phase="B")
    FakeCluster.of(faults=[hang], activation_bytes=1 << 20).record(path)
    meta = orjson.loads((path / fmt.META_FILE).read_bytes())
    (path / fmt.META_FILE).write_bytes(orjson.dumps({**meta, "pipelines": [[0, 1], [2, 3]]}))
    age_logs(path)
    return path
