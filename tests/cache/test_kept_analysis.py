"""The kept analysis (`analyze.kept_analysis`, `analysis.analyze_cached`): the same as the
analyzers' own, never read when damaged, stale or written by someone else."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import orjson
import pytest

from pipetrace.analyze import analysis, cache, kept_analysis
from pipetrace.analyze.analysis import analyze, analyze_cached
from pipetrace.analyze.load import load_run
from pipetrace.cli import main
from pipetrace.recorder import format as fmt
from pipetrace.runtime.faults import Hang
from pipetrace.testing.cluster import FakeCluster
from pipetrace.tui.session import open_session

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


def _age(run_dir: Path) -> None:
    """Date the logs back: a run with a log written in the last seconds is not cached."""
    past = os.stat(run_dir / fmt.META_FILE).st_mtime_ns - 60 * 10**9
    for log in run_dir.glob("rank-*.ndjson"):
        os.utime(log, ns=(past, past))


def _kept(run_dir: Path) -> Path:
    (entry,) = (run_dir / cache.CACHE_DIR).glob("*.analysis")
    return entry


class _Analyzers:
    """Counts the runs of the analyzers behind `analyze_cached`."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        monkeypatch.setattr(analysis, "analyze", self)

    def __call__(self, run):
        self.calls += 1
        return analyze(run)


@pytest.fixture
def run(tmp_path):
    """Rank 3 hangs (findings with steps); two replicas of a 2-stage pipeline, memory."""
    path = tmp_path / "run"
    hang = Hang(rank=3, step=0, microbatch=1, phase="B")
    FakeCluster.of(faults=[hang], activation_bytes=1 << 20).record(path)
    meta = orjson.loads((path / fmt.META_FILE).read_bytes())
    (path / fmt.META_FILE).write_bytes(orjson.dumps({**meta, "pipelines": [[0, 1], [2, 3]]}))
    _age(path)
    return path


def _same_when_kept(run_dir: Path, monkeypatch) -> None:
    """A first analysis is kept; the next one reads it, and equals the analyzers' own."""
    first = analyze_cached(load_run(run_dir))
    analyzers = _Analyzers(monkeypatch)
    reopened = load_run(run_dir)
    kept = analyze_cached(reopened)
    assert analyzers.calls == 0, run_dir.name
    fresh = analyze(reopened)
    assert kept.to_json() == fresh.to_json() == first.to_json(), run_dir.name
    ideal, fresh_ideal = kept.summary.bubble.ideal, fresh.summary.bubble.ideal
    assert (ideal.simulation is None) == (fresh_ideal.simulation is None), run_dir.name
    if ideal.simulation is not None:  # simulated again when read, as the analyzers made it
        assert ideal.simulation.makespan == fresh_ideal.simulation.makespan
        assert ideal.simulation.timeline == fresh_ideal.simulation.timeline
    monkeypatch.undo()


def test_a_kept_analysis_equals_a_fresh_one(run, monkeypatch):
    _same_when_kept(run, monkeypatch)
    assert analyze_cached(load_run(run)).replicas is not None


def test_every_sample_trace_keeps_the_same_analysis(tmp_path, monkeypatch):
    for sample in sorted(p for p in SAMPLES.iterdir() if (p / fmt.META_FILE).exists()):
        copy = tmp_path / sample.name
        shutil.copytree(sample, copy, ignore=shutil.ignore_patterns(cache.CACHE_DIR))
        _age(copy)
        _same_when_kept(copy, monkeypatch)


def test_every_view_reads_the_kept_analysis(run, tmp_path, capsys, monkeypatch):
    found = len(analyze_cached(load_run(run)).findings)
    analyzers = _Analyzers(monkeypatch)
    out = tmp_path / "a.json"
    assert main(["export", str(run), "-o", str(out), "--format", "chrome-json"]) == 0
    assert f"{found} findings" in capsys.readouterr().out  # its findings track: the kept ones
    assert open_session(run).analysis.findings
    assert main(["diff", str(run), str(run), "--json"]) == 0
    assert main(["analyze", str(run), "--no-segments"]) == 1  # not kept as output yet
    capsys.readouterr()
    assert analyzers.calls == 0


def _flip_a_pickled_byte(data: bytes) -> bytes:
    at = data.index(b"\x80\x05") + 40  # into the pickle (protocol 5), past its header
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],
        lambda data: bytes(len(data)),
        lambda data: b"X" + data[1:],
        _flip_a_pickled_byte,  # the pickle changed: its MAC no longer matches
    ],
)
def test_a_damaged_kept_analysis_is_ignored_and_rebuilt(run, monkeypatch, damage):
    expected = analyze(load_run(run)).to_json()
    analyze_cached(load_run(run))
    _kept(run).write_bytes(damage(_kept(run).read_bytes()))
    analyzers = _Analyzers(monkeypatch)
    assert analyze_cached(load_run(run)).to_json() == expected
    assert analyze_cached(load_run(run)).to_json() == expected  # rewritten, and read back
    assert analyzers.calls == 1


def test_an_analysis_kept_by_someone_else_is_never_unpickled(run, tmp_path, monkeypatch):
    """A run directory copied with its cache from another user (another secret) is analyzed
    again: its pickle is not loaded."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "someone-else"))
    analyze_cached(load_run(run))
    assert kept_analysis.secret_path().is_relative_to(tmp_path / "someone-else")
    monkeypatch.undo()
    analyzers = _Analyzers(monkeypatch)
    analyze_cached(load_run(run))
    assert analyzers.calls == 1


def test_a_changed_log_analyzes_again(run, monkeypatch):
    analyze_cached(load_run(run))
    log = fmt.rank_log_path(run, 2)
    os.utime(log, ns=(os.stat(log).st_atime_ns, os.stat(log).st_mtime_ns - 10**9))
    analyzers = _Analyzers(monkeypatch)
    analyze_cached(load_run(run))
    assert analyzers.calls == 1


def test_without_the_cache_nothing_is_kept(run):
    analyze_cached(load_run(run, cache=False))
    assert not (run / cache.CACHE_DIR).exists()
