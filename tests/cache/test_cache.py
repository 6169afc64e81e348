"""The columnar cache (`pipetrace.analyze.cache`): same results, rebuilt whenever a log
changes, never trusted when damaged, skipped when it cannot be written."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import orjson
import pytest

from pipetrace.analyze import cache
from pipetrace.analyze.load import load_run
from pipetrace.analyze.model import plan_from_meta
from pipetrace.cli import main
from pipetrace.recorder import format as fmt
from pipetrace.runtime.faults import Hang
from pipetrace.testing.aging import age_logs
from pipetrace.testing.cluster import FakeCluster
from pipetrace.testing.synthetic import write_synthetic_run
from tests.analyze.model_equality import assert_same

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


@pytest.fixture
def run(tmp_path):
    """A 4-rank run where rank 3 hangs (stall events, open steps and ops), its logs aged."""
    path = tmp_path / "run"
    FakeCluster.of(faults=[Hang(rank=3, step=0, microbatch=1, phase="B")]).record(path)
    age_logs(path)
    return path


def _analyze(run_dir: Path, capsys, *flags: str) -> tuple[int, str]:
    code = main(["analyze", str(run_dir), "--json", *flags])
    return code, capsys.readouterr().out


def _entries(run_dir: Path) -> list[Path]:
    return sorted((run_dir / cache.CACHE_DIR).glob("*.cols"))


def _from_cache_only(monkeypatch) -> None:
    """Make parsing fail: a load that still succeeds read every rank from the cache."""

    def refuse(path):
        raise AssertionError(f"{path} was parsed, not read from the cache")

    monkeypatch.setattr("pipetrace.analyze.cache.parse_rank_file", refuse)


@pytest.mark.parametrize("workers", ["0", "2"])
def test_cached_analysis_is_byte_identical(run, capsys, monkeypatch, workers):
    plain = _analyze(run, capsys, "--no-cache", "--workers", workers)
    assert not (run / cache.CACHE_DIR).exists()  # --no-cache writes nothing
    first = _analyze(run, capsys, "--workers", workers)
    assert len(_entries(run)) == 4
    _from_cache_only(monkeypatch)
    second = _analyze(run, capsys, "--workers", workers)
    assert plain == first == second
    assert plain[0] == 1  # the hang is found, from the cache too


def test_every_sample_trace_reads_back_the_same(tmp_path, capsys, monkeypatch):
    copies = []
    for sample in sorted(p for p in SAMPLES.iterdir() if (p / fmt.META_FILE).exists()):
        copy = tmp_path / sample.name
        shutil.copytree(sample, copy, ignore=shutil.ignore_patterns(cache.CACHE_DIR))
        age_logs(copy)
        copies.append((copy, _analyze(copy, capsys, "--no-cache")))
        _analyze(copy, capsys)
    _from_cache_only(monkeypatch)
    for copy, plain in copies:
        assert _analyze(copy, capsys) == plain, copy.name


def test_a_recent_log_is_not_cached(tmp_path):
    path = tmp_path / "run"
    FakeCluster.of("1f1b", ranks=2, microbatches=2).record(path)
    load_run(path)
    assert _entries(path) == []


def _same_as_parsed(run_dir: Path, capsys) -> None:
    """The cached analysis equals a fresh parse, and the cache is whole again afterwards."""
    cached = _analyze(run_dir, capsys)
    assert cached == _analyze(run_dir, capsys, "--no-cache")
    age_logs(run_dir)
    _analyze(run_dir, capsys)
    assert len(_entries(run_dir)) == 4


def test_a_grown_log_is_parsed_again(run, capsys):
    before = load_run(run).ranks[0].events
    log = fmt.rank_log_path(run, 0)
    with open(log, "ab") as handle:
        handle.write(b'{"e":"from_the_future","t":1,"x":2}\n')
    age_logs(run)
    assert load_run(run).ranks[0].events == before + 1
    _same_as_parsed(run, capsys)


def test_a_rewritten_log_of_the_same_size_and_time_is_parsed_again(run, capsys):
    load_run(run)
    log = fmt.rank_log_path(run, 1)
    stat = os.stat(log)
    data = bytearray(log.read_bytes())
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    data[last:-1] = b"x" * (len(data) - 1 - last)  # the last event, damaged in place
    log.write_bytes(bytes(data))
    os.utime(log, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(log).st_size == stat.st_size
    problems = [p.message for p in load_run(run).problems]
    assert any("corrupt line" in m for m in problems)
    _same_as_parsed(run, capsys)


def _cut(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _zeros(data: bytes) -> bytes:
    return bytes(len(data))


def _bad_magic(data: bytes) -> bytes:
    return b"X" + data[1:]


def _bad_index(data: bytes) -> bytes:
    return data.replace(b'"texts":[', b'"texts":{', 1)


def _code_out_of_range(data: bytes) -> bytes:
    """Every step text dropped from the index: the code columns point past the list."""
    start = data.index(b'"texts":[') + len(b'"texts":[')
    end = data.index(b"]", start)
    texts = data[start:end]
    return data[:start] + b" " * len(texts) + data[end:]


@pytest.mark.parametrize("damage", [_cut, _zeros, _bad_magic, _bad_index, _code_out_of_range])
def test_a_damaged_cache_is_ignored_and_rebuilt(run, capsys, damage):
    plain = _analyze(run, capsys, "--no-cache")
    _analyze(run, capsys)
    for entry in _entries(run):
        entry.write_bytes(damage(entry.read_bytes()))
    assert _analyze(run, capsys) == plain
    _same_as_parsed(run, capsys)


def test_a_cache_that_cannot_be_written_is_skipped(run, capsys):
    plain = _analyze(run, capsys, "--no-cache")
    (run / cache.CACHE_DIR).write_bytes(b"")  # a file where the directory would go
    assert _analyze(run, capsys) == plain
    assert (run / cache.CACHE_DIR).is_file()


def test_the_flags_are_on_every_loading_command(capsys):
    for command in ("analyze", "tui", "export"):
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert "--no-cache" in out and "--ranks" in out and "--replica" in out, command


def test_planted_files_are_neither_followed_nor_waited_on(run, tmp_path, capsys):
    plain = _analyze(run, capsys, "--no-cache")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / cache.CACHE_DIR).symlink_to(elsewhere)  # a link where the directory would go
    assert _analyze(run, capsys) == plain
    assert list(elsewhere.iterdir()) == []
    (run / cache.CACHE_DIR).unlink()
    (run / cache.CACHE_DIR).mkdir()
    os.mkfifo(run / cache.CACHE_DIR / f"{fmt.rank_log_name(0)}.cols")  # would block a read
    assert _analyze(run, capsys) == plain


def _from_run_entry_only(monkeypatch) -> None:
    """Make every per-log path fail: a load that still succeeds read the run's entry."""

    def refuse(path):
        raise AssertionError(f"{path} was read, not the run's entry")

    monkeypatch.setattr("pipetrace.analyze.cache.load_all", refuse)
    monkeypatch.setattr("pipetrace.analyze.cache.parse_and_store_all", refuse)
    monkeypatch.setattr("pipetrace.analyze.load.parse_rank_file", refuse)


@pytest.mark.parametrize("flags", [(), ("--ranks", "1-2")])
def test_a_reopen_reads_the_assembled_run(run, capsys, monkeypatch, flags):
    plain = _analyze(run, capsys, "--no-cache", *flags)
    assert _analyze(run, capsys, *flags) == plain
    assert len(list((run / cache.CACHE_DIR).glob("*.model"))) == 1
    _from_run_entry_only(monkeypatch)
    assert _analyze(run, capsys, *flags) == plain


def test_a_selection_has_its_own_run_entry(run, capsys, monkeypatch):
    whole = _analyze(run, capsys)
    part = _analyze(run, capsys, "--ranks", "0,3")
    assert len(list((run / cache.CACHE_DIR).glob("*.model"))) == 2
    _from_run_entry_only(monkeypatch)
    assert _analyze(run, capsys) == whole
    assert _analyze(run, capsys, "--ranks", "0,3") == part
    assert _analyze(run, capsys, "--replica", "0") == whole  # every rank: the whole run's


def test_a_changed_meta_json_rebuilds_the_run(run, capsys, monkeypatch):
    _analyze(run, capsys)
    meta = run / fmt.META_FILE
    meta.write_bytes(meta.read_bytes().replace(b'"schedule"', b'"note": "edited", "schedule"', 1))
    with monkeypatch.context() as refusing:
        _from_run_entry_only(refusing)
        with pytest.raises(AssertionError, match="not the run's entry"):
            _analyze(run, capsys)
    assert _analyze(run, capsys) == _analyze(run, capsys, "--no-cache")
    assert load_run(run).meta["note"] == "edited"


def _plan_rows_off(data: bytes) -> bytes:
    """The first row of meta.json's plan given another length (in as many bytes): the rows
    no longer add up to the codes kept."""
    at = data.index(b'"meta_plan":[') + len(b'"meta_plan":[')
    return data[:at] + str((data[at] - ord("0") + 1) % 10).encode() + data[at + 1 :]


@pytest.mark.parametrize(
    "damage", [_cut, _zeros, _bad_magic, _bad_index, _code_out_of_range, _plan_rows_off]
)
def test_a_damaged_run_entry_is_ignored_and_rebuilt(run, capsys, damage):
    plain = _analyze(run, capsys, "--no-cache")
    _analyze(run, capsys)
    (entry,) = (run / cache.CACHE_DIR).glob("*.model")
    entry.write_bytes(damage(entry.read_bytes()))
    assert _analyze(run, capsys) == plain
    assert _analyze(run, capsys) == plain  # rebuilt, and read back


@pytest.mark.parametrize("flags", [("--json",), ("--json", "--no-segments"), ()])
def test_analyzing_an_unchanged_run_again_is_a_read(run, capsys, monkeypatch, flags):
    plain = main(["analyze", str(run), "--no-cache", *flags]), capsys.readouterr().out
    assert (main(["analyze", str(run), *flags]), capsys.readouterr().out) == plain

    def refuse(*args, **kwargs):
        raise AssertionError("the run was loaded again")

    monkeypatch.setattr("pipetrace.analyze.load.load_run", refuse)
    assert (main(["analyze", str(run), *flags]), capsys.readouterr().out) == plain
    assert plain[0] == 1  # the hang, and its exit code, kept too
    log = fmt.rank_log_path(run, 2)
    os.utime(log, ns=(os.stat(log).st_atime_ns, os.stat(log).st_mtime_ns - 10**9))
    with pytest.raises(AssertionError, match="loaded again"):  # a log touched: analyzed again
        main(["analyze", str(run), *flags])


def test_the_run_entry_holds_the_whole_model(full_run, monkeypatch):
    """Every field of the model (memory samples, two pipelines, a hang) reads back as built."""
    built = load_run(full_run)
    assert len(built.ranks[0].memory) and built.pipelines.several
    _from_run_entry_only(monkeypatch)
    assert_same(built, load_run(full_run))


@pytest.mark.parametrize("new_process", [False, True])
def test_a_key_taken_again_sees_a_rewrite_that_kept_size_and_time(
    tmp_path, monkeypatch, new_process
):
    """A log's edges are hashed once per process while its status holds: a rewrite in place
    that restores the modification time still changes the status (its change time), and
    the key itself holds the change time, so a later process (whose edge hashes are new)
    sees a change between the edges too."""
    log = tmp_path / "rank-00000.ndjson"
    log.write_bytes(b"a" * 30_000)
    now = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: now() + 60 * 10**9)  # the log is settled
    before = cache.LogKey.of(log)
    assert cache.LogKey.of(log) == before
    status = os.stat(log)
    time.sleep(0.05)  # past a tick of the file system's clock
    with open(log, "r+b") as handle:
        handle.seek(15_000)  # between the hashed edges
        handle.write(b"b")
    os.utime(log, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert os.stat(log).st_size == status.st_size
    if new_process:
        monkeypatch.setattr(cache, "_EDGES", {})
    assert cache.LogKey.of(log) != before


def test_a_reopened_plan_is_made_when_first_read(run, monkeypatch):
    """A reopen does not rebuild meta.json's plan (its Steps were most of a big reopen): it
    is made on its first read, once, equal to the plan the first load built."""
    built = load_run(run)
    made = []

    def counted(meta, rows):
        made.append(len(rows))
        return plan_from_meta(meta, rows)

    monkeypatch.setattr("pipetrace.analyze.model.plan_from_meta", counted)
    _from_run_entry_only(monkeypatch)
    reopened = load_run(run)
    assert made == []
    assert built.plan is not None and reopened.plan == built.plan
    assert reopened.plan is reopened.plan and made == [4]


def test_a_plan_that_does_not_read_stays_unread_when_reopened(run, monkeypatch):
    meta = orjson.loads((run / fmt.META_FILE).read_bytes())
    meta["plan"][1][0] = "not a step"
    (run / fmt.META_FILE).write_bytes(orjson.dumps(meta))
    built = load_run(run)
    assert built.plan is None
    assert any("the plan cannot be read" in p.message for p in built.problems)
    _from_run_entry_only(monkeypatch)
    reopened = load_run(run)
    assert reopened.plan is None
    assert [p.to_json() for p in reopened.problems] == [p.to_json() for p in built.problems]


@pytest.fixture
def wide_run(tmp_path):
    """32 small rank logs (aged): parsed by two workers, two logs per task and pack."""
    path = tmp_path / "wide"
    write_synthetic_run(path, num_ranks=32, num_microbatches=2, iterations=1)
    age_logs(path)
    return path


def _logs(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("rank-*.ndjson"))


def test_logs_parsed_together_are_kept_in_one_pack(wide_run, capsys, monkeypatch):
    plain = _analyze(wide_run, capsys, "--no-cache", "--workers", "2")
    assert _analyze(wide_run, capsys, "--workers", "2") == plain
    assert len(_entries(wide_run)) == 16  # 32 logs, two per task
    (wide_run / cache.CACHE_DIR / "run.model").unlink()
    _from_cache_only(monkeypatch)
    assert _analyze(wide_run, capsys, "--workers", "2") == plain


def test_a_changed_log_invalidates_its_part_of_a_pack_only(wide_run, monkeypatch):
    logs = _logs(wide_run)[:3]
    raws = cache.parse_and_store_all(logs)
    assert len(_entries(wide_run)) == 1
    _assert_raw_same(cache.load_all(logs), dict(zip(logs, raws)))
    with open(logs[1], "ab") as handle:  # the log grew: its part is stale
        handle.write(b"\n")
    os.utime(logs[1], ns=(0, os.stat(logs[0]).st_mtime_ns))
    assert list(cache.load_all(logs)) == [logs[0], logs[2]]
    cache.parse_and_store_all([logs[1]])  # its new part, in a pack of its own
    assert set(cache.load_all(logs)) == set(logs) and len(_entries(wide_run)) == 2
    for log in logs:  # every log of both packs changed: they are deleted when found so
        with open(log, "ab") as handle:
            handle.write(b"\n")
        os.utime(log, ns=(0, os.stat(_logs(wide_run)[5]).st_mtime_ns))
    assert cache.load_all(logs[:2]) == {}  # log 1's pack goes; log 2's was not asked for
    assert [p.name.split("+")[0] for p in _entries(wide_run)] == [logs[0].name]
    assert cache.load_all(logs) == {} and _entries(wide_run) == []


def test_a_damaged_part_of_a_pack_leaves_the_others(wide_run):
    logs = _logs(wide_run)[:3]
    raws = cache.parse_and_store_all(logs)
    raws[1].plan_index = raws[1].plan_index + 10**6  # places no text
    members = [(log, cache.LogKey.of(log), raw) for log, raw in zip(logs, raws)]
    cache.store(members)
    assert list(cache.load_all(logs)) == [logs[0], logs[2]]


def test_logs_of_several_directories_go_to_a_pack_in_each(wide_run, tmp_path):
    other = tmp_path / "node1"
    other.mkdir()
    moved = _logs(wide_run)[16:]
    for log in moved:
        log.rename(other / log.name)
    logs = [*_logs(wide_run), *_logs(other)]
    cache.parse_and_store_all(logs)
    assert len(_entries(wide_run)) == len(_entries(other)) == 1
    assert set(cache.load_all(logs)) == set(logs)


def _assert_raw_same(loaded: dict, parsed: dict) -> None:
    assert list(loaded) == list(parsed)
    for log, raw in parsed.items():
        assert_same(loaded[log].steps, raw.steps, log.name)
        assert_same(loaded[log].texts, raw.texts, log.name)
        assert_same(loaded[log].plan_index, raw.plan_index, log.name)


def test_packs_are_never_deleted_through_a_linked_cache(wide_run, tmp_path):
    logs = _logs(wide_run)[:2]
    cache.parse_and_store_all(logs)
    elsewhere = tmp_path / "elsewhere"
    (wide_run / cache.CACHE_DIR).rename(elsewhere)
    (wide_run / cache.CACHE_DIR).symlink_to(elsewhere)
    for log in logs:
        with open(log, "ab") as handle:
            handle.write(b"\n")
        os.utime(log, ns=(0, os.stat(_logs(wide_run)[5]).st_mtime_ns))
    assert cache.load_all(logs) == {} and len(list(elsewhere.iterdir())) == 1
