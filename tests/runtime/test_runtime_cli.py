"""`pipetrace run` as a user runs it: fast help, one-line errors before any rank starts,
and a real run with the parity check."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pipetrace.runtime.launch
from pipetrace.cli import main
from pipetrace.runtime.results import CaseResult, LaunchResult, ParityReport, RankFailure


@pytest.mark.parametrize(
    "args, message",
    [
        (["-s", "nosuch"], "unknown schedule 'nosuch'"),
        (["-s", "1f1b", "--ranks", "0"], "--ranks must be >= 1, got 0"),
        (["-s", "1f1b", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["-s", "1f1b", "--timeout", "-1"], "--timeout must be > 0 seconds"),
        (["-s", "zbv", "-p", "2", "-m", "4", "-v", "3"], "zbv runs exactly 2 stages per rank"),
        (
            ["-s", "dualpipev", "-p", "4", "-m", "4"],
            "needs at least as many micro-batches as stages",
        ),
        (["-s", "1f1b", "--data-parallel", "2"], "--data-parallel > 1 needs --fsdp"),
    ],
)
def test_bad_runs_fail_in_one_line_before_starting_ranks(capsys, no_launch, args, message):
    code = main(["run", *args])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("pipetrace: error: ") and message in err


def fake_launch(result: LaunchResult):
    def launch(cases, **kwargs):
        assert [c.schedule for c in cases] == ["1f1b"]
        return result

    return launch


def test_a_failed_rank_is_named_and_exits_1(capsys, monkeypatch, tmp_path):
    failures = [
        RankFailure(2, "RuntimeError: injected", "Traceback ...", at=1.0),
        RankFailure(3, "RuntimeError: Connection closed by peer", at=1.5),
    ]
    recorded = fake_launch(LaunchResult(4, failures=failures))

    def launch_that_records(cases, **kwargs):
        (tmp_path / "run-dir" / "meta.json").write_text("{}")  # rank 0 wrote it at start
        (tmp_path / "run-dir" / "rank-00002.ndjson").write_text("")
        return recorded(cases, **kwargs)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pipetrace.runtime.launch, "launch", launch_that_records)
    code = main(["run", "-s", "1f1b", "-p", "4", "--out", "run-dir"])
    _, err = capsys.readouterr()
    assert code == 1
    assert err.splitlines() == [
        "pipetrace: error: rank 2 failed: RuntimeError: injected",
        "  then rank 3: RuntimeError: Connection closed by peer",
        "trace in run-dir; diagnose with: pipetrace analyze run-dir",
    ]


def test_a_parity_mismatch_names_the_parameter_and_exits_1(capsys, monkeypatch):
    bad = ParityReport(rank=1, tolerance=1e-5)
    bad.add("gradient of 2.0.weight (stage 1)", 3.2e-3)
    good = ParityReport(rank=0, tolerance=1e-5)
    good.add("loss", 1e-16)
    results = {0: [CaseResult([0.5], good)], 1: [CaseResult(None, bad)]}
    monkeypatch.setattr(
        pipetrace.runtime.launch, "launch", fake_launch(LaunchResult(2, results=results))
    )
    code = main(["run", "-s", "1f1b", "--check-parity"])
    _, err = capsys.readouterr()
    assert code == 1
    assert err == (
        "pipetrace: error: parity check failed on rank 1: gradient of 2.0.weight (stage 1): "
        "relative error 0.0032 > 1e-05\n"
    )


def test_malformed_flag_is_a_usage_error(capsys, no_launch):
    code = main(["run", "-s", "1f1b", "--ranks", "many"])
    _, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and "'many' is not a valid integer" in err


def test_help_does_not_import_torch():
    code = (
        "import sys; from pipetrace.cli import main; code = main(['run', '--help']); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--overlap-p2p" in done.stdout and "--check-parity" in done.stdout


@pytest.mark.multiproc
def test_run_trains_and_passes_the_parity_check(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipetrace",
            "run",
            "-s",
            "ScheduleZBVZeroBubble",
            "-p",
            "2",
            "-m",
            "4",
            "-n",
            "3",
            "--overlap-p2p",
            "--check-parity",
            "--timeout",
            "60",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(
        "zbv: 2 ranks, 4 stages on ranks 0,1,1,0, 4 micro-batches, overlapped P2P"
    )
    losses = [float(line.split()[-1]) for line in lines if line.startswith("step ")]
    assert len(losses) == 3 and losses[2] < losses[0]
    assert lines[-2].startswith(
        "parity ok: loss and gradients match a single-process run (17 quantities"
    )
    assert (
        lines[-1] == f"recorded to {tmp_path / 'run'}; next: pipetrace analyze {tmp_path / 'run'}"
    )
