"""Read an export back with the real generated protos (and json), checking the invariants
the trace processor relies on. No trace_processor binary is involved.

`decode_perfetto` resolves interning and the incremental clock like the trace processor
does and asserts, while reading: every track is declared before its first event, the
timestamps of each track never go back, slices begin and end balanced per track (ends
close the innermost open slice), every flow ends after it began and only once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import orjson
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb


@dataclass
class Event:
    ts: int
    track: int
    type: int
    name: str | None
    args: dict[str, Any]
    flow_ids: list[int] = field(default_factory=list)
    terminating_flow_ids: list[int] = field(default_factory=list)
    value: int | None = None


@dataclass
class Slice:
    track: int
    name: str
    begin: int
    end: int
    args: dict[str, Any]
    flow_ids: list[int]
    depth: int
    parent: Slice | None = None


@dataclass
class Decoded:
    tracks: dict[int, pb.TrackDescriptor]
    events: list[Event]
    slices: list[Slice]
    instants: list[Event]
    counters: list[Event]
    flows: dict[int, tuple[Event, Event]]  # id -> (begin event, terminating event)
    t0_ns: int

    def track_name(self, uuid: int) -> str:
        t = self.tracks[uuid]
        return t.process.process_name if t.HasField("process") else t.name

    def rank_of(self, uuid: int) -> int:
        """The rank whose process holds the track (-1 for a top-level track)."""
        t = self.tracks[uuid]
        while not t.HasField("process"):
            if not t.parent_uuid:
                return -1
            t = self.tracks[t.parent_uuid]
        return int(t.process.process_name.split()[1])

    def on(self, rank: int, track_name: str) -> list[Slice]:
        return [
            s
            for s in self.slices
            if self.rank_of(s.track) == rank and self.track_name(s.track) == track_name
        ]


def _annotation(ann: pb.DebugAnnotation, strings: dict[int, str]) -> Any:
    kind = ann.WhichOneof("value")
    if kind == "string_value_iid":
        return strings[ann.string_value_iid]
    return getattr(ann, kind) if kind else None


def decode_perfetto(data: bytes) -> Decoded:
    trace = pb.Trace.FromString(data)
    tracks: dict[int, pb.TrackDescriptor] = {}
    names: dict[int, str] = {}
    ann_names: dict[int, str] = {}
    strings: dict[int, str] = {}
    clocks: dict[int, dict] = {}
    default_clock = None
    incremental_valid = False
    now = None  # the incremental clock
    t0 = 0
    events: list[Event] = []
    for packet in trace.packet:
        assert packet.trusted_packet_sequence_id == 1
        if packet.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
            incremental_valid = True
            names.clear(), ann_names.clear(), strings.clear()
        if packet.HasField("trace_packet_defaults"):
            default_clock = packet.trace_packet_defaults.timestamp_clock_id
        if packet.HasField("interned_data"):
            d = packet.interned_data
            names.update({e.iid: e.name for e in d.event_names})
            ann_names.update({e.iid: e.name for e in d.debug_annotation_names})
            strings.update({e.iid: e.str.decode() for e in d.debug_annotation_string_values})
        if packet.HasField("clock_snapshot"):
            for c in packet.clock_snapshot.clocks:
                clocks[c.clock_id] = {"ts": c.timestamp, "inc": c.is_incremental}
            assert clocks[64]["inc"] and clocks[64]["ts"] == 0
            now = 0
            t0 = clocks[pb.BUILTIN_CLOCK_BOOTTIME]["ts"]
        if packet.HasField("track_descriptor"):
            d = packet.track_descriptor
            assert d.uuid not in tracks, f"track {d.uuid} declared twice"
            if d.HasField("parent_uuid"):
                assert d.parent_uuid in tracks, (
                    f"track {d.uuid}'s parent {d.parent_uuid} is not declared before it"
                )
            tracks[d.uuid] = d
        if not packet.HasField("track_event"):
            continue
        assert default_clock == 64 and now is not None, "event before the clock snapshot"
        assert packet.HasField("timestamp")
        now += packet.timestamp
        e = packet.track_event
        assert e.track_uuid in tracks, f"event on undeclared track {e.track_uuid}"
        if e.HasField("name_iid") or len(e.debug_annotations):
            assert (
                packet.sequence_flags & pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
                and incremental_valid
            )
        args = {ann_names[a.name_iid]: _annotation(a, strings) for a in e.debug_annotations}
        events.append(
            Event(
                now,
                e.track_uuid,
                e.type,
                names[e.name_iid] if e.HasField("name_iid") else None,
                args,
                list(e.flow_ids),
                list(e.terminating_flow_ids),
                e.counter_value if e.HasField("counter_value") else None,
            )
        )
    return _check(tracks, events, t0)


def _check(tracks: dict[int, pb.TrackDescriptor], events: list[Event], t0: int) -> Decoded:
    last: dict[int, int] = {}
    stacks: dict[int, list[tuple[Event, Slice | None]]] = defaultdict(list)
    slices: list[Slice] = []
    instants: list[Event] = []
    counters: list[Event] = []
    started: dict[int, Event] = {}
    flows: dict[int, tuple[Event, Event]] = {}
    for e in events:
        assert e.ts >= last.get(e.track, 0), f"time goes back on track {e.track}"
        last[e.track] = e.ts
        stack = stacks[e.track]
        for fid in e.flow_ids:
            assert fid not in started, f"flow {fid} begun twice"
            started[fid] = e
        for fid in e.terminating_flow_ids:
            assert fid in started, f"flow {fid} ends before it begins"
            assert fid not in flows, f"flow {fid} ends twice"
            flows[fid] = (started[fid], e)
        if e.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            assert not tracks[e.track].HasField("counter")
            parent = stack[-1][1] if stack else None
            s = Slice(e.track, e.name, e.ts, -1, e.args, e.flow_ids, len(stack), parent)
            stack.append((e, s))
        elif e.type == pb.TrackEvent.TYPE_SLICE_END:
            assert stack, f"unbalanced end on track {e.track} at {e.ts}"
            _, s = stack.pop()
            s.end = e.ts
            slices.append(s)
        elif e.type == pb.TrackEvent.TYPE_INSTANT:
            e.args["_parent"] = stack[-1][1] if stack else None
            instants.append(e)
        elif e.type == pb.TrackEvent.TYPE_COUNTER:
            assert tracks[e.track].HasField("counter") and e.value is not None
            counters.append(e)
    for track, stack in stacks.items():
        assert not stack, f"{len(stack)} slice(s) never end on track {track}"
    assert set(flows) == set(started), "flows that never end"
    return Decoded(tracks, events, slices, instants, counters, flows, t0)


@dataclass
class JsonTrace:
    events: list[dict]
    threads: dict[tuple[int, int], str]  # (pid, tid) -> thread name
    processes: dict[int, str]

    def rank_of(self, pid: int) -> int:
        return int(self.processes[pid].split()[1]) if pid in self.processes else -1

    def on(self, rank: int, thread: str, ph: str = "X") -> list[dict]:
        return [
            e
            for e in self.events
            if e["ph"] == ph
            and self.rank_of(e["pid"]) == rank
            and self.threads.get((e["pid"], e.get("tid"))) == thread
        ]


def decode_chrome_json(data: bytes) -> JsonTrace:
    doc = orjson.loads(data)
    events = doc["traceEvents"]
    threads, processes = {}, {}
    for e in events:
        assert "ph" in e and "pid" in e
        if e["ph"] == "M" and e["name"] == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
        if e["ph"] == "M" and e["name"] == "process_name":
            processes[e["pid"]] = e["args"]["name"]
    return JsonTrace(events, threads, processes)
