"""`pipetrace run` refuses before any process starts what it cannot do safely (sizes, settings,
run directories), and a local run listens on 127.0.0.1 only."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pipetrace.runtime.launch
from pipetrace.cli import main
from pipetrace.recorder import format as fmt
from pipetrace.runtime.results import LaunchResult, RankFailure


@pytest.mark.parametrize(
    "args, message",
    [
        (["-p", "1000000"], "set PIPETRACE_MAX_PLAN_STEPS to go past it"),
        (["-p", "99999999999999999999"], "set PIPETRACE_MAX_PLAN_STEPS to go past it"),
        (["-p", "100", "-m", "2"], "set PIPETRACE_MAX_LOCAL_RANKS to go past it"),
        (["--timeout", "inf"], "--timeout must be a finite number of seconds, got inf"),
        (["--abort-timeout", "nan"], "--abort-timeout must be a finite number of seconds"),
        (["--out", "/proc/nope/run"], "cannot create run directory /proc/nope/run"),
        # a directory of this user's where no file can be made (a read-only one, for root too)
        (["--out", f"/proc/{os.getpid()}/fdinfo"], f"cannot write in /proc/{os.getpid()}/fdinfo"),
        (["--out", f"/proc/{os.getpid()}/fdinfo", "--overwrite"], "cannot write in /proc/"),
    ],
)
def test_bad_runs_are_refused_in_one_line_before_any_rank(
    capsys, no_launch, monkeypatch, args, message
):
    monkeypatch.setenv("PIPETRACE_MAX_LOCAL_RANKS", "16")
    code = main(["run", "-s", "1f1b", *args])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("pipetrace: error: ") and message in err


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("PIPETRACE_FLUSH_INTERVAL", "inf", "PIPETRACE_FLUSH_INTERVAL must be a finite number"),
        ("PIPETRACE_BUFFER_EVENTS", "many", "PIPETRACE_BUFFER_EVENTS='many' is not a whole"),
        ("PIPETRACE_MAX_LOCAL_RANKS", "lots", "PIPETRACE_MAX_LOCAL_RANKS='lots' is not a whole"),
    ],
)
def test_bad_variables_are_refused_before_any_rank(
    capsys, no_launch, monkeypatch, tmp_path, variable, value, message
):
    monkeypatch.setenv(variable, value)
    code = main(["run", "-s", "1f1b", "--out", str(tmp_path / "run")])
    assert code == 2 and message in capsys.readouterr().err


def test_a_directory_holding_a_run_is_refused_unless_overwritten(capsys, monkeypatch, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / fmt.META_FILE).write_text("{}")
    monkeypatch.setattr(pipetrace.runtime.launch, "launch", lambda *a, **k: LaunchResult(2))
    assert main(["run", "-s", "1f1b", "--out", str(run_dir)]) == 2
    assert "already holds a run (meta.json)" in capsys.readouterr().err
    assert (run_dir / fmt.META_FILE).read_text() == "{}"
    assert main(["run", "-s", "1f1b", "--out", str(run_dir), "--overwrite"]) == 0
    assert not (run_dir / fmt.META_FILE).exists()


def test_no_analyze_hint_for_a_run_that_recorded_nothing(capsys, monkeypatch, tmp_path):
    failed = LaunchResult(2)
    failed.failures.append(RankFailure(0, "RuntimeError: before recording", at=1.0))
    monkeypatch.setattr(pipetrace.runtime.launch, "launch", lambda *a, **k: failed)
    assert main(["run", "-s", "1f1b", "--out", str(tmp_path / "run")]) == 1
    assert "pipetrace analyze" not in capsys.readouterr().err


def test_an_interrupt_before_rank_0_recorded_claims_no_recording(capsys, monkeypatch, tmp_path):
    """Ctrl-C during start-up: one rank's header, no meta.json, which analyze cannot read."""
    out = tmp_path / "run"

    def interrupted(*args, **kwargs) -> LaunchResult:
        (out / fmt.rank_log_name(1)).write_text('{"format": "pipetrace-events"}\n')
        result = LaunchResult(2)
        result.interrupted = 2
        return result

    monkeypatch.setattr(pipetrace.runtime.launch, "launch", interrupted)
    assert main(["run", "-s", "1f1b", "--out", str(out)]) == 130
    assert capsys.readouterr().err == "interrupted: 2 ranks stopped\n"


def test_the_help_examples_do_not_chain_analyze_after_a_hang():
    from pipetrace.cli.run import run

    docs = Path(__file__).parents[2] / "docs" / "runtime.md"
    for text in (run.help, docs.read_text()):
        hanging = [line for line in text.splitlines() if "--inject hang" in line]
        assert hanging and not any("&& pipetrace analyze" in line for line in hanging)


def _listening_sockets(pid: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp*) of the sockets ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                found.append(fields[1])
    return found


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.mark.multiproc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_local_run_listens_on_loopback_only(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pipetrace", "run", "-s", "1f1b", "-p", "2", "-m", "2"]
        + ["--inject", "hang:rank=1", "--out", str(tmp_path / "run")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        listening: list[str] = []
        # Ranks start slowly on a loaded machine; the loop ends as soon as both listen.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(listening) < 2:
            time.sleep(0.5)
            listening = [a for r in _children(launcher.pid) for a in _listening_sockets(r)]
    finally:
        launcher.terminate()
        launcher.wait(timeout=30)
    loopback = ("0100007F:", "0000000000000000FFFF00000100007F:")
    assert len(listening) >= 2  # the store and gloo's pairs
    assert all(address.startswith(loopback) for address in listening), listening


def test_a_rank_ended_by_its_watchdog_is_described_as_such():
    from pipetrace.recorder.watchdog import WATCHDOG_EXIT_CODE
    from pipetrace.runtime.launch import describe_exit

    assert describe_exit(WATCHDOG_EXIT_CODE).startswith("ended by its watchdog: no progress")
    assert describe_exit(5) == "exited with code 5 without reporting an error"
