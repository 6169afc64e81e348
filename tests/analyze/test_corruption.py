"""No byte-level corruption of a log crashes the loader or the analyzers, and none goes
unnoticed: a line that no longer parses shows in the run's problems, a log that lost its
end no longer reads as finished (hypothesis)."""

from __future__ import annotations

import shutil

import orjson
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.load import load_run
from pipetrace.analyze.reader import TraceFormatError
from pipetrace.recorder import format as fmt

edits = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.floats(0, 1), st.integers(0, 255)),
        st.tuples(st.just("cut"), st.floats(0, 1), st.integers(0, 0)),
        st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=12)),
        st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 40)),
        st.tuples(st.just("dup"), st.floats(0, 1), st.integers(1, 200)),
    ),
    min_size=1,
    max_size=6,
)


def corrupt(data: bytes, ops) -> bytes:
    buf = bytearray(data)
    for op, where, arg in ops:
        i = int(where * max(len(buf) - 1, 0))
        if op == "flip" and buf:
            buf[i] = arg
        elif op == "cut":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = arg
        elif op == "delete":
            del buf[i : i + arg]
        elif op == "dup":
            buf[i:i] = buf[i : i + arg]
    return bytes(buf)


def unreadable_lines(data: bytes) -> int:
    """Lines (blank ones aside) that are not a JSON object."""
    count = 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            count += not isinstance(orjson.loads(line), dict)
        except orjson.JSONDecodeError:
            count += 1
    return count


def ends_cleanly(data: bytes) -> bool:
    """Whether the log's last readable event is run_end."""
    for line in reversed(data.split(b"\n")):
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        return isinstance(event, dict) and event.get("e") == fmt.RUN_END
    return False


def check(source, tmp_path_factory, rank, ops) -> None:
    path = tmp_path_factory.mktemp("corrupt") / "run"
    shutil.copytree(source, path)
    log = path / fmt.rank_log_name(rank)
    original = log.read_bytes()
    damaged = corrupt(original, ops)
    log.write_bytes(damaged)
    try:
        run = load_run(path, workers=0)
    except TraceFormatError:
        return
    result = analyze(run)
    states = {r["rank"]: r["state"] for r in result.to_json()["ranks"]}
    from pipetrace.analyze.report import report_lines

    assert report_lines(result)
    noted = [p.message for p in run.problems if p.rank == rank]
    if unreadable_lines(damaged):
        assert noted, "a damaged line went unnoticed"
    if ends_cleanly(original) and not ends_cleanly(damaged) and not noted:
        assert states.get(rank) != "finished", "a log that lost its end reads as finished"


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rank=st.integers(0, 3), ops=edits)
# A log cut to its header and first P2P events: transfers but no step to own them.
@example(rank=3, ops=[("cut", 0.0859375, 0), ("flip", 0.625, 0), ("flip", 0.9375, 0)])
def test_corrupted_clean_log_never_crashes(tmp_path_factory, clean_run, rank, ops):
    check(clean_run, tmp_path_factory, rank, ops)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rank=st.integers(0, 3), ops=edits)
def test_corrupted_hung_log_never_crashes(tmp_path_factory, hung_run, rank, ops):
    check(hung_run, tmp_path_factory, rank, ops)
