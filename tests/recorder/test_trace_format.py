"""The trace format doc and the recorder cannot drift apart: every field the doc names is
written, and every field written is named in the doc.

Clean, full-mode and crashed runs come from the fake cluster (real Recorders on virtual
time); the watchdog's stall and abort and the signal events need a real process
(tests/recorder/session.py)."""

from __future__ import annotations

import re
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
from pipetrace.recorder.watchdog import WATCHDOG_EXIT_CODE
from pipetrace.runtime.faults import Crash
from pipetrace.testing.cluster import FakeCluster

DOC = Path(__file__).resolve().parents[2] / "docs" / "trace-format.md"
SESSION = Path(__file__).with_name("session.py")
OPTIONAL = {("p2p_post", "stack")}  # only in full mode
OPTIONAL |= {
    (event, "waiting_in") for event in ("stall", "dump", "abort")
}  # only at the end of a run


def documented_fields() -> dict[str, set[str]]:
    """{section: fields} from the `<!-- fields:NAME -->` tables of the doc."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in DOC.read_text().splitlines():
        marker = re.match(r"<!-- fields:(\w+) -->", line)
        if marker:
            current = sections.setdefault(marker.group(1), set())
            continue
        if current is not None:
            cell = re.match(r"\| `(\w+)` \|", line)
            if cell:
                current.add(cell.group(1))
            elif line.startswith("#") and "fields:" not in line and not line.startswith("####"):
                current = None
    return sections


def run_session(run_dir: Path, scenario: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SESSION), str(run_dir), scenario], **popen)


def record_fake(run_dir: Path, **options) -> None:
    """A 2-rank 1F1B run of one iteration (2 micro-batches) by the fake cluster."""
    FakeCluster.of(ranks=2, microbatches=2, iterations=1, **options).record(run_dir)


def recorded_fields(run_dir: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    header_fields: set[str] = set()
    by_event: dict[str, set[str]] = defaultdict(set)
    for log in sorted(run_dir.glob("rank-*.ndjson")):
        header, events, problems = read_log(log)
        header_fields |= set(header)
        for event in events:
            by_event[event["e"]] |= set(event) - {"e", "t"}
        assert problems.corrupt_lines == 0
    return {"header": header_fields}, by_event


def test_every_documented_field_is_recorded_and_vice_versa(tmp_path):
    seen: dict[str, set[str]] = defaultdict(set)
    runs = {
        "clean": tmp_path / "clean",
        "full": tmp_path / "full",
        "crash": tmp_path / "crash",
        "hang": tmp_path / "hang",
        "wait": tmp_path / "wait",
    }
    record_fake(runs["clean"])
    record_fake(runs["full"], record_mode="full")
    record_fake(runs["crash"], faults=[Crash(rank=1, step=0, microbatch=1, phase="F")])
    assert run_session(runs["hang"], "hang").wait(30) == WATCHDOG_EXIT_CODE
    waiting = run_session(runs["wait"], "wait", stdout=subprocess.PIPE)
    assert waiting.stdout.readline().strip() == b"waiting"
    time.sleep(0.3)
    waiting.send_signal(signal.SIGUSR1)
    time.sleep(1.0)  # long enough for the stall (0.5 s) too
    waiting.send_signal(signal.SIGTERM)
    assert waiting.wait(30) == 128 + signal.SIGTERM

    for run_dir in runs.values():
        header, events = recorded_fields(run_dir)
        seen["header"] |= header["header"]
        for name, fields in events.items():
            seen[name] |= fields
        seen["meta"] |= set(read_meta(run_dir))

    documented = documented_fields()
    assert set(documented) == {"meta", "header", *fmt.EVENT_TYPES}
    for section, fields in documented.items():
        assert section in seen, f"no {section} event was recorded"
        missing = {f for f in fields - seen[section] if (section, f) not in OPTIONAL}
        assert not missing, f"{section}: documented but never recorded: {sorted(missing)}"
        undocumented = seen[section] - fields
        assert not undocumented, f"{section}: recorded but not documented: {sorted(undocumented)}"


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
