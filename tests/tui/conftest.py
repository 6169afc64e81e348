"""Runs shared by the TUI tests (made once per session, read-only) and Pilot helpers."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest

from pipetrace.analyze.run_cache import wait_for_writes
from pipetrace.runtime.faults import Crash
from pipetrace.schedule.ir import Plan, parse_step
from pipetrace.testing.cluster import FakeCluster
from pipetrace.testing.synthetic import write_synthetic_run

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
STALL_AFTER_NS = 200_000_000
"""When a rank left blocked records the watchdog's stall."""


@pytest.fixture(scope="session")
def synthetic_run(tmp_path_factory) -> Path:
    """A deterministic 4-rank 1F1B run (8 micro-batches, 2 iterations): same bytes every time,
    so it can be snapshotted. The directory name shows in the title."""
    path = tmp_path_factory.mktemp("synthetic") / "1f1b-synthetic"
    write_synthetic_run(
        path, schedule="1f1b", num_ranks=4, num_microbatches=8, iterations=2, transfer_ns=150_000
    )
    return path


def deadlock_plan() -> Plan:
    """Two ranks that each wait to receive before sending what the other needs."""
    rows = [
        ["0F0", "0SEND_F0", "0RECV_B0", "0F1", "0SEND_F1", "0B0", "0RECV_B1", "0B1"],
        ["1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"],
    ]
    return Plan(2, (0, 1), [[parse_step(t) for t in row] for row in rows], name="1f1b-misordered")


@pytest.fixture(scope="session")
def deadlock_run(tmp_path_factory) -> Path:
    """Two ranks blocked in recvs from each other (a fake cluster: real Recorders)."""
    path = tmp_path_factory.mktemp("deadlock") / "run"
    FakeCluster(deadlock_plan(), iterations=1, stall_after_ns=STALL_AFTER_NS).record(path)
    return path


@pytest.fixture(scope="session")
def crash_run(tmp_path_factory) -> Path:
    """4-rank 1F1B where rank 2 raises in its first backward (2B0); ranks 0 and 1 are left
    waiting on it."""
    path = tmp_path_factory.mktemp("crash") / "run"
    crash = Crash(rank=2, step=0, microbatch=0, phase="B")
    FakeCluster.of(iterations=1, faults=[crash], stall_after_ns=STALL_AFTER_NS).record(path)
    return path


@pytest.fixture(scope="session")
def overlap_run(tmp_path_factory) -> Path:
    """DualPipeV on 2 ranks: OVERLAP_F_B composites with the backward on the overlap thread."""
    path = tmp_path_factory.mktemp("overlap") / "run"
    FakeCluster.of("dualpipev", ranks=2).record(path)
    return path


async def wait_loaded(pilot) -> None:
    """Wait for the background load and the first view, drawn.

    The first view's move sets the cursor at once but redraws the title, ruler and
    timeline on the frames after it; and the load leaves its run entry being written in a
    thread (`run_cache`), which competes for the interpreter with those frames. So: the
    cursor, then the write, then frames until two in a row show the same screen (a fixed
    few were not always enough: snapshots caught the whole-run view under the first view's
    details, once after three frames)."""
    app = pilot.app
    await app.workers.wait_for_complete()
    for _ in range(50):
        await pilot.pause()
        if app.state is not None and (app.state.cursor is not None or app.load_error):
            break
    wait_for_writes()
    shown = None
    for _ in range(50):
        await pilot.pause()
        now = screen_text(app)
        if now == shown:
            break
        shown = now


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
