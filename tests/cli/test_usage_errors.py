"""A wrong command line is one line naming the problem and the help to read, exit 2."""

from __future__ import annotations

import pytest

from pipetrace.cli import main


@pytest.mark.parametrize(
    "argv, command, problem",
    [
        (["analyze", "--bogus", "x"], "pipetrace analyze", "No such option '--bogus'"),
        (["export"], "pipetrace export", "Missing argument 'RUN_DIR...'"),
        (["schedule", "show", "1f1b", "-p", "0"], "pipetrace schedule show", "0 is not in"),
        (["schedule", "verify", "1f1b", "--semantics", "x"], "pipetrace schedule verify", "'x'"),
        (["nocommand"], "pipetrace", "No such command 'nocommand'"),
    ],
)
def test_usage_errors_are_one_line(capsys, argv, command, problem):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"{command}: error: ") and problem in err
    assert err.rstrip().endswith(f"(see {command} --help)")


def test_a_csv_plan_takes_no_ranks_that_contradict_it(tmp_path, capsys):
    assert main(["schedule", "show", "1f1b", "-p", "2", "-m", "4", "--format", "csv"]) == 0
    plan = tmp_path / "plan.csv"
    plan.write_text(capsys.readouterr().out)
    assert main(["schedule", "verify", "--csv", str(plan), "-p", "2", "-m", "4"]) == 0
    capsys.readouterr()
    assert main(["schedule", "verify", "--csv", str(plan), "-p", "7"]) == 2
    assert f"--ranks 7, but {plan} has 2 rank(s)" in capsys.readouterr().err
    assert main(["schedule", "verify", "--csv", str(plan), "-v", "2"]) == 2
    assert "-v comes from" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["analyze", ""],
        ["export", "sample_traces/clean-1f1b", "-o", ""],
        ["diff", "", "sample_traces/clean-1f1b"],
        ["merge", "sample_traces/clean-1f1b", "-o", ""],
    ],
    ids=["analyze", "export-o", "diff", "merge-o"],
)
def test_an_empty_path_is_refused_not_read_as_here(capsys, argv):
    assert main(argv) == 2
    assert "an empty path names nothing" in capsys.readouterr().err


def test_runs_started_in_one_second_get_directories_of_their_own(tmp_path, monkeypatch):
    """The default --out is named to the second; a sweep starting two runs in one second
    must not have the second refused (or told to --overwrite the first)."""
    from pipetrace.cli.run import _default_run_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda _format: "20261208-010152")
    first, second = _default_run_dir("1f1b"), _default_run_dir("1f1b")
    assert (first, second) == ("runs/1f1b-20261208-010152", "runs/1f1b-20261208-010152-2")
    assert (tmp_path / first).is_dir() and (tmp_path / second).is_dir()
