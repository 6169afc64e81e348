"""Ctrl-C of `pipetrace run` and the launcher's headline after a hang: what the user sees, and
what the recording then tells `pipetrace analyze` (real ranks, a real SIGINT to the process
group, as a terminal sends it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from pipetrace.cli import main
from pipetrace.recorder import format as fmt
from pipetrace.runtime import faults as ft
from pipetrace.runtime.watchdog_ends import WAITING, last_stall
from pipetrace.testing.cluster import FakeCluster


def _start_run(args: list[str], out: Path, sigint=signal.SIG_DFL) -> subprocess.Popen:
    """`pipetrace run ARGS` in a process group of its own, with Ctrl-C at its default
    (a background job of a non-interactive shell would ignore it: ``sigint`` SIG_IGN)."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipetrace", "run", *args, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
    )


def _wait_for_line(stream, marker: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        if marker in line:
            return
    raise AssertionError(f"no {marker!r} before the run ended or {timeout} s passed")


def _interrupt(launcher: subprocess.Popen, stream, marker: str) -> str:
    """Ctrl-C once ``marker`` shows in ``stream``; the rest of stderr."""
    try:
        _wait_for_line(stream, marker)
        os.killpg(launcher.pid, signal.SIGINT)
        return launcher.communicate(timeout=60)[1]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def _analysis(run_dir: Path, capsys) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["analyze", str(run_dir), "--json"])
    return code, orjson.loads(capsys.readouterr().out)


def _mindspore() -> list[str]:
    pytest.importorskip("mindspore")
    return ["--backend", "mindspore", "--timeout", "60"]


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "backend, ranks",
    [(list, 3), (_mindspore, 2)],  # MindSpore is slow to start and to step: fewer ranks
    ids=["torch", "mindspore"],
)
def test_ctrl_c_stops_the_ranks_keeps_the_recording_and_analyze_says_interrupted(
    tmp_path, capsys, backend, ranks
):
    out = tmp_path / "run"
    run = ["-s", "1f1b", "-p", str(ranks), "-m", "4", "-n", "100000", *backend()]
    launcher = _start_run(run, out)
    err = _interrupt(launcher, launcher.stdout, "step 3 ")
    assert launcher.returncode == 130
    assert err == f"interrupted: {ranks} ranks stopped; recording kept in {out}\n"

    code, analysis = _analysis(out, capsys)
    (interrupted,) = [f for f in analysis["findings"] if f["kind"] == "interrupted"]
    assert interrupted["severity"] == "warning"
    assert "interrupted by the user (Ctrl-C)" in interrupted["message"]
    assert [r["rank"] for r in interrupted["details"]["ranks"]] == list(range(ranks))
    assert all(r["step"] for r in interrupted["details"]["ranks"])  # where each rank was
    kinds = {f["kind"] for f in analysis["findings"]}
    assert not kinds & {"rank_failed", "rank_stalled", "deadlock"}, analysis["findings"]
    assert code == 0


@pytest.mark.multiproc
def test_ctrl_c_after_a_hang_keeps_the_hang_as_its_cause(tmp_path, capsys):
    out = tmp_path / "run"
    hang = ["-s", "1f1b", "-p", "3", "-m", "4", "-n", "2", "--inject", "hang:rank=1"]
    launcher = _start_run([*hang, "--abort-timeout", "0"], out)
    err = _interrupt(launcher, launcher.stderr, "rank 1: no progress")
    assert launcher.returncode == 130 and "Traceback" not in err

    code, analysis = _analysis(out, capsys)
    errors = [f for f in analysis["findings"] if f["severity"] == "error"]
    assert [f["kind"] for f in errors] == ["rank_stalled"], errors
    assert errors[0]["details"]["terminal_rank"] == 1
    assert errors[0]["details"]["terminal_state"] == "computing"
    (interrupted,) = [f for f in analysis["findings"] if f["kind"] == "interrupted"]
    assert "had stalled before it" in interrupted["message"]
    assert code == 1


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "schedule, ranks, mode",
    [("1f1b", "3", []), ("zbv", "2", ["--overlap-p2p"])],
    ids=["1f1b-plain", "zbv-overlap"],
)
def test_the_hang_headline_names_the_rank_stuck_in_a_step(tmp_path, schedule, ranks, mode):
    # overlap mode: the peers wait inside their compute steps, for recvs of other steps
    out = tmp_path / "run"
    launcher = _start_run(
        ["-s", schedule, "-p", ranks, "-m", "4", "-n", "2", *mode, "--inject", "hang:rank=1"], out
    )
    try:
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 1
    (headline,) = [line for line in err.splitlines() if line.startswith("pipetrace: error:")]
    assert headline.startswith("pipetrace: error: rank 1 failed: hung in step 1F1 (iteration 1)"), (
        err
    )
    assert "Traceback" not in err


def test_a_stall_says_which_rank_is_stuck_and_which_wait_for_it(tmp_path):
    FakeCluster.of(
        "1f1b",
        ranks=3,
        faults=[ft.Hang(rank=1, step=1, microbatch=1, phase="F")],
        stall_after_ns=2_000_000_000,
    ).record(tmp_path)
    stuck = last_stall(tmp_path, 1)
    assert stuck is not None and (stuck.step, stuck.peer) == ("1F1", None)
    assert stuck.describe("its watchdog ended it") == (
        "hung in step 1F1 (iteration 1): no progress for 2 s (its watchdog ended it; stall and "
        "stacks in the trace)"
    )
    waiting = last_stall(tmp_path, 0)
    assert waiting is not None and waiting.peer == 1
    assert waiting.describe("its watchdog ended it").startswith(f"{WAITING}rank 1 in step 0")
    assert last_stall(tmp_path / "nowhere", 0) is None


def _stalled_in(tmp_path: Path, step: str, innermost: str, inflight: list[dict]) -> Path:
    """Rank 0's log holding one stall: in ``step``, its main thread at ``innermost``."""
    stall = {
        "e": "stall",
        "t": 1,
        "idle_s": 4.0,
        "stacks": {"MainThread (1)": ["train.py:1 in main: run()", innermost]},
        "open_steps": [{"id": 9, "thread": "main", "pos": 3, "step": step, "it": 1}],
        "inflight": inflight,
    }
    log = fmt.rank_log_path(tmp_path, 0)
    log.write_bytes(b"{}\n" + orjson.dumps(stall) + b"\n")
    return tmp_path


RECV_B0 = [{"op": "recv", "step": "1RECV_B0", "peer": 2}]
WAIT = "/x/torch/distributed/distributed_c10d.py:4000 in wait: work.wait()"


@pytest.mark.parametrize(
    "step, innermost, inflight, said",
    [
        # overlap mode: a compute step waits its own recv inside the step
        ("1B0", WAIT, RECV_B0, "waiting for rank 2"),
        (
            "1B0",
            "model.py:3 in forward: spin()",
            RECV_B0,
            "hung in step 1B0",
        ),
        # FSDP's reduce-scatter waits for the other replicas
        ("1REDUCE_GRAD", WAIT, [], "waiting for its peers in 1REDUCE_GRAD, a collective"),
    ],
    ids=["feeding-recv", "own-code", "collective"],
)
def test_a_stall_inside_a_step_waits_where_its_main_thread_waits(
    tmp_path, step, innermost, inflight, said
):
    stuck = last_stall(_stalled_in(tmp_path, step, innermost, inflight), 0)
    assert stuck is not None and stuck.describe("its watchdog ended it").startswith(said)


@pytest.mark.multiproc
def test_sigterm_to_the_launcher_winds_the_ranks_down_and_each_records_it(tmp_path, capsys):
    # what a scheduler's time limit or `timeout` sends: only the launcher gets it
    out = tmp_path / "run"
    launcher = _start_run(["-s", "1f1b", "-p", "3", "-m", "4", "-n", "100000"], out)
    try:
        _wait_for_line(launcher.stdout, "step 3 ")
        launcher.send_signal(signal.SIGTERM)
        err = launcher.communicate(timeout=60)[1]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 143
    assert err == f"terminated (SIGTERM): 3 ranks stopped; recording kept in {out}\n"
    for rank in range(3):
        log = fmt.rank_log_path(out, rank).read_bytes()
        assert b'"signal":"SIGTERM"' in log, rank  # each recorded where it was
    code, analysis = _analysis(out, capsys)
    failed = [f for f in analysis["findings"] if f["kind"] == "rank_failed"]
    assert code == 1 and {r for f in failed for r in f["ranks"]} == {0, 1, 2}
    # one event ended them all: one error, and no rank's SIGTERM follows from another's
    (first,) = [f for f in failed if f["severity"] == "error"]
    assert "the job was ended from outside: 3 ranks got SIGTERM within" in first["cause"]
    # the rest, ended alike, in one warning (a job of a thousand ranks reads one line)
    (rest,) = [f for f in failed if f is not first]
    assert sorted(rest["ranks"]) == sorted({0, 1, 2} - set(first["ranks"]))
    assert rest["message"].startswith("2 ranks were ended by SIGTERM: ranks ")
    assert "ended with the rest of the job" in rest["cause"]
    assert not [f for f in analysis["findings"] if f["kind"] in ("deadlock", "rank_stalled")]


def test_a_run_started_with_ctrl_c_ignored_keeps_ignoring_it(tmp_path):
    """A command run with & from a script ignores SIGINT, and so must its ranks: the shell's
    Ctrl-C meant for the script. SIGTERM still ends it, as documented."""
    args = ["-s", "1f1b", "-p", "2", "-m", "2", "-n", "100000"]
    launcher = _start_run(args, tmp_path / "run", sigint=signal.SIG_IGN)
    try:
        _wait_for_line(launcher.stdout, "step 2 ")
        os.killpg(launcher.pid, signal.SIGINT)
        time.sleep(2)
        assert launcher.poll() is None  # every process of the group ignored it
        launcher.terminate()
        assert launcher.wait(timeout=60) == 143
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
