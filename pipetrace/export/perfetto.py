"""A `Layout` as a native Perfetto trace (the protobuf ``Trace`` of the `perfetto` package).

One packet sequence (``trusted_packet_sequence_id`` 1):

1. track descriptors, every track before any event: a root descriptor asking the UI to
   order processes explicitly, one process per rank (``sibling_order_rank`` = rank) and its
   named child tracks (counters with a ``CounterDescriptor``);
2. a packet that clears incremental state and interns every event name, annotation name
   and repeated annotation string; it also makes clock 64 the default timestamp clock;
3. a ``ClockSnapshot``: clock 64 is incremental (each packet's timestamp is the delta to
   the previous one) and reads 0 at `Run.t0_ns` on BOOTTIME and REALTIME;
4. the events, sorted by time, each a ``TrackEvent`` that refers to interned names.

The few header packets are built with the generated protos; the events are encoded in bulk
by `pipetrace.export.wire` (per-packet proto objects cost ~10 µs per slice).

At equal timestamps the order is: ends of spans that began earlier (innermost first),
zero-length spans and instants, begins (outermost first), and last the completion of a
recv: its ``arrived`` instant, which ends a flow begun earlier, then the recv's end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from pipetrace.analyze.model import CHANNELS, OPS
from pipetrace.export import args as A
from pipetrace.export import wire
from pipetrace.export.args import SliceArgs, slice_args
from pipetrace.export.columns import SLICE_ITERATION, Layout

SEQUENCE_ID = 1
CLOCK_ID = 64  # a sequence-scoped clock (64..127)
CHUNK_EVENTS = 1 << 18
BEGIN, END, INSTANT, COUNTER = range(4)
_TYPES = (
    pb.TrackEvent.TYPE_SLICE_BEGIN,
    pb.TrackEvent.TYPE_SLICE_END,
    pb.TrackEvent.TYPE_INSTANT,
    pb.TrackEvent.TYPE_COUNTER,
)

Progress = Callable[[float], None]


def write_perfetto(layout: Layout, out: IO[bytes], *, progress: Progress | None = None) -> int:
    """Write the trace to ``out``; returns the number of bytes written."""
    enc = _Interning(layout)
    written = out.write(_header(layout, enc))
    etype, index, ts = event_order(layout)
    n = len(ts)
    delta = np.diff(ts, prepend=np.int64(0))
    sargs = enc.args
    for lo in range(0, n, CHUNK_EVENTS):
        hi = min(lo + CHUNK_EVENTS, n)
        written += out.write(_events(layout, enc, sargs, etype[lo:hi], index[lo:hi], delta[lo:hi]))
        if progress:
            progress(hi / n)
    return written


def event_order(layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(event type, index into its table, timestamp) of every event, in writing order."""
    s, ins, c = layout.slices, layout.instants, layout.counters
    n = len(s)
    rank_of = np.empty(n, np.int64)
    rank_of[np.lexsort((np.arange(n), -s.end, s.begin))] = np.arange(n)
    parent = np.zeros(n, bool)
    parent[ins.parent[ins.parent >= 0]] = True
    zero = s.end == s.begin
    b_phase = np.where(parent & zero, 3, np.where(zero, 1, 2))
    e_phase = np.where(parent, 3, np.where(zero, 1, 0))
    e_sub = np.where(parent | zero, rank_of, -rank_of)
    arrival = ins.parent >= 0
    i_phase = np.where(arrival, 3, 1)
    i_sub = (
        np.where(arrival, rank_of[np.maximum(ins.parent, 0)], -1) if n else np.full(len(ins), -1)
    )
    ts = np.concatenate([s.begin, s.end, ins.ts, c.ts])
    phase = np.concatenate([b_phase, e_phase, i_phase, np.ones(len(c), np.int64)])
    sub = np.concatenate([rank_of, e_sub, i_sub, np.full(len(c), -1)])
    sub2 = np.concatenate(
        [
            np.zeros(n, np.int64),
            np.where(parent, 2, 1),
            np.ones(len(ins), np.int64),
            np.zeros(len(c), np.int64),
        ]
    )
    etype = np.concatenate(
        [np.full(n, BEGIN), np.full(n, END), np.full(len(ins), INSTANT), np.full(len(c), COUNTER)]
    ).astype(np.int8)
    index = np.concatenate([np.arange(n), np.arange(n), np.arange(len(ins)), np.arange(len(c))])
    span = 2 * n + 3  # sub lies in [-n, n]
    order = np.lexsort(((phase * span + sub + n + 1) * 3 + sub2, ts))
    return etype[order], index[order], ts[order]


class _Interning:
    """Interned names and strings (iid = position + 1), the per-slice string iids, and the
    rare long annotations (findings, recorded events, losses) as pre-encoded bytes."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        run = layout.run
        detail_keys = sorted({k for d in layout.details for k in d} - set(A.NAMES))
        self.ann_names = list(A.NAMES) + detail_keys
        self.ann = {name: i + 1 for i, name in enumerate(self.ann_names)}
        self.strings: list[str] = []
        self._string_ids: dict[str, int] = {}
        self.args = a = slice_args(layout)
        lookup = {
            A.OP: [self.string(o) for o in OPS],
            A.CHANNEL: [self.string(c) for c in CHANNELS],
            A.SHAPE: [self.string(str(list(shape))) for shape in run.shapes],
            A.DTYPE: [self.string(str(d)) for d in run.dtypes],
        }
        self.string_args = {}
        for name, column in (
            (A.OP, a.op),
            (A.CHANNEL, a.channel),
            (A.SHAPE, a.shape),
            (A.DTYPE, a.dtype),
        ):
            table = np.array(lookup[name] + [0], np.int64)  # an index out of range reads 0: absent
            valid = (column >= 0) & (column < len(lookup[name]))
            self.string_args[name] = table[np.where(valid, column, len(lookup[name]))]
        self.unfinished = self.annotations([(A.UNFINISHED, True)])
        # long annotations, written as the last part of an event (see wire.assemble)
        self.extras = [self.annotations([(A.FINDING, note)]) for note in layout.notes]
        s = layout.slices
        self.slice_extra = s.note.astype(np.int64)
        for row in np.flatnonzero((s.kind == SLICE_ITERATION) & ~np.isnan(a.loss)).tolist():
            self.extras.append(self.annotations([(A.LOSS, float(a.loss[row]))]))
            self.slice_extra[row] = len(self.extras) - 1
        ins = layout.instants
        self.instant_extra = np.full(len(ins), -1, np.int64)
        for row in np.flatnonzero(ins.detail >= 0).tolist():
            self.extras.append(self.annotations(list(layout.details[int(ins.detail[row])].items())))
            self.instant_extra[row] = len(self.extras) - 1

    def string(self, text: str) -> int:
        found = self._string_ids.get(text)
        if found is None:
            self.strings.append(text)
            found = self._string_ids[text] = len(self.strings)
        return found

    def annotations(self, items: list[tuple[str, Any]]) -> bytes:
        """Encoded ``debug_annotations`` of a TrackEvent (built with the protos: rare values)."""
        event = pb.TrackEvent()
        for name, value in items:
            if value is None:
                continue
            ann = event.debug_annotations.add(name_iid=self.ann[name])
            if isinstance(value, bool):
                ann.bool_value = value
            elif isinstance(value, int) and -(2**63) <= value < 2**63:
                ann.int_value = value
            elif isinstance(value, float):
                ann.double_value = value
            else:
                ann.string_value = str(value)
        return event.SerializeToString()


def _annotation(
    name_iid: int, value_field: int, values: np.ndarray, rows: np.ndarray
) -> list[wire.Col]:
    """A ``debug_annotations`` entry on ``rows``: an interned name and an integer value field
    (``int_value`` or ``string_value_iid``). Two parts: everything before the value (its size
    only depends on the value's size), then the value."""
    value = wire.varint(values, rows)
    head = (
        wire.key(1, wire.VARINT) + wire.encode_varint(name_iid) + wire.key(value_field, wire.VARINT)
    )
    prefixes = [
        wire.key(4, wire.LEN) + wire.encode_varint(len(head) + size) + head for size in range(11)
    ]
    return [wire.table_rows(rows, value.lens, prefixes), value]


_INT_VALUE, _STRING_VALUE_IID = 4, 17


@dataclass
class _Rows:
    """Which rows of a run of events are which kind, and the item each row is about."""

    n: int
    begins: np.ndarray
    slices: np.ndarray
    instants: np.ndarray
    counters: np.ndarray
    named: np.ndarray  # begins and instants: the rows that carry a name
    si: np.ndarray  # per row: its slice (0 where the row is about another kind)
    ii: np.ndarray  # per row: its instant (0 where the row is about another kind)

    @classmethod
    def of(cls, etype: np.ndarray, index: np.ndarray) -> _Rows:
        n = len(etype)
        slices, instants = wire.rows_where(etype <= END), wire.rows_where(etype == INSTANT)
        si, ii = np.zeros(n, np.int64), np.zeros(n, np.int64)
        si[slices], ii[instants] = index[slices], index[instants]
        return cls(
            n,
            begins=wire.rows_where(etype == BEGIN),
            slices=slices,
            instants=instants,
            counters=wire.rows_where(etype == COUNTER),
            named=wire.rows_where((etype == BEGIN) | (etype == INSTANT)),
            si=si,
            ii=ii,
        )


def _events(
    layout: Layout,
    enc: _Interning,
    a: SliceArgs,
    etype: np.ndarray,
    index: np.ndarray,
    delta: np.ndarray,
) -> bytes:
    """The packets of a run of events (one row each), encoded column by column."""
    rows = _Rows.of(etype, index)
    every = np.arange(rows.n)
    te = _track_event(layout, enc, etype, index, rows)
    if len(rows.begins):
        te += _slice_fields(layout, enc, a, rows)
    if len(rows.instants):
        flow = np.zeros(rows.n, np.int64)
        flow[rows.instants] = layout.instants.flow[rows.ii[rows.instants]]
        te += wire.field_fixed64(48, flow, wire.rows_where(flow > 0))
    if len(rows.counters):
        values = _spread(layout.counters.value, index, rows.counters, rows.n)
        te += wire.field_varint(30, values, rows.counters)
    te.append(wire.table(_extras(layout, enc, rows), enc.extras))
    packet = [
        *wire.field_varint(8, delta, every),
        wire.const(wire.key(10, wire.VARINT) + wire.encode_varint(SEQUENCE_ID), every),
        wire.const(
            wire.key(13, wire.VARINT)
            + wire.encode_varint(pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE),
            rows.named,
        ),
        *wire.field_message(11, te, every, rows.n),
    ]
    return wire.assemble(wire.field_message(1, packet, every, rows.n), rows.n)


def _track_event(
    layout: Layout, enc: _Interning, etype: np.ndarray, index: np.ndarray, rows: _Rows
) -> list:
    """Every row's TrackEvent type, track and (begins and instants) name."""
    s, ins, c = layout.slices, layout.instants, layout.counters
    track = np.zeros(rows.n, np.int64)
    name = np.zeros(rows.n, np.int64)
    if len(rows.slices):
        track[rows.slices] = s.track[rows.si[rows.slices]]
        name[rows.begins] = s.name[rows.si[rows.begins]]
    if len(rows.instants):
        track[rows.instants] = ins.track[rows.ii[rows.instants]]
        name[rows.instants] = ins.name[rows.ii[rows.instants]]
    if len(rows.counters):
        track[rows.counters] = c.track[index[rows.counters]]
    return [
        wire.table(
            etype.astype(np.int64),
            [wire.key(9, wire.VARINT) + wire.encode_varint(t) for t in _TYPES],
        ),
        *wire.field_varint(11, track, np.arange(rows.n)),
        *wire.field_varint(10, name + 1, rows.named),
    ]


def _slice_fields(layout: Layout, enc: _Interning, a: SliceArgs, rows: _Rows) -> list:
    """A slice begin's annotations, its unfinished mark and its flow."""
    s, begins, at = layout.slices, rows.begins, rows.si[rows.begins]
    out: list = []
    for ann, column in (
        (A.STAGE, a.stage),
        (A.MICROBATCH, a.microbatch),
        (A.ITERATION, a.iteration),
        (A.POSITION, a.position),
        (A.PEER, a.peer),
        (A.SEQ, a.seq),
        (A.BYTES, a.nbytes),
    ):
        values = np.full(rows.n, -1, np.int64)
        values[begins] = column[at]
        out += _annotation(enc.ann[ann], _INT_VALUE, values, wire.rows_where(values >= 0))
    for ann, iids in enc.string_args.items():
        values = np.zeros(rows.n, np.int64)
        values[begins] = iids[at]
        out += _annotation(enc.ann[ann], _STRING_VALUE_IID, values, wire.rows_where(values > 0))
    out.append(wire.const(enc.unfinished, begins[s.unfinished[at]]))
    flow = np.zeros(rows.n, np.int64)
    flow[begins] = s.flow[at]
    return out + wire.field_fixed64(47, flow, wire.rows_where(flow > 0))


def _extras(layout: Layout, enc: _Interning, rows: _Rows) -> np.ndarray:
    """Per row, its extra fields' entry in ``enc.extras`` (-1: none)."""
    extra = np.full(rows.n, -1, np.int64)
    if len(rows.begins):
        extra[rows.begins] = enc.slice_extra[rows.si[rows.begins]]
    if len(rows.instants):
        extra[rows.instants] = enc.instant_extra[rows.ii[rows.instants]]
    return extra


def _spread(values: np.ndarray, index: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, np.int64)
    out[rows] = values[index[rows]]
    return out


def _header(layout: Layout, enc: _Interning) -> bytes:
    packets = []

    def packet() -> pb.TracePacket:
        p = pb.TracePacket(trusted_packet_sequence_id=SEQUENCE_ID)
        packets.append(p)
        return p

    root = packet().track_descriptor
    root.uuid = 0
    root.process_ordering = pb.TrackDescriptor.PROCESS_ORDERING_EXPLICIT
    for t in layout.tracks:
        d = packet().track_descriptor
        d.uuid = t.uuid
        d.sibling_order_rank = t.order
        if t.pid is not None:
            d.process.pid = t.pid
            d.process.process_name = t.name
            d.child_ordering = pb.TrackDescriptor.EXPLICIT
            continue
        d.name = t.name
        if t.parent:
            d.parent_uuid = t.parent
        if t.counter:
            d.counter.SetInParent()
    first = packet()
    first.sequence_flags = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    first.trace_packet_defaults.timestamp_clock_id = CLOCK_ID
    interned = first.interned_data
    interned.event_names.extend(pb.EventName(iid=i + 1, name=n) for i, n in enumerate(layout.names))
    interned.debug_annotation_names.extend(
        pb.DebugAnnotationName(iid=i + 1, name=n) for i, n in enumerate(enc.ann_names)
    )
    interned.debug_annotation_string_values.extend(
        pb.InternedString(iid=i + 1, str=s.encode()) for i, s in enumerate(enc.strings)
    )
    snapshot = packet().clock_snapshot
    snapshot.clocks.add(clock_id=CLOCK_ID, timestamp=0, is_incremental=True)
    for builtin in (pb.BUILTIN_CLOCK_BOOTTIME, pb.BUILTIN_CLOCK_REALTIME):
        snapshot.clocks.add(clock_id=builtin, timestamp=layout.run.t0_ns)
    return b"".join(wire.frame(p.SerializeToString()) for p in packets)
