"""The columnar encoder against the real generated protos."""

from __future__ import annotations

import io
import struct

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from pipetrace.export import wire
from pipetrace.export.perfetto import (
    BEGIN,
    COUNTER,
    END,
    INSTANT,
    _Interning,
    event_order,
    write_perfetto,
)

int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@given(st.lists(int64s, min_size=1, max_size=50))
def test_varints_match_the_reference_encoding(values):
    col = wire.varint(np.array(values, np.int64), np.arange(len(values)))
    for k, v in enumerate(values):
        assert bytes(col.mat[k, : col.lens[k]]) == wire.encode_varint(v)
    assert wire.encode_varint(300) == b"\xac\x02"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2**40),
            st.one_of(st.none(), int64s),
            st.one_of(st.none(), st.integers(1, 2**64 - 1)),
            st.one_of(st.none(), st.text(min_size=0, max_size=200)),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_sparse_rows_decode_with_the_protos(rows):
    """Packets whose fields are present on some rows only (and a wide string on a few)."""
    n = len(rows)
    uuid = np.array([r[0] for r in rows], np.int64)
    has_value = np.array([r[1] is not None for r in rows])
    value = np.array([r[1] or 0 for r in rows], np.int64)
    has_flow = np.array([r[2] is not None for r in rows])
    flow = np.array([r[2] or 0 for r in rows], np.uint64)
    texts = [r[3] for r in rows]
    entries = []
    index = np.full(n, -1, np.int64)
    for k, t in enumerate(texts):
        if t is not None:
            ev = pb.TrackEvent()
            ev.debug_annotations.add(name_iid=3, string_value=t)
            entries.append(ev.SerializeToString())
            index[k] = len(entries) - 1
    every = np.arange(n)
    te = [
        *wire.field_varint(11, uuid, every),
        *wire.field_varint(30, value, wire.rows_where(has_value)),
        *wire.field_fixed64(47, flow, wire.rows_where(has_flow)),
        wire.table(index, entries),
    ]
    packet = [wire.const(b"\x50\x01", every), *wire.field_message(11, te, every, n)]
    trace = pb.Trace.FromString(wire.assemble(wire.field_message(1, packet, every, n), n))
    assert len(trace.packet) == n
    for p, (u, v, f, t) in zip(trace.packet, rows):
        expected = pb.TracePacket(trusted_packet_sequence_id=1)
        expected.track_event.track_uuid = u
        if v is not None:
            expected.track_event.counter_value = v
        if f is not None:
            expected.track_event.flow_ids.append(f)
        if t is not None:
            expected.track_event.debug_annotations.add(name_iid=3, string_value=t)
        assert p == expected


def test_fixed64_is_little_endian():
    col = wire.fixed64(np.array([1, 2**64 - 1], np.uint64), np.arange(2))
    assert bytes(col.mat[0]) == struct.pack("<Q", 1) and bytes(col.mat[1]) == b"\xff" * 8


def _reference_events(layout) -> list[pb.TracePacket]:
    """The event packets built one by one with the protos: what the columnar writer must produce."""
    enc = _Interning(layout)
    a, s, ins, c = enc.args, layout.slices, layout.instants, layout.counters
    etype, index, ts = event_order(layout)
    out, prev = [], 0
    for et, i, t in zip(etype.tolist(), index.tolist(), ts.tolist()):
        p = pb.TracePacket(timestamp=t - prev, trusted_packet_sequence_id=1)
        prev = t
        e = p.track_event
        e.type = {
            BEGIN: e.TYPE_SLICE_BEGIN,
            END: e.TYPE_SLICE_END,
            INSTANT: e.TYPE_INSTANT,
            COUNTER: e.TYPE_COUNTER,
        }[et]
        if et in (BEGIN, END):
            e.track_uuid = int(s.track[i])
        if et == BEGIN:
            e.name_iid = int(s.name[i]) + 1
            for name, column in (
                ("stage", a.stage),
                ("microbatch", a.microbatch),
                ("iteration", a.iteration),
                ("position", a.position),
                ("peer", a.peer),
                ("seq", a.seq),
                ("bytes", a.nbytes),
            ):
                if column[i] >= 0:
                    e.debug_annotations.add(name_iid=enc.ann[name], int_value=int(column[i]))
            for name, iids in enc.string_args.items():
                if iids[i] > 0:
                    e.debug_annotations.add(name_iid=enc.ann[name], string_value_iid=int(iids[i]))
            if s.unfinished[i]:
                e.debug_annotations.add(name_iid=enc.ann["unfinished"], bool_value=True)
            if s.flow[i]:
                e.flow_ids.append(int(s.flow[i]))
            if enc.slice_extra[i] >= 0:
                e.MergeFromString(enc.extras[enc.slice_extra[i]])
            p.sequence_flags = p.SEQ_NEEDS_INCREMENTAL_STATE
        elif et == INSTANT:
            e.track_uuid = int(ins.track[i])
            e.name_iid = int(ins.name[i]) + 1
            if ins.flow[i]:
                e.terminating_flow_ids.append(int(ins.flow[i]))
            if enc.instant_extra[i] >= 0:
                e.MergeFromString(enc.extras[enc.instant_extra[i]])
            p.sequence_flags = p.SEQ_NEEDS_INCREMENTAL_STATE
        elif et == COUNTER:
            e.track_uuid = int(c.track[i])
            e.counter_value = int(c.value[i])
        out.append(p)
    return out


def test_writer_matches_packets_built_with_the_protos(recorded):
    for name in ("deadlock", "overlap-dualpipev", "crash"):
        layout = recorded(name).layout
        buf = io.BytesIO()
        write_perfetto(layout, buf)
        packets = [
            p for p in pb.Trace.FromString(buf.getvalue()).packet if p.HasField("track_event")
        ]
        reference = _reference_events(layout)
        assert len(packets) == len(reference)
        for ours, ref in zip(packets, reference):
            assert ours == ref
