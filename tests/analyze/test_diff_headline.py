"""`pipetrace diff` says in words which run is faster, by how much, and on what it rests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrace.cli import main
from pipetrace.testing.device_replay import quick, record_device_run
from tests.multidir.conftest import split_run

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
CLEAN, STRAGGLER = str(SAMPLES / "clean-1f1b"), str(SAMPLES / "fault-straggler")


def diff(capsys, a: str, b: str, *extra: str) -> str:
    assert main(["diff", a, b, *extra]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("a, b", [(CLEAN, STRAGGLER), (STRAGGLER, CLEAN)])
def test_the_headline_matches_the_measured_times_in_both_directions(capsys, a, b):
    data = json.loads(diff(capsys, a, b, "--json"))
    it, busy = data["iteration_time_ns"], data["busiest_rank_busy_ns"]
    text = diff(capsys, a, b)
    if it["b"] > it["a"]:
        expected = f"B is {it['b'] / it['a']:.2f}x slower than A per iteration"
    else:
        expected = f"B is {it['a'] / it['b']:.2f}x faster than A per iteration"
    assert expected in text
    longer = busy["b"] > busy["a"]
    ratio = busy["b"] / busy["a"] if longer else busy["a"] / busy["b"]
    assert f"computes {ratio:.2f}x {'longer' if longer else 'shorter'} than A's" in text
    assert data["steady_iterations"] == {"a": 1, "b": 1}
    assert "few steady iterations" in text


def test_the_straggler_sample_is_faster_overall_but_its_busiest_rank_computes_longer(capsys):
    """What the issue read as "52 % faster": the wall clock of one steady iteration each, which
    the straggler run happened to win, while its slowed rank computes longer."""
    text = diff(capsys, CLEAN, STRAGGLER)
    assert "B is 2.09x faster than A per iteration" in text
    assert "B's busiest rank computes 1.66x longer than A's" in text


def test_a_run_against_itself_is_as_fast(capsys):
    assert "B is as fast as A per iteration" in diff(capsys, CLEAN, CLEAN)


def test_a_run_that_failed_says_so_and_its_first_iteration_is_not_passed_off_as_steady(capsys):
    crash = str(SAMPLES / "fault-crash")  # iteration 0 completes, iteration 1 does not
    data = json.loads(diff(capsys, CLEAN, crash, "--json"))
    assert data["first_iteration_only"] == {"a": False, "b": True}
    text = diff(capsys, CLEAN, crash)
    assert f"B did not run cleanly: {data['findings']['b']['error']} error finding(s)" in text
    assert "B's figures come from its first iteration alone" in text
    assert text.splitlines()[3].startswith("iteration time: not comparable (B completed only")
    assert "slower than A" not in text and "faster than A" not in text


def test_an_incomplete_iterations_critical_path_is_marked_and_not_compared(tmp_path, capsys):
    from tests.diagnosis.handwritten import HandRun, at

    cut = HandRun(iterations=1).cut(0, at(0, 30)).cut(1, at(0, 30)).write(tmp_path / "cut")
    assert main(["analyze", str(cut), "--json"]) == 1
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    path = metrics["critical_path"]
    assert path["iteration"] == 0 and path["complete"] is False
    (span,) = metrics["iterations"]  # no end to measure to: not a time of 0
    assert span["complete"] is False and span["end_ns"] is None and span["time_ns"] is None
    data = json.loads(diff(capsys, CLEAN, str(cut), "--json"))
    assert data["critical_path_ns"]["b"] is None and data["critical_path_ns"]["change"] is None


def test_a_device_timed_run_against_a_host_timed_one_says_they_do_not_compare(tmp_path, capsys):
    device = tmp_path / "device"
    record_device_run(device, quick)
    data = json.loads(diff(capsys, CLEAN, str(device), "--json"))
    assert data["timing"] == {"a": "host", "b": "device"}
    assert "A's figures are host times, B's device times" in diff(capsys, CLEAN, str(device))
    assert "device times" not in diff(capsys, CLEAN, STRAGGLER)


def test_a_run_of_several_directories_is_named_by_all_of_them(tmp_path, capsys):
    crash = split_run(SAMPLES / "fault-crash", tmp_path, [2])
    text = diff(capsys, CLEAN, str(tmp_path / "node*"))  # B: a glob of its two directories
    assert f"(pipetrace analyze {crash[0]} {crash[1]})" in text
