"""A run while it is still being recorded: every log lacks its end, so the report says the
ranks still run (their processes, found from the headers) instead of passing their progress
off as a hang, and it is not kept in the cache once the job has ended; `--overwrite` refuses
to delete it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import orjson
import pytest

from pipetrace.cli import main
from pipetrace.recorder import format as fmt

pytestmark = pytest.mark.multiproc


def _analysis(run_dir, capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["analyze", str(run_dir), "--json"])
    problems = orjson.loads(capsys.readouterr().out)["input_problems"]
    return code, [p["message"] for p in problems]


def _header(run_dir, rank: int) -> dict:
    return orjson.loads(fmt.rank_log_path(run_dir, rank).read_bytes().split(b"\n", 1)[0])


def test_a_run_still_recording_is_said_to_be_and_the_saying_is_not_cached(tmp_path, capsys):
    out = tmp_path / "run"
    job = subprocess.Popen(
        [sys.executable, "-m", "pipetrace", "run", "-s", "1f1b", "-p", "2", "-m", "4"]
        + ["-n", "100000", "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            logs = [fmt.rank_log_path(out, r) for r in (0, 1)]
            if all(p.exists() and p.read_bytes().count(b'"iter_end"') >= 2 for p in logs):
                break
            time.sleep(0.2)
        code, said = _analysis(out, capsys)
        assert code == 1
        assert [m for m in said if "is still running: the run is still being recorded" in m]
        # --overwrite would delete the logs it still writes into: refused
        other = subprocess.run(
            [sys.executable, "-m", "pipetrace", "run", "-s", "1f1b", "-p", "2", "-m", "4"]
            + ["--out", str(out), "--overwrite"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert other.returncode == 2
        assert f"the run in {out} is still recording (pid " in other.stderr
        assert fmt.rank_log_path(out, 0).exists()
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    pids = [_header(out, rank)["pid"] for rank in (0, 1)]
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)  # the ranks die with the launcher, init reaps them
    _, said = _analysis(out, capsys)
    assert not [m for m in said if "is still running" in m]
