"""The recorder's records turned into event lines.

Each event is a record, a tuple tagged by type (the tags below; the layouts are those of
`Recorder`'s hot calls); `LineEncoder` writes records as the JSON lines of
docs/trace-format.md. The hot event types are written from the byte templates the format's
declarations give (`fmt.template_parts`), their strings as cached JSON literals, so a line
is the JSON orjson would write for the event's dict.

Two encoders write the same bytes: the C event queue's (`_lines.c`, compiled with the
package, optional; it reads `LAYOUTS`) and the Python loop below, used without a compiler
and for every record the C one does not take (another event type, a value of an unusual
type: it hands those back one by one). tests/recorder/test_encoding.py holds them to the
same output.
"""

from __future__ import annotations

import orjson

from pipetrace.recorder import format as fmt
from pipetrace.schedule.ir import Step, format_step

# Tuple tags on the hot path, each record's first item (and `_queue.h`'s).
STEP_BEGIN, STEP_END, P2P_POST, P2P_DONE, OTHER, MEMORY = range(6)

# The C queue's value kinds (`_lines.c`): how a value of a record is written.
_INT, _TIME, _TEXT, _LITERAL, _PEER, _SHAPE, _INTS, _NONE = range(8)

_RECORDS = {
    # tag: (event, the record's length, (index in the record, kind) per template value,
    #       then the optional values that must be absent for the template to apply)
    STEP_BEGIN: (
        fmt.STEP_BEGIN,
        7,  # (tag, t, id, it, pos, step, thread)
        [(1, _TIME), (2, _INT), (3, _INT), (4, _INT), (5, _TEXT), (6, _LITERAL)],
        [],
    ),
    STEP_END: (fmt.STEP_END, 3, [(1, _TIME), (2, _INT)], []),  # (tag, t, id); + bytes: 4
    P2P_POST: (
        fmt.P2P_POST,
        13,  # (tag, t, id, it, op, step, peer, channel, seq, bytes, shape, dtype, stack)
        [(1, _TIME), (2, _INT), (3, _INT), (4, _LITERAL), (5, _TEXT), (6, _PEER)]
        + [(7, _LITERAL), (8, _INT), (9, _INT), (10, _SHAPE), (11, _LITERAL)],
        [12],
    ),
    P2P_DONE: (fmt.P2P_DONE, 3, [(1, _TIME), (2, _INT)], []),  # (tag, t, id)
    MEMORY: (
        fmt.MEMORY,
        7,  # (tag, t, id, saved, inflight, allocator, swapped)
        [(1, _TIME), (2, _INT), (3, _INTS), (4, _INTS)],
        [5, 6],
    ),
}


def _layouts() -> tuple:
    """The C queue's description of the hot records: per tag, the record's length, each
    value's preceding text, index and kind, and the line's tail."""
    layouts: list = [None] * (max(_RECORDS) + 1)
    for tag, (event, length, values, absent) in _RECORDS.items():
        parts, tail = fmt.template_parts(fmt.EVENTS[event])
        if len(parts) != len(values):
            raise ValueError(f"{event}: {len(parts)} values in its line, {len(values)} placed")
        slots = [(text, index, kind) for (text, _), (index, kind) in zip(parts, values)]
        slots += [(b"", index, _NONE) for index in absent]
        layouts[tag] = (length, tuple(slots), tail + b"\n")
    return tuple(layouts)


LAYOUTS = _layouts()
_STEP_BEGIN_LINE = fmt.line_template(fmt.EVENTS[fmt.STEP_BEGIN])
_STEP_END_LINE = fmt.line_template(fmt.EVENTS[fmt.STEP_END])
_P2P_DONE_LINE = fmt.line_template(fmt.EVENTS[fmt.P2P_DONE])
_P2P_POST_LINE = fmt.line_template(fmt.EVENTS[fmt.P2P_POST])  # without the optional stack
_MEMORY_LINE = fmt.line_template(fmt.EVENTS[fmt.MEMORY])  # without the CUDA allocator's
_DUMP = orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


class LineEncoder:
    """One rank's records -> event lines (the writer's `Encoder`). ``offset`` turns the
    records' monotonic times into the log's epoch times; ``peers`` maps a pipeline rank
    to its global rank when the job has several pipelines."""

    def __init__(self, offset: int, peers: tuple[int, ...] | None):
        self.offset = offset
        self.peers = peers
        self.texts: dict[int, bytes] = {}
        self.literals = _JsonLiterals()

    def line(self, record: tuple) -> bytearray:
        return self.lines([record])

    def text(self, step: Step) -> bytes:
        """The step's text as a JSON string literal, computed once per step."""
        key = id(step)
        text = self.texts.get(key)
        if text is None:
            # Plans keep their Step objects alive for the whole run, so ids stay unique.
            text = self.texts[key] = orjson.dumps(format_step(step))
        return text

    def lines(self, records: list[tuple]) -> bytearray:
        """The event lines of a batch of records, in order, in Python. One loop over the
        batch with everything bound to locals: a call and the attribute lookups per event
        cost as much as the formatting."""
        offset = self.offset
        texts, text, literal = self.texts, self.text, self.literals
        step_begin, step_end, p2p_done = _STEP_BEGIN_LINE, _STEP_END_LINE, _P2P_DONE_LINE
        begin_tag, end_tag, done_tag, post_tag = STEP_BEGIN, STEP_END, P2P_DONE, P2P_POST
        out = bytearray()
        for record in records:
            tag = record[0]
            if tag == end_tag:
                if len(record) == 3:
                    out += step_end % (record[1] + offset, record[2])
                else:  # a swap launch's bytes
                    out += (step_end % (record[1] + offset, record[2]))[:-2]
                    out += b',"bytes":%d}\n' % record[3]
            elif tag == begin_tag:
                _, t, sid, it, pos, step, thread = record
                step_text = texts.get(id(step)) or text(step)
                out += step_begin % (t + offset, sid, it, pos, step_text, literal[thread])
            elif tag == done_tag:
                out += p2p_done % (record[1] + offset, record[2])
            elif tag == post_tag:
                out += self._p2p_post_line(record)
            elif tag == MEMORY:
                out += _memory_line(record, offset)
            else:
                _, t, event_name, fields = record
                out += orjson.dumps({"e": event_name, "t": t + offset, **fields}, option=_DUMP)
        return out

    def _p2p_post_line(self, record: tuple) -> bytes:
        _, t, pid, it, op, step, peer, channel, seq, nbytes, shape, dtype, stack = record
        literal = self.literals
        line = _P2P_POST_LINE % (
            t + self.offset,
            pid,
            it,
            literal[op],
            self.text(step),
            peer if self.peers is None else self.peers[peer],
            literal[channel],
            seq,
            nbytes,
            literal[tuple(shape)],
            literal[dtype],
        )
        if stack is None:
            return line
        return line[:-2] + b',"stack":' + orjson.dumps(stack) + b"}\n"


def _memory_line(record: tuple, offset: int) -> bytes:
    """A ``memory`` event's line; the CUDA allocator's and the swapped bytes when present."""
    _, t, sid, saved, inflight, allocator, swapped = record
    line = _MEMORY_LINE % (t + offset, sid, orjson.dumps(saved), orjson.dumps(inflight))
    if allocator is None and swapped is None:
        return line
    extra = b"" if swapped is None else b',"swapped":' + orjson.dumps(swapped)
    if allocator is not None:
        extra += b',"allocated":%d,"reserved":%d' % allocator
    return line[:-2] + extra + b"}\n"


class _JsonLiterals(dict[str | tuple[int, ...], bytes]):
    """Thread names, ops, channels, dtypes and shapes as JSON bytes, encoded once per value
    (a run has few distinct ones); a hit is a plain dict lookup, cheaper than ``str.encode``."""

    def __missing__(self, value: str | tuple[int, ...]) -> bytes:
        literal = self[value] = orjson.dumps(value)
        return literal
