"""Odd files and damaged lines: one-line errors or reported input problems, never a hang,
a traceback or a clean exit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import orjson
import pytest

from pipetrace.analyze.load import load_run
from pipetrace.cli import main
from pipetrace.limits import MAX_LINE_BYTES
from pipetrace.recorder import format as fmt

SAMPLE = Path(__file__).resolve().parents[2] / "sample_traces" / "clean-1f1b"
RANK = 1


def copy_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run)
    return run


def edit_log(run: Path, edit) -> None:
    """Replace rank 1's event lines (decoded, header kept) by ``edit(events)``."""
    log = fmt.rank_log_path(run, RANK)
    header, *lines = log.read_bytes().splitlines()
    events = edit([orjson.loads(line) for line in lines])
    log.write_bytes(b"\n".join([header, *(orjson.dumps(e) for e in events)]) + b"\n")


def warnings_of(run: Path) -> list[str]:
    return [p.message for p in load_run(run, workers=0).problems if p.severity == "warning"]


def analyze_cli(run: Path, capsys) -> tuple[int, dict]:
    code = main(["analyze", "--json", str(run)])
    return code, json.loads(capsys.readouterr().out)


def cli_subprocess(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a child (a regression would hang: the timeout fails the test instead)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(
        [sys.executable, "-m", "pipetrace", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_a_fifo_as_meta_json_is_refused_without_blocking(tmp_path):
    run = copy_run(tmp_path)
    (run / fmt.META_FILE).unlink()
    os.mkfifo(run / fmt.META_FILE)
    for verb in (["analyze"], ["export", "-o", str(tmp_path / "t.json")], ["diff", str(run)]):
        done = cli_subprocess(verb[0], str(run), *verb[1:])
        assert done.returncode == 2 and "not a regular file" in done.stderr
        assert "Traceback" not in done.stderr


def test_a_fifo_as_a_rank_log_makes_the_rank_missing(tmp_path):
    run = copy_run(tmp_path)
    fmt.rank_log_path(run, RANK).unlink()
    os.mkfifo(fmt.rank_log_path(run, RANK))
    done = cli_subprocess("analyze", str(run))
    assert done.returncode == 1
    assert "not a regular file" in done.stdout and "missing 1" in done.stdout


def test_meta_json_as_a_directory_is_one_line(tmp_path, capsys):
    run = copy_run(tmp_path)
    (run / fmt.META_FILE).unlink()
    (run / fmt.META_FILE).mkdir()
    assert main(["analyze", str(run)]) == 2
    err = capsys.readouterr().err
    assert "not a regular file (a directory)" in err and err.count("\n") == 1


def test_a_string_where_an_int_belongs_is_corrupt(tmp_path):
    run = copy_run(tmp_path)

    def stringify_pos(events):
        first = next(e for e in events if e["e"] == fmt.STEP_BEGIN)
        first["pos"] = str(first["pos"])
        return events

    edit_log(run, stringify_pos)
    assert any("1 corrupt line(s)" in w for w in warnings_of(run))


def test_a_negative_time_is_corrupt_and_exports(tmp_path, capsys):
    run = copy_run(tmp_path)

    def negative(events):
        events[3]["t"] = -5
        return events

    edit_log(run, negative)
    assert main(["export", str(run), "-o", str(tmp_path / "t.pftrace")]) == 0
    err = capsys.readouterr().err
    assert "1 corrupt line(s)" in err and "Traceback" not in err


def test_header_only_logs_are_reported(tmp_path, capsys):
    run = copy_run(tmp_path)
    edit_log(run, lambda events: [])
    code, doc = analyze_cli(run, capsys)
    assert code == 1
    assert any("no events after its header" in p["message"] for p in doc["input_problems"])
    assert doc["ranks"][RANK]["state"] == "missing"  # told as a rank that left no log
    (failed,) = [f for f in doc["findings"] if f["kind"] == "rank_failed"]
    assert failed["ranks"] == [RANK] and "completed messages with it" in failed["cause"]


def _time_back(events):
    late = next(e for e in events[5:] if e["e"] == fmt.STEP_END)
    late["t"] //= 10  # a lost digit: decades back
    return events


def _bad_step_text(events):
    next(e for e in events if e["e"] == fmt.STEP_BEGIN)["step"] = "1SEND_B&"
    return events


def _step_of_5000_digits(events):
    """int() of a number this long raises; the text is unparsable like any other."""
    next(e for e in events if e["e"] == fmt.STEP_BEGIN)["step"] = "1F" + "5" * 5000
    return events


def _step_of_other_digits(events):
    next(e for e in events if e["e"] == fmt.STEP_BEGIN)["step"] = "1F\u0665"  # Arabic-Indic 5
    return events


def _stall_listing_an_int(events):
    """A list field holding an int crashed every reading verb (iterating it)."""
    stall = {"e": fmt.STALL, "t": events[-1]["t"], "stacks": {}, "idle_s": 1.0}
    return [*events, stall | {"open_steps": 5, "inflight": 7}]


def _ended_before_begun(events):
    """Under the 1 s a preempted thread's line may lag, yet no step ends before it begins."""
    end = next(e for e in events[5:] if e["e"] == fmt.STEP_END)
    begin = next(e for e in events if e["e"] == fmt.STEP_BEGIN and e["id"] == end["id"])
    end["t"] = begin["t"] - 100_000
    return events


def _dangling_completion(events):
    next(e for e in events if e["e"] == fmt.STEP_END)["id"] = 99999
    return events


def _clock_without_phase(events):
    del next(e for e in events if e["e"] == fmt.CLOCK)["phase"]
    return events


def _reused_id(events):
    begins = [e for e in events if e["e"] == fmt.STEP_BEGIN]
    begins[1]["id"] = begins[0]["id"]
    return events


def _cut_in_half(events):
    return events[: len(events) // 2]


@pytest.mark.parametrize(
    "edit, reported",
    [
        (_time_back, "whose time goes back"),
        (_bad_step_text, "unparsable step text(s): '1SEND_B&'"),
        (_step_of_5000_digits, "unparsable step text(s): '1F555"),
        (_step_of_other_digits, "unparsable step text(s): '1F\u0665'"),
        (_dangling_completion, "completion(s) of an id the log never began"),
        (_ended_before_begun, "1 step(s) or op(s) completed before they began"),
        (_stall_listing_an_int, "lacking a field the recorder always writes, or with another"),
        (_clock_without_phase, "lacking a field the recorder always writes"),
        (_reused_id, "begun or completed more than once"),
        (_cut_in_half, "while its peers record until"),
    ],
)
def test_damage_in_decoded_lines_is_an_input_problem(tmp_path, capsys, edit, reported):
    run = copy_run(tmp_path)
    edit_log(run, edit)
    code, doc = analyze_cli(run, capsys)
    assert code == 1
    assert any(reported in p["message"] for p in doc["input_problems"]), doc["input_problems"]


def test_an_overlong_line_is_skipped_not_gathered(tmp_path):
    run = copy_run(tmp_path)
    log = fmt.rank_log_path(run, RANK)
    header, rest = log.read_bytes().split(b"\n", 1)
    with open(log, "wb") as out:
        out.write(header + b"\n")
        out.truncate(len(header) + 1 + 4 * MAX_LINE_BYTES)  # zero bytes, no line end
        out.seek(0, os.SEEK_END)
        out.write(b"\n" + rest)
    tracemalloc.start()
    try:
        warnings = warnings_of(run)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert any("1 corrupt line(s) skipped, first at line 2" in w for w in warnings)
    assert peak < 3 * MAX_LINE_BYTES  # the line itself was never held whole


def _cut_after_post(run: Path, torn: bool) -> None:
    """Rank 1's log ends at the post of its last send of iteration 1 (1SEND_B3, whose recv
    rank 0 completed): kept whole, or torn into bytes a crash leaves (zeros)."""
    log = fmt.rank_log_path(run, RANK)
    lines = log.read_bytes().splitlines(keepends=True)
    post = next(
        i
        for i, line in enumerate(lines)
        if b'"p2p_post"' in line and b'"it":1' in line and b'"1SEND_B3"' in line
    )
    ending = [lines[post][: len(lines[post]) // 2] + b"\0" * 64 + b"\n"] if torn else [lines[post]]
    log.write_bytes(b"".join(lines[:post] + ending))


@pytest.mark.parametrize("torn", [False, True], ids=["post-kept", "post-torn"])
def test_a_log_cut_after_a_message_got_through_is_damage_not_a_failure(tmp_path, capsys, torn):
    # The peer completed the message and finished the run, end-of-run clock exchange with
    # rank 1 included: rank 1 ran to the end, so the transfer is not stuck, nobody waits for
    # anybody, and nothing failed; only its log lost its last part, which is an input warning.
    run = copy_run(tmp_path)
    _cut_after_post(run, torn)
    code, doc = analyze_cli(run, capsys)
    assert code == 1
    assert [f for f in doc["findings"] if f["severity"] != "info"] == []
    assert any(
        p["rank"] == RANK and "without run_end or a recorded failure" in p["message"]
        for p in doc["input_problems"]
    )


def _recv_post_without_seq(events):
    post = next(e for e in events if e["e"] == fmt.P2P_POST and e["op"] == "recv" and e["it"] == 1)
    del post["seq"]  # a required field: the line is corrupt, its post lost
    return events


def test_a_finding_that_a_lost_record_explains_says_so(tmp_path, capsys):
    run = copy_run(tmp_path)
    edit_log(run, _recv_post_without_seq)
    code, doc = analyze_cli(run, capsys)
    assert code == 1
    unmatched = [f for f in doc["findings"] if f["kind"] == "unmatched_send"]
    assert unmatched and all(
        f"or damage in the log of rank(s) {RANK} (its input warnings)" in f["cause"]
        for f in unmatched
    )


def _clock_without_offset(events):
    clock = next(e for e in events if e["e"] == fmt.CLOCK)
    del clock["offset_ns"]  # a required field: the line is corrupt
    return events


def test_a_corrupt_lifecycle_line_is_said_with_its_line_number(tmp_path):
    run = copy_run(tmp_path)
    edit_log(run, _clock_without_offset)
    lines = fmt.rank_log_path(run, RANK).read_bytes().splitlines()
    number = next(n for n, line in enumerate(lines, 1) if b'"clock"' in line)
    assert any(f"1 corrupt line(s) skipped, first at line {number}" in w for w in warnings_of(run))


def test_a_clock_without_its_phase_still_gives_its_offset(tmp_path):
    """`phase` is written always, and readers do without it: the offset is not dropped."""
    run = copy_run(tmp_path)
    lines = fmt.rank_log_path(run, RANK).read_bytes().splitlines()[1:]
    first = next(e for e in map(orjson.loads, lines) if e["e"] == fmt.CLOCK)
    edit_log(run, _clock_without_phase)
    clock = load_run(run, workers=0).ranks[RANK].clock
    assert clock.offset_start_ns == first["offset_ns"] and clock.applied != "none"


def test_logs_without_clock_events_are_aligned_by_the_messages_and_say_so(tmp_path, capsys):
    run = copy_run(tmp_path)
    for log in run.glob("rank-*.ndjson"):
        header, *lines = log.read_bytes().splitlines()
        kept = [line for line in lines if orjson.loads(line)["e"] != fmt.CLOCK]
        log.write_bytes(b"\n".join([header, *kept]) + b"\n")
    _, doc = analyze_cli(run, capsys)
    assert doc["metrics"]["clocks"]["offsets_recorded"] is False
    notes = [p["message"] for p in doc["input_problems"]]
    assert not any("recorded offsets are inconsistent" in n for n in notes), notes


def test_a_step_ending_before_it_began_is_drawn_forwards(tmp_path, capsys):
    run = copy_run(tmp_path)
    edit_log(run, _ended_before_begun)
    out = tmp_path / "run.json"
    assert main(["export", str(run), "--format", "chrome-json", "-o", str(out)]) == 0
    events = orjson.loads(out.read_bytes())["traceEvents"]
    assert min(e.get("dur", 0) for e in events) >= 0


def test_a_message_on_another_channel_is_said_so(tmp_path, capsys):
    """Readers keep a channel they do not know; a finding names it as such, not as -1."""
    run = copy_run(tmp_path)

    def other_channel(events):
        next(e for e in events if e["e"] == fmt.P2P_POST and e["op"] == "send")["ch"] = "X"
        return events

    edit_log(run, other_channel)
    _, doc = analyze_cli(run, capsys)
    said = [f["message"] for f in doc["findings"] if f["kind"] == "unmatched_send"]
    assert said and all("(channel other than F and B," in m for m in said), said
