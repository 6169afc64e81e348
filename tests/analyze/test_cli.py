"""`pipetrace analyze` and `pipetrace diff` end to end, in-process."""

from __future__ import annotations

import shutil

import orjson

from pipetrace.cli import main
from pipetrace.runtime.faults import ShapeMismatch, Straggler
from pipetrace.testing.cluster import FakeCluster


def test_analyze_clean_text_report(clean_run, capsys):
    assert main(["analyze", str(clean_run)]) == 0
    out = capsys.readouterr().out
    assert "Findings: 0 error(s), 0 warning(s)" in out
    assert "iteration time" in out and "bubble ratio" in out and "critical path" in out
    assert "\x1b[" not in out  # plain when not a terminal


def test_analyze_json_structure(clean_run, capsys):
    assert main(["analyze", str(clean_run), "--json", "--workers", "0"]) == 0
    data = orjson.loads(capsys.readouterr().out)
    assert data["format"] == "pipetrace-analysis" and data["version"] == 1
    assert data["findings"] == []  # a clean run (each finding's fields: the test below)
    m = data["metrics"]
    assert {
        "iterations",
        "iteration_time",
        "ranks",
        "bubble",
        "stages",
        "critical_path",
        "clocks",
    } <= set(m)
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]
    assert all(r["state"] == "finished" for r in data["ranks"])
    assert m["critical_path"]["segments"]


def test_analyze_exit_1_on_errors_and_findings_first(tmp_path, capsys):
    shape = ShapeMismatch(rank=2, step=0, microbatch=1, channel="F", shape=(16, 32))
    FakeCluster.of(faults=[shape]).record(tmp_path)
    assert main(["analyze", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.index("ERROR   [message_mismatch]") < out.index("Metrics")
    assert main(["analyze", str(tmp_path), "--json"]) == 1
    data = orjson.loads(capsys.readouterr().out)
    assert all({"kind", "severity", "ranks", "message"} <= set(f) for f in data["findings"])
    first = data["findings"][0]
    assert (
        first["kind"] == "message_mismatch"
        and first["severity"] == "error"
        and first["ranks"] == [2, 3]
    )


def test_diff(tmp_path, clean_run, capsys):
    slow = tmp_path / "slow"
    FakeCluster.of(faults=[Straggler(rank=1, step=0, factor=6, phase="all")]).record(slow)
    assert main(["diff", str(clean_run), str(slow)]) == 0
    out = capsys.readouterr().out
    assert "iteration time" in out and "stage   1 F" in out
    assert main(["diff", str(clean_run), str(slow), "--json"]) == 0
    data = orjson.loads(capsys.readouterr().out)
    assert data["format"] == "pipetrace-diff"
    assert data["iteration_time_ns"]["delta"] > 0
    stage1 = next(s for s in data["stages"] if s["stage"] == 1 and s["kind"] == "F")
    assert stage1["mean_ns"]["change"] > 2
    assert main(["diff", str(clean_run), str(tmp_path / "absent")]) == 2


def test_diff_says_what_damage_it_read_past(tmp_path, clean_run, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(clean_run, damaged)
    with (damaged / "rank-00001.ndjson").open("ab") as log:
        log.write(b"{not json\n")
    assert main(["diff", str(clean_run), str(damaged)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "pipetrace diff: run B: input warning: rank-00001.ndjson: 1 corrupt line(s) skipped, "
        f"first at line {len((clean_run / 'rank-00001.ndjson').read_bytes().splitlines()) + 1}"
    ]


def test_progress_bar_only_on_a_terminal_and_after_a_delay(monkeypatch):
    import io

    from pipetrace.cli.analyze import _LazyProgress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", io.StringIO())
    quiet = _LazyProgress(delay=0)
    quiet(1, 10)
    assert quiet.bar is None  # not a terminal
    monkeypatch.setattr("sys.stderr", Tty())
    fast = _LazyProgress(delay=60)
    fast(1, 10)
    assert fast.bar is None  # loading has not taken long yet
    slow = _LazyProgress(delay=0)
    slow(1, 10)
    slow(10, 10)
    assert slow.bar is not None
    slow.close()


def test_the_per_rank_table_shows_the_p2p_time_of_the_runs_mode(tmp_path, capsys):
    """Plain mode: the blocking transfer (exposed_comm_ns is 0 there, as it showed)."""
    FakeCluster.of(faults=[Straggler(rank=2, step=0, factor=3, phase="all")]).record(tmp_path)
    capsys.readouterr()
    main(["analyze", str(tmp_path), "--json"])
    ranks = orjson.loads(capsys.readouterr().out)["metrics"]["ranks"]
    main(["analyze", str(tmp_path)])
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.strip().startswith("rank "))
    assert header.split()[-1] == "blocking"
    blocking = max(ranks, key=lambda r: r["blocking_transfer_ns"])
    assert blocking["blocking_transfer_ns"] > 0 and blocking["exposed_comm_ns"] == 0
