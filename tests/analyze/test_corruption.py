"""No byte-level corruption of a log crashes the loader or the analyzers (hypothesis)."""

from __future__ import annotations

import shutil

from hypothesis import HealthCheck, given, settings
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


def check(source, tmp_path_factory, rank, ops) -> None:
    path = tmp_path_factory.mktemp("corrupt") / "run"
    shutil.copytree(source, path)
    log = path / fmt.rank_log_name(rank)
    log.write_bytes(corrupt(log.read_bytes(), ops))
    try:
        run = load_run(path, workers=0)
    except TraceFormatError:
        return
    result = analyze(run)
    result.to_json()
    from pipetrace.analyze.report import report_lines

    report_lines(result)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rank=st.integers(0, 3), ops=edits)
def test_corrupted_clean_log_never_crashes(tmp_path_factory, clean_run, rank, ops):
    check(clean_run, tmp_path_factory, rank, ops)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rank=st.integers(0, 3), ops=edits)
def test_corrupted_hung_log_never_crashes(tmp_path_factory, hung_run, rank, ops):
    check(hung_run, tmp_path_factory, rank, ops)
