"""Runs shared by the TUI tests (made once per session, read-only) and Pilot helpers."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest

from pipetrace.testing.synthetic import write_synthetic_run

from .runs import clean_plan, deadlock_plan, record_plan

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


@pytest.fixture(scope="session")
def synthetic_run(tmp_path_factory) -> Path:
    """A deterministic 4-rank 1F1B run (8 micro-batches, 2 iterations): same bytes every time,
    so it can be snapshotted. The directory name shows in the title."""
    path = tmp_path_factory.mktemp("synthetic") / "1f1b-synthetic"
    write_synthetic_run(
        path, schedule="1f1b", num_ranks=4, num_microbatches=8, iterations=2, transfer_ns=150_000
    )
    return path


@pytest.fixture(scope="session")
def deadlock_run(tmp_path_factory) -> Path:
    """Two ranks blocked in recvs from each other, recorded through the real Recorder."""
    return record_plan(tmp_path_factory.mktemp("deadlock") / "run", deadlock_plan())


@pytest.fixture(scope="session")
def crash_run(tmp_path_factory) -> Path:
    """4-rank 1F1B where rank 2 raises in its 6th step; ranks 0 and 1 are left waiting on it."""
    return record_plan(
        tmp_path_factory.mktemp("crash") / "run", clean_plan("1f1b", 4, 4), crash_at=(2, 5)
    )


@pytest.fixture(scope="session")
def overlap_run(tmp_path_factory) -> Path:
    """DualPipeV on 2 ranks: OVERLAP_F_B composites with the backward on the overlap thread."""
    return record_plan(
        tmp_path_factory.mktemp("overlap") / "run", clean_plan("dualpipev", 2, 4), iterations=2
    )


async def wait_loaded(pilot) -> None:
    """Wait for the background load and the first view."""
    app = pilot.app
    await app.workers.wait_for_complete()
    for _ in range(50):
        await pilot.pause()
        if app.state is not None and (app.state.cursor is not None or app.load_error):
            break
    await pilot.pause()


def screen_text(app) -> str:
    """The screen as plain text, one line per row (colours dropped)."""
    return "\n".join(
        "".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips()
    )


def run_async(test):
    """Run an async test function with asyncio.run (the project has no pytest-asyncio)."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return wrapper
