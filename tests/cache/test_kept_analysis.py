"""The kept analysis (`analyze.kept_analysis`, `analysis.analyze_cached`): the same as the
analyzers' own, never read when damaged, stale or written by someone else."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pipetrace.analyze import analysis, cache, kept_analysis
from pipetrace.analyze.analysis import analyze, analyze_cached
from pipetrace.analyze.load import load_run
from pipetrace.cli import main
from pipetrace.recorder import format as fmt
from pipetrace.testing.aging import age_logs
from pipetrace.testing.synthetic import write_synthetic_run
from pipetrace.tui.session import open_session

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


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


def test_a_kept_analysis_equals_a_fresh_one(full_run, monkeypatch):
    _same_when_kept(full_run, monkeypatch)
    assert analyze_cached(load_run(full_run)).replicas is not None


def test_every_sample_trace_keeps_the_same_analysis(tmp_path, monkeypatch):
    for sample in sorted(p for p in SAMPLES.iterdir() if (p / fmt.META_FILE).exists()):
        copy = tmp_path / sample.name
        shutil.copytree(sample, copy, ignore=shutil.ignore_patterns(cache.CACHE_DIR))
        age_logs(copy)
        _same_when_kept(copy, monkeypatch)


@pytest.mark.parametrize(
    ("schedule", "options"),
    [
        ("zbv", {}),
        ("interleaved-1f1b", {"stages_per_rank": 2, "jitter": 0.2}),
        ("1f1b", {"slow_stages": {2: 1.5}, "clock_offsets_ns": [0, 5_000, -7_000, 3_000]}),
    ],
)
def test_synthetic_runs_keep_the_same_analysis(tmp_path, monkeypatch, schedule, options):
    """Other plans (the simulation made again), a straggler and skewed clocks."""
    path = tmp_path / schedule
    write_synthetic_run(path, schedule=schedule, num_microbatches=8, **options)
    age_logs(path)
    _same_when_kept(path, monkeypatch)


def test_every_view_reads_the_kept_analysis(full_run, tmp_path, capsys, monkeypatch):
    found = len(analyze_cached(load_run(full_run)).findings)
    analyzers = _Analyzers(monkeypatch)
    out = tmp_path / "a.json"
    assert main(["export", str(full_run), "-o", str(out), "--format", "chrome-json"]) == 0
    assert f"{found} findings" in capsys.readouterr().out  # its findings track: the kept ones
    assert open_session(full_run).analysis.findings
    assert main(["diff", str(full_run), str(full_run), "--json"]) == 0
    assert main(["analyze", str(full_run), "--no-segments"]) == 1  # not kept as output yet
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
def test_a_damaged_kept_analysis_is_ignored_and_rebuilt(full_run, monkeypatch, damage):
    expected = analyze(load_run(full_run)).to_json()
    analyze_cached(load_run(full_run))
    _kept(full_run).write_bytes(damage(_kept(full_run).read_bytes()))
    analyzers = _Analyzers(monkeypatch)
    assert analyze_cached(load_run(full_run)).to_json() == expected
    assert analyze_cached(load_run(full_run)).to_json() == expected  # rewritten, and read back
    assert analyzers.calls == 1


def test_an_analysis_kept_by_someone_else_is_never_unpickled(full_run, tmp_path, monkeypatch):
    """A run directory copied with its cache from another user (another secret) is analyzed
    again: its pickle is not loaded."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "someone-else"))
    analyze_cached(load_run(full_run))
    assert kept_analysis.secret_path().is_relative_to(tmp_path / "someone-else")
    monkeypatch.undo()
    analyzers = _Analyzers(monkeypatch)
    analyze_cached(load_run(full_run))
    assert analyzers.calls == 1


def test_a_changed_log_analyzes_again(full_run, monkeypatch):
    analyze_cached(load_run(full_run))
    log = fmt.rank_log_path(full_run, 2)
    os.utime(log, ns=(os.stat(log).st_atime_ns, os.stat(log).st_mtime_ns - 10**9))
    analyzers = _Analyzers(monkeypatch)
    analyze_cached(load_run(full_run))
    assert analyzers.calls == 1


def test_without_the_cache_nothing_is_kept(full_run):
    analyze_cached(load_run(full_run, cache=False))
    assert not (full_run / cache.CACHE_DIR).exists()
