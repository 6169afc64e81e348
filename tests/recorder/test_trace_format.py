"""The trace format declaration (`pipetrace.recorder.format`), the recorder and the doc cannot
drift apart: every declared field is written, in the declared order and with its declared type,
nothing undeclared is written, and the doc's field tables are the generated ones.

Clean, full-mode and crashed runs come from the fake cluster (real Recorders on virtual
time); the watchdog's stall and abort and the signal events need a real process
(tests/recorder/session.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import orjson
import pytest

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.load import load_run
from pipetrace.analyze.reader import read_log, read_meta
from pipetrace.recorder import format as fmt
from pipetrace.recorder.format_doc import RECORDS, documented, with_tables
from pipetrace.recorder.watchdog import WATCHDOG_EXIT_CODE
from pipetrace.runtime.faults import Crash
from pipetrace.testing.cluster import FakeCluster
from pipetrace.testing.device_replay import record_device_run
from pipetrace.testing.fake_device import NEVER

DOC = Path(__file__).resolve().parents[2] / "docs" / "trace-format.md"
SESSION = Path(__file__).with_name("session.py")
EXAMPLES = {fmt.INT: -7, fmt.STR: 'a "quoted" \\ text', fmt.INTS: [4, 0, 2], fmt.OP: "recv"}


def run_session(run_dir: Path, scenario: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SESSION), str(run_dir), scenario], **popen)


def record_fake(run_dir: Path, **options) -> None:
    """A 2-rank 1F1B run of one iteration (2 micro-batches) by the fake cluster."""
    FakeCluster.of(ranks=2, microbatches=2, iterations=1, **options).record(run_dir)


def recorded_records(run_dir: Path) -> list[tuple[str, dict]]:
    """(record name, record) for meta.json, every header and every event of a run."""
    records = [("meta", read_meta(run_dir))]
    for log in sorted(run_dir.glob("rank-*.ndjson")):
        header, events, problems = read_log(log)
        records.append(("header", header))
        for event in events:
            records.append((event["e"], {k: v for k, v in event.items() if k not in ("e", "t")}))
        assert problems.corrupt_lines == 0 and not problems.torn_last_line
    return records


def record_sessions(tmp_path: Path) -> list[Path]:
    """Runs that between them write every record: clean, full mode and crash (fake cluster),
    one with device timing whose device never finishes one step (fake devices), hang, and a
    wait interrupted by SIGUSR1, a stall and SIGTERM (real processes)."""
    names = ("clean", "full", "crash", "device", "hang", "wait")
    runs = {name: tmp_path / name for name in names}
    record_fake(runs["clean"], activation_bytes=4096)
    record_fake(runs["full"], record_mode="full")
    record_fake(runs["crash"], faults=[Crash(rank=1, step=0, microbatch=1, phase="F")])
    record_device_run(runs["device"], lambda rank, it, text: NEVER if text == "1B1" else 1_000)
    assert run_session(runs["hang"], "hang").wait(30) == WATCHDOG_EXIT_CODE
    waiting = run_session(runs["wait"], "wait", stdout=subprocess.PIPE)
    assert waiting.stdout.readline().strip() == b"waiting"
    time.sleep(0.3)
    waiting.send_signal(signal.SIGUSR1)
    time.sleep(1.0)  # long enough for the stall (0.5 s) too
    waiting.send_signal(signal.SIGTERM)
    assert waiting.wait(30) == 128 + signal.SIGTERM
    return list(runs.values())


def test_the_recorder_writes_what_the_declaration_says(tmp_path):
    seen: dict[str, set[str]] = defaultdict(set)
    for run_dir in record_sessions(tmp_path):
        for name, record in recorded_records(run_dir):
            declared = {f.name: f for f in RECORDS[name].fields}
            undeclared = record.keys() - declared.keys()
            assert not undeclared, f"{name}: written but not declared: {sorted(undeclared)}"
            order = [f for f in declared if f in record]
            assert list(record) == order, f"{name}: written in another order than declared"
            wrong = [f for f, value in record.items() if not declared[f].type.check(value)]
            assert not wrong, f"{name}: values not of their declared types: {wrong}"
            seen[name] |= record.keys()
    assert set(seen) == set(RECORDS), "some records were never written"
    for name, record in RECORDS.items():
        always = {f.name for f in record.fields if f.presence is not fmt.Presence.SOMETIMES}
        assert always <= seen[name], f"{name}: declared but never written: {always - seen[name]}"
    assert "stack" in seen[fmt.P2P_POST]  # the full-mode run


def test_the_doc_tables_are_the_declared_ones():
    text = DOC.read_text()
    assert sorted(documented(text)) == sorted(RECORDS)
    assert with_tables(text) == text, (
        "docs/trace-format.md lags behind pipetrace/recorder/format.py: run "
        "python -m pipetrace.recorder.format_doc docs/trace-format.md"
    )


@pytest.mark.parametrize("name", [fmt.STEP_BEGIN, fmt.STEP_END, fmt.P2P_POST, fmt.P2P_DONE])
def test_a_line_template_writes_what_orjson_writes(name):
    event = fmt.EVENTS[name]
    required = event.required(fmt.SCHEMA_VERSION)
    values = {f.name: EXAMPLES[f.type] for f in required}
    slots = [v if type(v) is int else orjson.dumps(v) for v in values.values()]
    line = fmt.line_template(event) % (1_700_000_000_000_000_000, *slots)
    expected = {"e": name, "t": 1_700_000_000_000_000_000, **values}
    assert line == orjson.dumps(expected, option=orjson.OPT_APPEND_NEWLINE)


def test_a_field_added_by_a_later_version_is_required_from_that_version_on():
    declared = fmt.record(
        "example",
        """
        a | int    | required         | there from the start
        b | string | required since 2 | added later,
                                        and explained on two lines
        """,
    )
    assert [f.name for f in declared.required(1)] == ["a"]
    assert [f.name for f in declared.required(2)] == ["a", "b"]
    assert declared.fields[1].meaning == "added later, and explained on two lines"


def test_a_record_is_built_in_declared_order_and_only_from_declared_fields():
    values = {f.name: EXAMPLES.get(f.type, 0) for f in fmt.HEADER.fields}
    assert list(fmt.HEADER.build(**dict(reversed(values.items())))) == list(fmt.HEADER.names)
    with pytest.raises(ValueError, match="undeclared fields \\['extra'\\]"):
        fmt.HEADER.build(**values, extra=1)
    with pytest.raises(ValueError, match="missing \\['t0'\\]"):
        fmt.HEADER.build(**{k: v for k, v in values.items() if k != "t0"})


def test_hang_leaves_stall_then_abort_with_stacks(tmp_path):
    assert run_session(tmp_path, "hang", stderr=subprocess.PIPE).wait(30) == WATCHDOG_EXIT_CODE
    _, events, _ = read_log(tmp_path / fmt.rank_log_name(1))
    kinds = [e["e"] for e in events]
    assert kinds.index(fmt.STALL) < kinds.index(fmt.ABORT)
    assert fmt.RUN_END not in kinds
    _, events, _ = read_log(tmp_path / fmt.rank_log_name(1))
    stall = next(e for e in events if e["e"] == fmt.STALL)
    assert any("time.sleep(3600)" in frame for stack in stall["stacks"].values() for frame in stack)
    assert stall["open_steps"][0]["pos"] == 2


def test_a_peer_that_never_ends_is_a_stall_at_the_end_of_run(tmp_path):
    """Rank 1 hangs between iterations (no watchdog there); rank 0, done, waits for it in
    the end-of-run clock exchange: its watchdog records the wait and ends the run."""
    process = run_session(tmp_path, "late", stderr=subprocess.PIPE)
    assert process.wait(30) == WATCHDOG_EXIT_CODE
    assert "in the end-of-run clock exchange" in process.stderr.read().decode()
    _, events, _ = read_log(tmp_path / fmt.rank_log_name(0))
    events = list(events)
    kinds = [e["e"] for e in events]
    assert kinds.index(fmt.ITER_END) < kinds.index(fmt.STALL) < kinds.index(fmt.ABORT)
    abort = next(e for e in events if e["e"] == fmt.ABORT)
    assert "end-of-run clock exchange" in abort["message"] and fmt.RUN_END not in kinds
    assert abort["waiting_in"] == "the end-of-run clock exchange"
    stall = next(e for e in events if e["e"] == fmt.STALL)
    assert any("recv_ints" in frame for stack in stall["stacks"].values() for frame in stack)
    # the analysis names the rank that never got there, not the one that waited for it
    findings = {f.kind: f for f in analyze(load_run(tmp_path)).findings if f.severity == "error"}
    assert (
        findings["rank_stalled"].ranks == [0, 1]
        and "never got there" in findings["rank_stalled"].message
    )
    assert (
        findings["rank_failed"].ranks == [1]
        and "never reached the end of the run" in findings["rank_failed"].cause
    )


def test_reader_refuses_newer_schema(tmp_path):
    record_fake(tmp_path)
    log = tmp_path / fmt.rank_log_name(0)
    lines = log.read_bytes().splitlines(keepends=True)
    header = orjson.loads(lines[0])
    header["schema_version"] = fmt.SCHEMA_VERSION + 1
    log.write_bytes(orjson.dumps(header) + b"\n" + b"".join(lines[1:]))
    with pytest.raises(Exception, match="newer than this pipetrace understands"):
        read_log(log)


def test_torn_last_line_is_tolerated(tmp_path):
    record_fake(tmp_path)
    log = tmp_path / fmt.rank_log_name(0)
    data = log.read_bytes()
    log.write_bytes(data[: len(data) - 7])
    _, events, problems = read_log(log)
    intact = list(events)
    assert problems.torn_last_line and problems.corrupt_lines == 0
    assert len(intact) == data.count(b"\n") - 2  # header and the torn line are not events
