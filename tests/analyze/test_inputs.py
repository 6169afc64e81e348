"""Damaged inputs: each gives a clear message and exit code 2, or a partial analysis with a
warning. Logs are recordings of the fake cluster (`pipetrace.testing.cluster`: real Recorders)
damaged afterwards."""

from __future__ import annotations

import os
import shutil

import orjson
import pytest

from pipetrace.analyze.load import SAME_RUN_WINDOW_NS, load_run
from pipetrace.analyze.parse import parse_rank_file
from pipetrace.analyze.reader import TraceFormatError, read_run_id
from pipetrace.cli import main
from pipetrace.recorder import format as fmt

from .conftest import analyzed


@pytest.fixture
def run(tmp_path, clean_run):
    path = tmp_path / "run"
    shutil.copytree(clean_run, path)
    return path


def log(path, rank):
    return path / fmt.rank_log_name(rank)


def rewrite_header(path, rank, **changes):
    lines = log(path, rank).read_bytes().split(b"\n", 1)
    header = orjson.loads(lines[0])
    header.update(changes)
    log(path, rank).write_bytes(orjson.dumps(header) + b"\n" + lines[1])


def problems(path):
    return [p.message for p in load_run(path, workers=0).problems]


def test_exit_2_without_meta(run, capsys):
    (run / fmt.META_FILE).unlink()
    assert main(["analyze", str(run)]) == 2
    err = capsys.readouterr().err
    assert "no meta.json" in err and "Traceback" not in err and err.count("\n") == 1
    assert "though it holds 4 rank log(s): rank 0 writes it at the start" in err  # where it is


def test_exit_2_for_a_newer_meta_schema(run, capsys):
    meta = orjson.loads((run / fmt.META_FILE).read_bytes())
    meta["schema_version"] = fmt.SCHEMA_VERSION + 1
    (run / fmt.META_FILE).write_bytes(orjson.dumps(meta))
    assert main(["analyze", str(run)]) == 2
    assert "upgrade pipetrace" in capsys.readouterr().err


def test_exit_2_for_corrupt_meta_and_for_a_file(run, tmp_path, capsys):
    (run / fmt.META_FILE).write_bytes(b"{not json")
    assert main(["analyze", str(run)]) == 2
    assert "corrupt JSON" in capsys.readouterr().err
    assert main(["analyze", str(log(run, 0))]) == 2
    assert main(["analyze", str(tmp_path / "nowhere")]) == 2


def test_exit_2_when_no_log_is_usable(run, capsys):
    for rank in range(4):
        log(run, rank).unlink()
    assert main(["analyze", str(run)]) == 2
    assert "no usable event log" in capsys.readouterr().err


def test_missing_rank_is_a_partial_analysis(run):
    log(run, 3).unlink()
    result = analyzed(run)
    assert any("rank-00003.ndjson: missing event log" in p.message for p in result.run.problems)
    assert result.run.ranks[3].status.state == "missing"
    failed = [f for f in result.findings if f.kind == "rank_failed"]
    assert failed and failed[0].ranks == [3] and failed[0].severity == "warning"


def test_empty_log(run):
    log(run, 2).write_bytes(b"")
    assert any("empty event log" in m for m in problems(run))


def test_torn_last_line_is_reported_and_the_rest_used(run):
    data = log(run, 1).read_bytes()
    log(run, 1).write_bytes(data[:-9])
    loaded = load_run(run, workers=0)
    assert any("torn last line" in p.message for p in loaded.problems)
    assert loaded.ranks[1].events == data.count(b"\n") - 2


def test_corrupt_lines_are_counted_with_the_first_location(run):
    lines = log(run, 0).read_bytes().split(b"\n")
    lines[5] = b'{"e":"step_begin","t":'
    lines[9] = b'{"e":"step_end","t":"soon","id":3}'  # valid JSON, invalid event
    lines[12] = b"\x00\xff garbage"
    log(run, 0).write_bytes(b"\n".join(lines))
    messages = problems(run)
    assert any("3 corrupt line(s) skipped, first at line 6" in m for m in messages), messages


def test_newer_schema_on_one_rank_is_set_aside(run):
    rewrite_header(run, 2, schema_version=fmt.SCHEMA_VERSION + 1)
    assert any("newer than this pipetrace understands" in m for m in problems(run))


def test_log_from_another_run_is_set_aside(run):
    header = orjson.loads(log(run, 1).read_bytes().split(b"\n", 1)[0])
    rewrite_header(run, 1, t0=header["t0"] - 2 * SAME_RUN_WINDOW_NS)
    assert load_run(run, workers=0).ranks[1].present  # its run id proves it this run's
    rewrite_header(run, 1, run_id=None)  # without one, a start that far away tells
    rewrite_header(run, 2, world_size=8)
    messages = problems(run)
    assert any(
        "rank-00001.ndjson is from another run" in m and "away from meta.json" in m
        for m in messages
    )
    assert any(
        "rank-00002.ndjson is from another run" in m and "world size 8" in m for m in messages
    )
    (run / fmt.rank_log_name(7)).write_bytes(log(run, 0).read_bytes())
    assert any("rank-00007.ndjson is not a rank of this run" in m for m in problems(run))


def test_a_rank_whose_clock_is_far_off_is_judged_by_its_recorded_offset(run):
    """A host clock 20 minutes off, measured by the clock exchange: the rank started with
    the others, on rank 0's clock."""
    shift = 2 * SAME_RUN_WINDOW_NS
    header, *lines = log(run, 1).read_bytes().splitlines()
    events = [orjson.loads(line) for line in lines]
    for event in events:
        event["t"] += shift
        if event["e"] == fmt.CLOCK:
            event["offset_ns"] += shift
    moved = {**orjson.loads(header), "run_id": None}
    moved["t0"] += shift
    log(run, 1).write_bytes(b"\n".join(map(orjson.dumps, [moved, *events])) + b"\n")
    assert load_run(run, workers=0).ranks[1].present


def test_log_copied_in_from_another_run_is_told_by_its_run_id(run):
    """Same times, same configuration: only the run id the directory was claimed with tells
    a log written by an earlier run of the same command."""
    assert orjson.loads(log(run, 1).read_bytes().split(b"\n", 1)[0])["run_id"] == read_run_id(run)
    rewrite_header(run, 1, run_id="elsewhere:4242:17")
    messages = problems(run)
    assert any(
        "rank-00001.ndjson is from another run" in m and "'elsewhere:4242:17'" in m
        for m in messages
    ), messages
    assert not any("rank-00002.ndjson is from another run" in m for m in messages)


def test_a_device_header_not_as_documented_or_newer_is_named(run):
    rewrite_header(run, 1, device="cuda")
    rewrite_header(run, 2, device={"kind": "cuda", "name": "H200", "timing": 2})
    messages = problems(run)
    assert any("rank-00001.ndjson: header field device is not as documented" in m for m in messages)
    assert any("rank-00002.ndjson: device timing version 2, newer" in m for m in messages)


def test_a_field_written_only_at_times_is_checked_where_present(run):
    """A `dump`'s `device_pending` that is no list of objects: named, not silently dropped."""
    lines = log(run, 1).read_bytes().splitlines()
    last = orjson.loads(lines[-1])["t"]
    dump = {"e": "dump", "t": last, "stacks": {}, "open_steps": [], "inflight": []}
    dump |= {"reason": "SIGUSR1", "device_pending": {"step": "1F0"}}
    log(run, 1).write_bytes(b"\n".join([*lines, orjson.dumps(dump)]) + b"\n")
    assert any(
        "rank-00001.ndjson: 1 event(s) lacking a field the recorder always writes, or with "
        "another type" in m
        for m in problems(run)
    )


@pytest.mark.parametrize(
    "entry",
    [{"step": "1F0", "age_s": 1e300}, {"step": "1F0", "age_s": -5}, {"age_s": 3}],
    ids=["age-past-any-run", "negative-age", "no-step"],
)
def test_a_device_pending_entry_no_reader_can_use_is_damage(run, capsys, entry):
    """An age of 1e300 s crashed the device timing (an int of an infinite float)."""
    lines = log(run, 1).read_bytes().splitlines()
    last = orjson.loads(lines[-1])["t"]
    dump = {"e": "dump", "t": last, "stacks": {}, "open_steps": [], "inflight": []}
    dump |= {"reason": "SIGUSR1", "device_pending": [entry]}
    log(run, 1).write_bytes(b"\n".join([*lines, orjson.dumps(dump)]) + b"\n")
    assert main(["analyze", str(run), "--json", "--no-cache"]) == 1
    data = orjson.loads(capsys.readouterr().out)
    assert any(
        "rank-00001.ndjson: 1 event(s) with a value outside its documented set" in p["message"]
        for p in data["input_problems"]
    )
    assert data["metrics"]["timing"]["device_pending"] == []


def _with_config(path, rank, **changes):
    lines = log(path, rank).read_bytes().splitlines(keepends=True)
    for i, line in enumerate(lines):
        event = orjson.loads(line)
        if event.get("e") == fmt.RUN_START:
            event["config"] = {**event["config"], **changes}
            lines[i] = orjson.dumps(event) + b"\n"
    log(path, rank).write_bytes(b"".join(lines))


def test_a_rank_of_this_run_started_with_other_settings_is_kept_and_named(run):
    """One run by its id (torch.distributed.pipelining ranks given another schedule class
    than rank 0): the log is this run's, so its plan divergence can be told, not a rank
    set aside as missing."""
    _with_config(run, 1, schedule_class="ScheduleGPipe")
    loaded = load_run(run, workers=0)
    assert loaded.ranks[1].present
    (told,) = [p for p in loaded.problems if p.rank == 1]
    assert "its run configuration differs from meta.json's" in told.message and not told.damage
    rewrite_header(run, 1, run_id=None)  # no id to tell: a log of another run, as before
    assert any("is from another run" in m for m in problems(run))


def test_not_a_header(run):
    data = log(run, 0).read_bytes()
    log(run, 0).write_bytes(
        b'{"format":"something-else","schema_version":1}\n' + data.split(b"\n", 1)[1]
    )
    assert any("does not look like a pipetrace event log" in m for m in problems(run))


def test_unknown_event_types_are_ignored(run):
    with open(log(run, 0), "ab") as handle:
        handle.write(b'{"e":"from_the_future","t":1,"x":2}\n')
    assert any("unknown type ignored" in m for m in problems(run))


def test_load_errors_are_trace_format_errors(tmp_path):
    with pytest.raises(TraceFormatError, match="no such run directory"):
        load_run(tmp_path / "absent")


def _die_on_rank_1(path):
    if path.name == fmt.rank_log_name(1):
        os._exit(1)  # as the OOM killer would end a parsing worker
    return parse_rank_file(path)


def test_a_parsing_worker_that_dies_is_one_clear_error(run, monkeypatch, capsys):
    monkeypatch.setattr("pipetrace.analyze.cache.parse_rank_file", _die_on_rank_1)
    # forked workers inherit the patch: fork even if an earlier test left a thread running
    monkeypatch.setattr("pipetrace.analyze.load.threading.active_count", lambda: 1)
    assert main(["analyze", str(run), "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert "a process parsing the logs died" in err and "--workers 0" in err
    assert "Traceback" not in err


def test_a_gzip_compressed_log_is_named_as_such(run):
    import gzip

    log(run, 1).write_bytes(gzip.compress(log(run, 1).read_bytes()))
    assert any("gzip-compressed: decompress it first" in m for m in problems(run))
