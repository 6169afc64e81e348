"""Sizes beyond what a command can do are refused at once, with the limit and the way past it."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import orjson
import pytest

from pipetrace.cli import main
from pipetrace.errors import PipetraceError
from pipetrace.limits import ABSENT_RANKS_ENV, PLAN_STEPS_ENV, check_plan_size
from pipetrace.recorder import format as fmt

SAMPLE = Path(__file__).resolve().parents[2] / "sample_traces" / "clean-1f1b"


def refused(capsys, *args: str) -> str:
    """Run the CLI; assert it refused within seconds with one line; return that line."""
    start = time.monotonic()
    code = main(list(args))
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2, err
    assert elapsed < 10, f"took {elapsed:.1f} s to refuse"
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "args",
    [
        ("show", "1f1b", "-p", "1000000", "-m", "1"),
        ("verify", "gpipe", "-p", "4", "-m", "100000000"),
        ("simulate", "zbv", "-p", "100000", "-m", "200000"),
    ],
)
def test_schedule_sizes_beyond_the_limit_are_refused(capsys, args):
    err = refused(capsys, "schedule", *args)
    assert PLAN_STEPS_ENV in err and "this machine can build" in err


def test_a_csv_naming_a_huge_microbatch_is_refused(tmp_path, capsys):
    path = tmp_path / "big.csv"
    path.write_text("0F0,0F1000000000,0B0\n")
    assert PLAN_STEPS_ENV in refused(capsys, "schedule", "verify", "--csv", str(path))


def test_the_limit_can_be_moved_by_its_environment_variable(monkeypatch, capsys):
    check_plan_size(4, 8)  # well inside the default
    monkeypatch.setenv(PLAN_STEPS_ENV, "10")
    with pytest.raises(PipetraceError, match=PLAN_STEPS_ENV):
        check_plan_size(4, 8)
    assert PLAN_STEPS_ENV in refused(capsys, "schedule", "show", "1f1b", "-p", "4", "-m", "8")
    monkeypatch.setenv(PLAN_STEPS_ENV, "many")
    with pytest.raises(PipetraceError, match="not a whole number"):
        check_plan_size(4, 8)


def test_a_world_size_far_beyond_the_logs_present_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run)
    meta = orjson.loads((run / fmt.META_FILE).read_bytes())
    meta["world_size"] = 10**9
    (run / fmt.META_FILE).write_bytes(orjson.dumps(meta))
    for verb in ("analyze", "export"):
        err = refused(capsys, verb, str(run))
        assert "world_size 1,000,000,000" in err and ABSENT_RANKS_ENV in err
