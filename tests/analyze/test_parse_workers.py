"""Parsing workers: capped at the logs and the usable CPUs, and never left behind.

The rank logs here are a header followed by a sparse hole of 1 TiB of zero bytes: a worker
reads through it for minutes (it is one over-long line, skipped without being kept), so the
parent is certainly still loading when it is killed, whatever the machine's speed, while the
files take no disk space.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipetrace.analyze.workers import usable_cpus, worker_count
from pipetrace.recorder import format as fmt

SAMPLE = Path(__file__).resolve().parents[2] / "sample_traces" / "clean-1f1b"


def test_worker_count_never_exceeds_the_logs_or_the_cpus():
    assert worker_count(99999, 3) == min(3, usable_cpus())
    assert worker_count(2, 1) == 1
    assert worker_count(0, 8) == 0


def _blocking_run(tmp_path: Path) -> Path:
    """A 3-rank run directory whose rank logs take minutes to read (see the module doc)."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(SAMPLE / fmt.META_FILE, run / fmt.META_FILE)
    for rank in range(3):
        log = fmt.rank_log_path(run, rank)
        with open(SAMPLE / fmt.rank_log_name(rank), "rb") as source, open(log, "wb") as out:
            out.write(source.readline())
            out.truncate(1 << 40)
    return run


def _command(name: str, run: Path, tmp_path: Path) -> list[str]:
    base = [sys.executable, "-m", "pipetrace"]
    if name == "export":
        return [*base, "export", str(run), "-o", str(tmp_path / "out.pftrace"), "--workers", "2"]
    return [*base, "analyze", str(run), "--workers", "99999"]


def _wait_for_workers(parent: psutil.Process, timeout: float = 60.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = parent.children(recursive=True)
        if len(children) >= 2:
            time.sleep(0.3)  # let the pool finish starting
            return parent.children(recursive=True)
        time.sleep(0.1)
    pytest.fail("the parsing workers never started")


def _survivors(processes: list[psutil.Process], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = processes
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    return [p.pid for p in alive]


def _ctrl_c_as_at_a_terminal() -> None:
    """SIGINT back to its default in the child: a suite started in the background (``nohup
    make test &``) inherits it ignored, and Python then never turns it into
    KeyboardInterrupt, so the "user's Ctrl-C" would not reach the command at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(usable_cpus() < 2, reason="one usable CPU: logs are parsed in-process")
@pytest.mark.parametrize(
    "command, sig",
    [
        ("analyze", signal.SIGKILL),
        ("analyze", signal.SIGTERM),
        ("analyze", signal.SIGINT),
        ("export", signal.SIGKILL),
    ],
)
def test_no_worker_outlives_a_killed_parent(tmp_path, command, sig):
    run = _blocking_run(tmp_path)
    proc = subprocess.Popen(
        _command(command, run, tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=_ctrl_c_as_at_a_terminal,
    )
    workers: list[psutil.Process] = []
    try:
        workers = _wait_for_workers(psutil.Process(proc.pid))
        assert len(workers) <= 3 + 1  # one per log at most (plus a resource tracker)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        assert _survivors(workers) == []
    finally:
        proc.kill()
        proc.wait()
        for worker in workers:  # only if the test failed: leave nothing behind
            if worker.is_running():
                worker.kill()
