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

To add a field: add a line to its record's table below (at the end, unless it is required
and the writer formats that event from a template), then regenerate the doc tables. Bump
``SCHEMA_VERSION`` whenever a field changes meaning or a required field is added (mark that
field ``required since N``); readers accept every version up to their own and refuse newer
ones, and check each log only for the fields its version requires.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
META_FORMAT = "pipetrace-run"
LOG_FORMAT = "pipetrace-events"
META_FILE = "meta.json"
RUN_ID_FILE = "run-id"
"""The run's id, written by the first process that claims the directory
(`pipetrace.recorder.run_dir`); every directory a run records into holds a copy."""
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
DEVICE = "device"
DEVICE_ANCHOR = "device_anchor"
MEMORY = "memory"

DEVICE_TIMING_VERSION = 1
"""The version of the device-timing fields (the header's ``device.timing``); they are
optional, so adding them needed no schema bump: older readers skip the new events."""
STREAMS = ("compute", "p2p")
"""The values of ``device.stream``."""

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
    """A JSON value type, named as the docs (and the field tables below) write it, with the
    check a reader applies to a value of it."""

    doc: str
    check: Callable[[Any], bool]


INT = FieldType("int", is_int64)
FLOAT = FieldType("float", _is_number)
FLOAT_OR_NULL = FieldType("float or null", lambda v: v is None or _is_number(v))
STR = FieldType("string", _is_str)
OP = FieldType(" or ".join(f'`"{op}"`' for op in OPS), lambda v: type(v) is str and v in OPS)
OBJECT = FieldType("object", _is_object)
INTS = FieldType("list of int", _list_of(is_int64))
STRS = FieldType("list of string", _list_of(_is_str))
STR_ROWS = FieldType("list of list of string", _list_of(_list_of(_is_str)))
INT_ROWS = FieldType("list of list of int", _list_of(_list_of(is_int64)))
OBJECTS = FieldType("list of object", _list_of(_is_object))
TYPES = {
    t.doc: t
    for t in (INT, FLOAT, FLOAT_OR_NULL, STR, OP, OBJECT, INTS, STRS, STR_ROWS, INT_ROWS, OBJECTS)
}
"""The field types, by the name the field tables give them."""


class Presence(Enum):
    """Whether a field is written, and whether a reader can do without it."""

    REQUIRED = "required"
    """Always written; a reader counts an event without it, or with a value of another type,
    as corrupt."""
    ALWAYS = "always"
    """Always written; readers do without it."""
    SOMETIMES = "sometimes"
    """Written only when its meaning says; readers do without it."""


@dataclass(frozen=True)
class Field:
    """One field of a record; ``since`` is the schema version that added it."""

    name: str
    type: FieldType
    presence: Presence
    meaning: str
    since: int = 1

    @property
    def required(self) -> bool:
        return self.presence is Presence.REQUIRED


@dataclass(frozen=True)
class Record:
    """meta.json, a log header, or one event type (whose lines also carry ``e`` and ``t``).

    ``fields`` are in the order they are written: the order of keys on disk. ``since`` is the
    schema version that added the record.
    """

    name: str
    fields: tuple[Field, ...]
    since: int = 1

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def build(self, **values: Any) -> dict[str, Any]:
        """The record as a dict in the declared key order. Every field written always must be
        given, and no undeclared one."""
        unknown = values.keys() - set(self.names)
        always = {f.name for f in self.fields if f.presence is not Presence.SOMETIMES}
        missing = always - values.keys()
        if unknown or missing:
            raise ValueError(
                f"{self.name}: undeclared fields {sorted(unknown)}, missing {sorted(missing)}"
            )
        return {name: values[name] for name in self.names if name in values}

    def required(self, version: int) -> tuple[Field, ...]:
        """The fields a reader checks in a log of schema ``version``."""
        return tuple(f for f in self.fields if f.required and f.since <= version)


def record(name: str, table: str, since: int = 1) -> Record:
    """A record from its field table: a line ``name | type | presence | meaning`` per field,
    in the order they are written. The type is one of `TYPES`; the presence a `Presence`
    value, followed by ``since N`` when a later schema version added the field. A line
    without ``|`` continues the meaning of the field above."""
    fields: list[Field] = []
    for line in filter(None, map(str.strip, table.splitlines())):
        if "|" not in line:
            last = fields.pop()
            fields.append(replace(last, meaning=f"{last.meaning} {line}"))
            continue
        name_, type_, presence, meaning = (cell.strip() for cell in line.split("|", 3))
        presence, _, added = presence.partition(" since ")
        field = Field(name_, TYPES[type_], Presence(presence), meaning, int(added or since))
        fields.append(field)
    return Record(name, tuple(fields), since)


META = record(
    "meta",
    """
    format            | string                 | required | always `"pipetrace-run"`
    schema_version    | int                    | required | this document's version
    pipetrace_version | string                 | always   | version of pipetrace that wrote the run
    framework         | string                 | always   | `"torch"` or `"mindspore"`
    framework_version | string                 | always   | the framework's version string
    python_version    | string                 | always   | e.g. `"3.11.7"`
    world_size        | int                    | required | number of ranks of the whole job (every
                                                            replica's pipeline)
    created           | int                    | always   | wall-clock ns when meta.json was written
    schedule          | object                 | always   | `{"name": ..., "params": {...}}`:
                                                            the schedule and its parameters
    num_microbatches  | int                    | always   | micro-batches per iteration
    placement         | list of int            | always   | `placement[stage]` is the pipeline
                                                            rank that holds the stage
    plan              | list of list of string | always   | every pipeline rank's plan as step
                                                            texts; `""` is a bubble (every replica
                                                            runs the same plan)
    hosts             | list of string         | always   | host name of each rank (as far as
                                                            rank 0 knows them)
    config            | object                 | always   | the run configuration (schedule
                                                            flags, seed, P2P mode, record settings)
    pipelines         | list of list of int    | sometimes | only with more than one replica
                                                             (data parallelism):
                                                             `pipelines[replica][pipeline_rank]` is
                                                             the global rank; without it the job is
                                                             one pipeline whose pipeline rank r is
                                                             global rank r
    """,
)
"""meta.json. ``format`` and ``schema_version`` are checked by `pipetrace.analyze.reader`."""

HEADER = record(
    "header",
    """
    format            | string | required | always `"pipetrace-events"`
    schema_version    | int    | required | the schema version of this log
    rank              | int    | required | this process's global rank (the log's name)
    world_size        | int    | required | number of ranks of the whole job
    pid               | int    | always   | process id
    host              | string | always   | host name
    pipetrace_version | string | always   | version of pipetrace that wrote the log
    framework         | string | always   | `"torch"` or `"mindspore"`
    framework_version | string | always   | the framework's version string
    record_mode       | string | always   | `"steps"` or `"full"`
    t0                | int    | always   | wall-clock ns of the clock anchor
    run_id            | string | always   | the id the rank claimed its run directory with
                                             (the directory's `run-id` file); a log whose
                                             `run_id` is not its directory's was written by
                                             another run and is set aside (older logs have
                                             none)
    device            | object | sometimes | only with device timing: `{"kind": "cuda",
                                             "name": "NVIDIA H200", "timing": 1}`; `timing` is
                                             the version of the device fields; without
                                             `device`, every time is a host time
    replica           | int    | sometimes | only with more than one replica (data
                                             parallelism, as the four fields below): the
                                             pipeline (replica) this rank belongs to, from 0;
                                             without them the rank is pipeline rank `rank` of
                                             the only pipeline
    replicas          | int    | sometimes | the number of replicas (pipelines) in the job
    pipeline_rank     | int    | sometimes | this rank's rank within its pipeline: the index
                                             its plan and stages are given by
    pipeline_ranks    | list of int | sometimes | the global rank of each pipeline rank of
                                                  this rank's pipeline, so a log says who it is
                                                  even without meta.json
    """,
)
"""The first line of a rank log."""

EVENTS: dict[str, Record] = {
    event.name: event
    for event in (
        record(
            RUN_START,
            """
            config | object         | always   | as in meta.json
            plan   | list of string | required | this rank's plan, bubbles removed
            stages | list of int    | always   | the stages this rank holds
            """,
        ),
        record(
            CLOCK,
            """
            phase          | string | always   | `"start"` or `"end"`
            offset_ns      | int    | required | this rank's clock minus rank 0's clock
            uncertainty_ns | int    | always   | half the best round trip: the true offset
                                                 lies within ± this
            reference_rank | int    | always   | always 0
            """,
        ),
        record(ITER_BEGIN, "it | int | required | iteration number"),
        record(
            ITER_END,
            """
            it   | int           | required | iteration number
            loss | float or null | always   | mean loss over the micro-batches on the rank
                                              that holds the last stage; null elsewhere
            nonfinite | string   | sometimes | only when that loss was not a finite number
                                              (JSON has none): `"nan"`, `"inf"` or `"-inf"`;
                                              `loss` is then null
            """,
        ),
        record(
            STEP_BEGIN,
            """
            id   | int    | required | pairs it with its `step_end`
            it   | int    | required | iteration
            pos  | int    | required | plan position
            step | string | required | canonical step text, e.g. `2F0`, `1I3`, `0SEND_F1`,
                                       `(0F7;7B3)OVERLAP_F_B`
            th   | string | required | thread: `"main"` or `"overlap"`
            """,
        ),
        record(
            STEP_END,
            """
            id    | int | required  | the `step_begin` it ends
            bytes | int | sometimes | only on an activation swap launch (`OFFLOAD`, `LOAD`):
                                      the bytes of saved activations it copies
            """,
        ),
        record(
            P2P_POST,
            """
            id    | int                  | required  | pairs it with its `p2p_done`
            it    | int                  | required  | iteration
            op    | `"send"` or `"recv"` | required  | the operation posted
            step  | string               | required  | the SEND/RECV step that posted it
            peer  | int                  | required  | the other rank (a global rank of the
                                                       same pipeline)
            ch    | string               | required  | channel: `"F"` (activations) or `"B"`
                                                       (gradients); readers keep an unknown one
            seq   | int                  | required  | sequence number per (op, peer,
                                                       channel), from 0 each iteration; a send
                                                       and the recv it matches have equal
                                                       (iteration, channel, seq)
            bytes | int                  | required  | payload size
            shape | list of int          | required  | tensor shape
            dtype | string               | required  | e.g. `"float32"`
            stack | list of string       | sometimes | only in `full` mode: the Python stack
                                                       that posted it, innermost last
            """,
        ),
        record(P2P_DONE, "id | int | required | the `p2p_post` it completes"),
        record(
            STALL,
            """
            stacks     | object         | always    | thread name -> list of frames
                                                      (`file:line in function: code`), innermost
                                                      last
            open_steps | list of object | always    | steps begun and not ended:
                                                      `{"id", "thread", "pos", "step", "it"}`;
                                                      `it` (the iteration, as in `step_begin`)
                                                      is optional: older logs lack it, and
                                                      readers then take the iteration begun
                                                      and not ended, if any
            inflight   | list of object | always    | P2P ops posted and not completed, each a
                                                      `p2p_post` event
            waiting_in | string         | sometimes | only when the rank waits in a collective
                                                      outside iterations: `"the end-of-run clock
                                                      exchange"`
            idle_s     | float          | always    | seconds since the last event
            device_pending | list of object | sometimes | only with device timing: work
                                                          enqueued and not completed on the
                                                          device, oldest first: `{"id",
                                                          "step", "stream", "enqueued_t",
                                                          "age_s", "started"}`
            """,
        ),
        record(
            DUMP,
            """
            stacks     | object         | always    | as in `stall`
            open_steps | list of object | always    | as in `stall`
            inflight   | list of object | always    | as in `stall`
            waiting_in | string         | sometimes | as in `stall`
            reason     | string         | always    | `"SIGUSR1"`
            device_pending | list of object | sometimes | as in `stall`
            """,
        ),
        record(
            SIGNAL,
            """
            signal     | string         | always | e.g. `"SIGTERM"`, `"SIGINT"`
            open_steps | list of object | always | as in `stall`
            """,
        ),
        record(
            EXCEPTION,
            """
            type       | string         | always | exception class name
            message    | string         | always | `str(exception)`
            traceback  | string         | always | the formatted traceback
            open_steps | list of object | always | as in `stall`
            device_pending | list of object | sometimes | as in `stall`
            """,
        ),
        record(
            ABORT,
            """
            idle_s     | float  | always    | seconds since the last progress
            message    | string | always    | what was printed to stderr
            waiting_in | string | sometimes | as in `stall`
            """,
        ),
        record(RUN_END, "device_pending | list of object | sometimes | as in `stall`"),
        record(
            DEVICE,
            """
            id     | int    | required | the `step_begin` or `p2p_post` it times; its `t` is
                                         when the device timer resolved it, so it comes after
                                         the `step_end` / `p2p_done`: readers join by `id`
            db     | int    | required | device begin, ns on the rank's clock (as `t`: the
                                         `clock` offsets apply)
            de     | int    | required | device end, same clock
            stream | string | always   | `"compute"` or `"p2p"`
            unc    | int    | always   | the anchor's uncertainty, ns: `db` and `de` lie
                                         within ± this
            """,
        ),
        record(
            DEVICE_ANCHOR,
            """
            index          | int   | always | 0 at start, then 1, 2, ... (every re-anchor)
            uncertainty_ns | int   | always | ± of the anchor's host time, which is `t`
            rate           | float | always | host ns per device ns since the previous anchor
            """,
        ),
        record(
            MEMORY,
            """
            id        | int         | required  | the `step_begin` whose step had just ended
                                                  when the sample was taken; a sample is
                                                  written only when a value changed since
                                                  the rank's previous one, and holds until
                                                  the next
            saved     | list of int | required  | per stage of the rank (in `run_start`
                                                  `stages` order): bytes of activations kept
                                                  for the stage's pending backward steps
                                                  (torch: what autograd saved in the
                                                  forward, each tensor once, parameters
                                                  left out; MindSpore: the stage input it
                                                  keeps)
            inflight  | list of int | required  | per stage: bytes of received activations
                                                  and gradients no compute step has
                                                  consumed yet
            swapped   | list of int | sometimes | only when the plan has activation swap
                                                  steps: per stage, bytes of saved
                                                  activations offloaded to the host and not
                                                  loaded back (waited); `saved` counts only
                                                  what stayed on the device
            allocated | int         | sometimes | only on CUDA: the caching allocator's
                                                  allocated bytes (`memory_allocated`)
            reserved  | int         | sometimes | only on CUDA: its reserved bytes
                                                  (`memory_reserved`)
            """,
        ),
    )
}
"""Every event type, by name."""

EVENT_TYPES = tuple(EVENTS)


def template_parts(
    event: Record, optional: tuple[str, ...] = ()
) -> tuple[list[tuple[bytes, FieldType]], bytes]:
    """The line orjson writes for ``event`` as literal texts, each followed by a value of its
    type, and the text after the last value: ``t``, then the required fields in declared
    order, then the ``optional`` ones named (a writer appends a field readers do without
    before the final ``}``). The recorder's templates and the reader's template matching
    (`pipetrace.analyze.templated`) are both made from this."""
    parts = [(b'{"e":"%s","t":' % event.name.encode(), INT)]
    fields = list(event.fields)
    while fields and not fields[-1].required:
        fields.pop()
    by_name = {f.name: f for f in event.fields}
    for f in fields:
        if not f.required:
            raise ValueError(f"{event.name}.{f.name}: a field readers do without comes first")
    for f in fields + [by_name[name] for name in optional]:
        parts.append((b',"%s":' % f.name.encode(), f.type))
    return parts, b"}"


def line_template(event: Record) -> bytes:
    """A ``%`` template of the line orjson writes for ``event`` (`template_parts`), for writers
    that skip building a dict: an int field takes an int, any other a JSON literal (bytes
    from ``orjson.dumps``). Fields readers do without are left out: a writer inserts
    ``,"name":<JSON>`` before the final ``}`` of the line for each one it writes."""
    parts, tail = template_parts(event)
    return b"".join(text + (b"%d" if kind is INT else b"%s") for text, kind in parts) + tail + b"\n"


def node_run_id(host: str, pid: int, start: str) -> str:
    """The id a run gets when nobody named it: the host, pid and start time of the process
    (launcher or torchrun agent) that started the node's ranks. Each node of a multi-node
    run derives its own, so two such ids may differ within one run."""
    return f"{host}:{pid}:{start}"


def is_node_run_id(run_id: str) -> bool:
    """Is ``run_id`` of the `node_run_id` form (one node's own, not a name all nodes share)?"""
    parts = run_id.rsplit(":", 2)
    return len(parts) == 3 and parts[1].isdigit() and (parts[2].isdigit() or parts[2] == "?")


MAX_PENDING_AGE_S = 1e9
"""A `device_pending` entry's ``age_s`` beyond this (31 years) is no age: a damaged value."""


def is_pending_entry(item: Any) -> bool:
    """Is ``item`` a `device_pending` entry readers can use: an object with its ``step`` text
    and an ``age_s`` that is a number of seconds from 0 up to `MAX_PENDING_AGE_S`?"""
    if not isinstance(item, dict) or not isinstance(item.get("step"), str):
        return False
    age = item.get("age_s")
    return type(age) in (int, float) and 0 <= age < MAX_PENDING_AGE_S


def listed(fields: dict[str, Any], name: str) -> list[Any]:
    """A list field of a lifecycle event (``open_steps``, ``inflight``) as a list; empty
    when a damaged line has another type there (it is kept, and counted as damage)."""
    value = fields.get(name)
    return value if isinstance(value, list) else []


def is_rank_log_name(name: str) -> bool:
    """Is ``name`` what a reader takes for a rank log (``rank-*.ndjson``)?"""
    return name.startswith("rank-") and name.endswith(".ndjson")


def rank_log_name(rank: int) -> str:
    return f"rank-{rank:05d}.ndjson"


def rank_log_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / rank_log_name(rank)
