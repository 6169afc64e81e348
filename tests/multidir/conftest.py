from __future__ import annotations

import shutil
from pathlib import Path

import pytest

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


def split_run(run: Path, into: Path, node1_ranks: list[int]) -> tuple[Path, Path]:
    """Copy a run into two "node" directories as a job without a shared file system leaves
    it: node1 holds ``node1_ranks``' logs and no meta.json, node0 the rest and meta.json."""
    node0, node1 = into / "node0", into / "node1"
    shutil.copytree(run, node0)
    node1.mkdir()
    for log in sorted(node0.glob("rank-*.ndjson")):
        if int(log.stem.split("-")[1]) in node1_ranks:
            log.rename(node1 / log.name)
    return node0, node1


@pytest.fixture
def split_sample(tmp_path):
    """clean-1f1b (recorded by the runtime, 3 ranks) split over two directories."""
    return split_run(SAMPLES / "clean-1f1b", tmp_path, [1, 2])
