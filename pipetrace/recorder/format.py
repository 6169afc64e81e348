"""The run directory format: names, versions and one declaration per record and event type.

A run directory holds ``meta.json`` and one newline-delimited JSON event log per rank
(``rank-00000.ndjson``, ...). Each log starts with a header line; every later line is one
event with an ``e`` (event type) and a ``t`` (wall-clock time, integer nanoseconds since the
Unix epoch, taken from the rank's monotonic clock anchored once at start).

This module is the one place that says which fields each record has, in the order they are
written, with their types: the recorder derives its byte templates and key order from it, the
reader derives its required-field and type checks, and the field tables of
docs/trace-format.md are generated from it (`pipetrace.recorder.format_doc`). It imports
nothing of the recorder's writing code, so the analyzer can import it.

Bump ``SCHEMA_VERSION`` whenever a field changes meaning or a required field is added (give
that field ``since=`` the new version); readers accept every version up to their own and
refuse newer ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
META_FORMAT = "pipetrace-run"
LOG_FORMAT = "pipetrace-events"
META_FILE = "meta.json"
PROFILER_DIR = "profiler"

# Event types (the "e" field). Begin/end pairs carry the same "id".
RUN_START = "run_start"
CLOCK = "clock"
ITER_BEGIN = "iter_begin"
ITER_END = "iter_end"
STEP_BEGIN = "step_begin"
STEP_END = "step_end"
P2P_POST = "p2p_post"
P2P_DONE = "p2p_done"
STALL = "stall"
DUMP = "dump"
SIGNAL = "signal"
EXCEPTION = "exception"
ABORT = "abort"
RUN_END = "run_end"

OPS = ("send", "recv")
"""The values of ``p2p_post.op``."""
CHANNELS = ("F", "B")
"""The channels the runtime writes in ``p2p_post.ch`` (activations, gradients)."""

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def is_int64(value: Any) -> bool:
    """A JSON integer that fits the int64 columns the analyzer keeps (not a bool)."""
    return type(value) is int and _I64_MIN <= value <= _I64_MAX


def _is_number(value: Any) -> bool:
    return type(value) is float or is_int64(value)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: type(value) is list and all(map(check, value))


def _is_str(value: Any) -> bool:
    return type(value) is str


def _is_object(value: Any) -> bool:
    return type(value) is dict


@dataclass(frozen=True)
class FieldType:
    """A JSON value type as the docs name it, with the check a reader applies to it."""

    doc: str
    check: Callable[[Any], bool]


INT = FieldType("int", is_int64)
FLOAT = FieldType("float", _is_number)
FLOAT_OR_NULL = FieldType("float or null", lambda v: v is None or _is_number(v))
STR = FieldType("string", _is_str)
OBJECT = FieldType("object", _is_object)
INTS = FieldType("list of int", _list_of(is_int64))
STRS = FieldType("list of string", _list_of(_is_str))
STR_ROWS = FieldType("list of list of string", _list_of(_list_of(_is_str)))
OBJECTS = FieldType("list of object", _list_of(_is_object))


@dataclass(frozen=True)
class Field:
    """One field of a record.

    ``required``: a reader cannot use the record without it (an event that lacks it, or holds
    a value of another type, is counted as corrupt). ``when``: None if the recorder always
    writes the field, else the condition under which it does (readers must tolerate its
    absence). ``values``: the only values allowed, when the field is an enumeration.
    ``since``: the schema version that added it.
    """

    name: str
    type: FieldType
    meaning: str
    required: bool = False
    when: str | None = None
    values: tuple[str, ...] | None = None
    since: int = 1

    def accepts(self, value: Any) -> bool:
        return self.type.check(value) and (self.values is None or value in self.values)


@dataclass(frozen=True)
class Record:
    """meta.json, a log header, or one event type (whose lines also carry ``e`` and ``t``).

    ``fields`` are in the order they are written: the order of keys on disk.
    """

    name: str
    fields: tuple[Field, ...]
    since: int = 1

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def build(self, **values: Any) -> dict[str, Any]:
        """The record as a dict in the declared key order; every field not written only
        ``when`` something holds must be given, and no undeclared one."""
        unknown = values.keys() - set(self.names)
        missing = {f.name for f in self.fields if f.when is None} - values.keys()
        if unknown or missing:
            raise ValueError(
                f"{self.name}: undeclared fields {sorted(unknown)}, missing {sorted(missing)}"
            )
        return {name: values[name] for name in self.names if name in values}

    def required(self, version: int) -> tuple[Field, ...]:
        """The fields a reader checks in a log of schema ``version``."""
        return tuple(f for f in self.fields if f.required and f.since <= version)


def _need(name: str, type_: FieldType, meaning: str, **kw: Any) -> Field:
    """A required field (see `Field`)."""
    return Field(name, type_, meaning, required=True, **kw)


def _opt(name: str, type_: FieldType, meaning: str, **kw: Any) -> Field:
    """A field readers do without (see `Field`)."""
    return Field(name, type_, meaning, **kw)


_AS_IN_STALL = "as in `stall`"
_OPEN_STEPS = _opt(
    "open_steps",
    OBJECTS,
    'steps begun and not ended: `{"id", "thread", "pos", "step"}`',
)
_WAITING_IN = _opt(
    "waiting_in",
    STR,
    "only when the rank waits in a collective outside iterations: "
    '`"the end-of-run clock exchange"`',
    when="the rank waits in a collective outside iterations",
)


def _as_in_stall(source: Field) -> Field:
    return Field(source.name, source.type, _AS_IN_STALL, when=source.when)


_STACKS = _opt(
    "stacks",
    OBJECT,
    "thread name -> list of frames (`file:line in function: code`), innermost last",
)
_INFLIGHT = _opt("inflight", OBJECTS, "P2P ops posted and not completed, each a `p2p_post` event")

META = Record(
    "meta",
    (
        _need("format", STR, f'always `"{META_FORMAT}"`'),
        _need("schema_version", INT, f"this document's version, {SCHEMA_VERSION}"),
        _opt("pipetrace_version", STR, "version of pipetrace that wrote the run"),
        _opt("framework", STR, '`"torch"` or `"mindspore"`'),
        _opt("framework_version", STR, "the framework's version string"),
        _opt("python_version", STR, 'e.g. `"3.11.7"`'),
        _opt("world_size", INT, "number of ranks"),
        _opt("created", INT, "wall-clock ns when meta.json was written"),
        _opt(
            "schedule",
            OBJECT,
            '`{"name": ..., "params": {...}}`: the schedule and its parameters',
        ),
        _opt("num_microbatches", INT, "micro-batches per iteration"),
        _opt("placement", INTS, "`placement[stage]` is the rank that holds the stage"),
        _opt("plan", STR_ROWS, 'every rank\'s plan as step texts; `""` is a bubble'),
        _opt("hosts", STRS, "host name of each rank (as far as rank 0 knows them)"),
        _opt(
            "config",
            OBJECT,
            "the run configuration (schedule flags, seed, P2P mode, record settings)",
        ),
    ),
)
"""meta.json. ``format`` and ``schema_version`` are checked by `pipetrace.analyze.reader`."""

HEADER = Record(
    "header",
    (
        _need("format", STR, f'always `"{LOG_FORMAT}"`'),
        _need("schema_version", INT, str(SCHEMA_VERSION)),
        _opt("rank", INT, "this rank"),
        _opt("world_size", INT, "number of ranks"),
        _opt("pid", INT, "process id"),
        _opt("host", STR, "host name"),
        _opt("pipetrace_version", STR, "version of pipetrace that wrote the log"),
        _opt("framework", STR, '`"torch"` or `"mindspore"`'),
        _opt("framework_version", STR, "the framework's version string"),
        _opt("record_mode", STR, '`"steps"` or `"full"`'),
        _opt("t0", INT, "wall-clock ns of the clock anchor"),
    ),
)
"""The first line of a rank log."""

EVENTS: dict[str, Record] = {
    event.name: event
    for event in (
        Record(
            RUN_START,
            (
                _opt("config", OBJECT, "as in meta.json"),
                _need("plan", STRS, "this rank's plan, bubbles removed"),
                _opt("stages", INTS, "the stages this rank holds"),
            ),
        ),
        Record(
            CLOCK,
            (
                _opt("phase", STR, '`"start"` or `"end"`'),
                _need("offset_ns", INT, "this rank's clock minus rank 0's clock"),
                _opt(
                    "uncertainty_ns",
                    INT,
                    "half the best round trip: the true offset lies within ± this",
                ),
                _opt("reference_rank", INT, "always 0"),
            ),
        ),
        Record(ITER_BEGIN, (_need("it", INT, "iteration number"),)),
        Record(
            ITER_END,
            (
                _need("it", INT, "iteration number"),
                _opt(
                    "loss",
                    FLOAT_OR_NULL,
                    "mean loss over the micro-batches on the rank that holds the last stage; "
                    "null elsewhere",
                ),
            ),
        ),
        Record(
            STEP_BEGIN,
            (
                _need("id", INT, "pairs it with its `step_end`"),
                _need("it", INT, "iteration"),
                _need("pos", INT, "plan position"),
                _need(
                    "step",
                    STR,
                    "canonical step text, e.g. `2F0`, `1I3`, `0SEND_F1`, `(0F7;7B3)OVERLAP_F_B`",
                ),
                _need("th", STR, 'thread: `"main"` or `"overlap"`'),
            ),
        ),
        Record(STEP_END, (_need("id", INT, "the `step_begin` it ends"),)),
        Record(
            P2P_POST,
            (
                _need("id", INT, "pairs it with its `p2p_done`"),
                _need("it", INT, "iteration"),
                _need("op", STR, '`"send"` or `"recv"`', values=OPS),
                _need("step", STR, "the SEND/RECV step that posted it"),
                _need("peer", INT, "the other rank"),
                # Not an enumeration: a reader keeps an op on an unknown channel.
                _need("ch", STR, 'channel: `"F"` (activations) or `"B"` (gradients)'),
                _need(
                    "seq",
                    INT,
                    "sequence number per (op, peer, channel), from 0 each iteration; "
                    "a send and the recv it matches have equal (iteration, channel, seq)",
                ),
                _need("bytes", INT, "payload size"),
                _need("shape", INTS, "tensor shape"),
                _need("dtype", STR, 'e.g. `"float32"`'),
                _opt(
                    "stack",
                    STRS,
                    "only in `full` mode: the Python stack that posted it, innermost last",
                    when="the record mode is full",
                ),
            ),
        ),
        Record(P2P_DONE, (_need("id", INT, "the `p2p_post` it completes"),)),
        Record(
            STALL,
            (
                _STACKS,
                _OPEN_STEPS,
                _INFLIGHT,
                _WAITING_IN,
                _opt("idle_s", FLOAT, "seconds since the last event"),
            ),
        ),
        Record(
            DUMP,
            (
                _as_in_stall(_STACKS),
                _as_in_stall(_OPEN_STEPS),
                _as_in_stall(_INFLIGHT),
                _as_in_stall(_WAITING_IN),
                _opt("reason", STR, '`"SIGUSR1"`'),
            ),
        ),
        Record(
            SIGNAL,
            (
                _opt("signal", STR, 'e.g. `"SIGTERM"`, `"SIGINT"`'),
                _as_in_stall(_OPEN_STEPS),
            ),
        ),
        Record(
            EXCEPTION,
            (
                _opt("type", STR, "exception class name"),
                _opt("message", STR, "`str(exception)`"),
                _opt("traceback", STR, "the formatted traceback"),
                _as_in_stall(_OPEN_STEPS),
            ),
        ),
        Record(
            ABORT,
            (
                _opt("idle_s", FLOAT, "seconds since the last progress"),
                _opt("message", STR, "what was printed to stderr"),
                _as_in_stall(_WAITING_IN),
            ),
        ),
        Record(RUN_END, ()),
    )
}
"""Every event type, by name."""

EVENT_TYPES = tuple(EVENTS)


def line_template(event: Record) -> bytes:
    """A ``%`` template of the line orjson writes for ``event``, for writers that skip building
    a dict. Its values are ``t`` and then the required fields in declared order: an int field
    takes an int, any other a JSON literal (bytes from ``orjson.dumps``). The optional fields,
    which must come last, are left out: a writer inserts ``,"name":<JSON>`` before the final
    ``}`` of the line for each one it writes."""
    parts = [b'{"e":"%s"' % event.name.encode(), b'"t":%d']
    fields = list(event.fields)
    while fields and not fields[-1].required:
        fields.pop()
    for f in fields:
        if not f.required:
            raise ValueError(f"{event.name}.{f.name}: an optional field before a required one")
        parts.append(b'"%s":%s' % (f.name.encode(), b"%d" if f.type is INT else b"%s"))
    return b",".join(parts) + b"}\n"


def rank_log_name(rank: int) -> str:
    return f"rank-{rank:05d}.ndjson"


def rank_log_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / rank_log_name(rank)
