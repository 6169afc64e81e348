"""The compiled encoder writes exactly the Python encoder's lines, for any record.

The C event queue (`recorder/_queue.c`, `_lines.c`) writes the records appended to it as
lines when it is built, and hands each record it does not take back to `LineEncoder`'s
Python loop. Both are fed the same random records here:
every hot type with ordinary values and with the unusual ones a line template cannot take
(bools, floats, ints beyond int64, tuple subclasses, optional fields present, other lengths,
unknown peers), interleaved with other events.
"""

from __future__ import annotations

import tempfile

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipetrace.recorder import queue as queue_module
from pipetrace.recorder.encoding import (
    MEMORY,
    OTHER,
    P2P_DONE,
    P2P_POST,
    STEP_BEGIN,
    STEP_END,
    LineEncoder,
)
from pipetrace.recorder.format import EVENTS
from pipetrace.schedule.builders import build_plan

STEPS = build_plan("zbv", num_ranks=2, num_microbatches=4, comms=True).steps(0)
INT64 = 2**63 - 1


class Size(tuple):
    """Like torch.Size: a tuple subclass."""


ints = st.integers(-(10**6), 10**12)
unusual = st.one_of(
    st.sampled_from([INT64, -INT64 - 1, INT64 + 1, 2**64, True, False, None, 1.5, "7", (1,)]),
    st.floats(allow_nan=False, allow_infinity=False),
)
times = st.one_of(
    st.integers(0, 10**15),
    st.sampled_from([INT64, INT64 - 5]),
    # within a few seconds of each other, as a run's are: the compiled encoder keeps the
    # last time's seconds (offsets near 0 put these at second and nanosecond boundaries)
    st.integers(10**9 - 10, 3 * 10**9 + 10),
)
# a name and shapes longer than the compiled encoder's 32-byte copies of short texts
long_name = "a-thread-named-at-length-by-its-user"
names = st.sampled_from(
    ["main", "dw-0", "send", "recv", "act", "grad", "float32", "é", 'q"t', long_name]
)
shape_ints = st.one_of(
    st.lists(st.integers(0, 4096), max_size=4),
    st.lists(st.integers(0, 2**40), min_size=5, max_size=8),
)
shapes = st.one_of(shape_ints.map(tuple), shape_ints, shape_ints.map(Size))
int_lists = st.lists(ints, max_size=4)
steps = st.sampled_from(STEPS)
none = st.none()


def _record(tag, *values):
    return st.tuples(st.just(tag), *values)


ordinary = st.one_of(
    _record(STEP_BEGIN, times, ints, ints, ints, steps, names),
    _record(STEP_END, times, ints),
    _record(STEP_END, times, ints, ints),  # a swap launch's bytes
    _record(P2P_DONE, times, ints),
    _record(
        P2P_POST,
        times,
        ints,
        ints,
        names,
        steps,
        st.integers(0, 3),
        names,
        ints,
        ints,
        shapes,
        names,
        st.one_of(none, none, st.just(["a.py:1 in f"])),
    ),
    _record(
        MEMORY,
        times,
        ints,
        int_lists,
        int_lists,
        st.one_of(none, none, st.tuples(ints, ints)),
        st.one_of(none, none, st.lists(st.integers(0, 99), max_size=3)),
    ),
    _record(OTHER, times, st.sampled_from(["iter_begin", "watchdog"]), st.just({"it": 3})),
)


@st.composite
def records(draw):
    """A record as the recorder makes it, or now and then with one value it never makes."""
    record = draw(ordinary)
    if draw(st.integers(0, 3)):
        return record
    at = draw(st.integers(1, len(record) - 1))
    return record[:at] + (draw(unusual),) + record[at + 1 :]


peers = st.one_of(st.none(), st.just((4, 5, 6, 7)))


def _queued(encoder: LineEncoder, batch: list[tuple], compiled: bool) -> bytes:
    """The lines of ``batch`` appended to a queue and written by it."""
    queue = queue_module.new_queue(int, compiled=compiled, step_token=None, close_token=None)
    queue_module.open_queue(queue, encoder, capacity=10**6, on_full=None)
    for record in batch:
        queue.append(record)
    with tempfile.TemporaryFile() as log:
        queue.write(log.fileno(), len(batch))
        log.seek(0)
        return log.read()


def _encoded(offset, peers, batch: list[tuple], compiled: bool) -> bytes | type[BaseException]:
    try:
        return _queued(LineEncoder(offset, peers), batch, compiled)
    except Exception as error:  # the same error from both, or the test fails
        return type(error)


def test_the_compiled_queue_is_built():
    """An install (`make test` installs the package) builds it; without it every record is
    kept and encoded in Python, and recording silently costs a step more."""
    assert queue_module.COMPILED


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(records(), max_size=30), offset=st.integers(-(10**12), 10**18), peers=peers)
def test_the_compiled_encoder_writes_the_python_encoders_lines(batch, offset, peers):
    compiled = _encoded(offset, peers, batch, compiled=True)
    python = _encoded(offset, peers, batch, compiled=False)
    assert compiled == python


def test_the_lines_are_the_json_of_their_events():
    """Ordinary records: each line is the event orjson writes from its dict, fields in the
    declared order."""
    step = STEPS[0]
    lines = _queued(
        LineEncoder(1000, None),
        [
            (STEP_BEGIN, 5, 0, 2, 0, step, "main"),
            (P2P_POST, 6, 1, 2, "send", step, 1, "act", 0, 64, (4, 4), "float32", None),
            (P2P_DONE, 7, 1),
            (STEP_END, 8, 0),
            (MEMORY, 9, 0, [1, 2], [3], None, None),
        ],
        compiled=True,
    ).splitlines()
    events = [orjson.loads(line) for line in lines]
    assert [e["e"] for e in events] == ["step_begin", "p2p_post", "p2p_done", "step_end", "memory"]
    assert [e["t"] for e in events] == [1005, 1006, 1007, 1008, 1009]
    for event, line in zip(events, lines):
        declared = [f.name for f in EVENTS[event["e"]].fields if f.name in event]
        assert list(event) == ["e", "t", *declared]
        assert orjson.dumps(event) == line
    assert events[1]["shape"] == [4, 4] and events[1]["step"] == events[0]["step"]
