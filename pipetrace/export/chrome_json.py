"""A `Layout` as Chrome JSON (the Trace Event Format), for tools that read only that.

The same content as the Perfetto export: a process per rank (``pid``), a thread per track
(``tid``, named and ordered with metadata events), complete events (``X``) for slices,
instants (``i``), counters (``C``). A message's flow uses flow v2 binding: ``bind_id`` with
``flow_out`` on the send's slice and ``flow_in`` on a zero-length ``arrived`` slice at the
recv's completion (the arrangement that draws in the right direction). Times are
microseconds since `Run.t0_ns`, with nanosecond decimals.

A decimal microsecond time is not exact as a double, and importers differ in rounding or
truncating ``ts * 1000`` back to nanoseconds; truncation can make a slice end 1 ns after
the next one begins, which breaks nesting. Every time and duration is therefore written a
tenth of a nanosecond above its value (`_us`): rounded or truncated, it reads back exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np
import orjson

from pipetrace.analyze.model import CHANNELS, OPS
from pipetrace.export import args as A
from pipetrace.export.args import slice_args
from pipetrace.export.columns import INSTANT_ARRIVAL, Layout

RUN_PID = 0  # the process that holds run-wide tracks (findings about no rank)

Progress = Callable[[float], None]


def chrome_events(layout: Layout) -> list[dict[str, Any]]:
    """Every event of the trace, metadata first."""
    events, pid_of = _track_events(layout)
    events += _slice_events(layout, pid_of)
    events += _instant_events(layout, pid_of)
    events += _counter_events(layout, pid_of)
    return events


def _meta(name: str, pid: int, args: dict[str, Any], tid: int | None = None) -> dict[str, Any]:
    """A metadata event: a process's (``tid`` None) or a thread's name or sort index."""
    event: dict[str, Any] = {"ph": "M", "name": name, "pid": pid}
    if tid is not None:
        event["tid"] = tid
    event["args"] = args
    return event


def _track_events(layout: Layout) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """The processes and threads, named and ordered, and the pid of every track (a track
    without its own process belongs to its parent's, else to the run's)."""
    pid_of: dict[int, int] = {}
    events: list[dict[str, Any]] = []
    for t in layout.tracks:
        if t.pid is not None:
            pid_of[t.uuid] = t.pid
            events.append(_meta("process_name", t.pid, {"name": t.name}))
            events.append(_meta("process_sort_index", t.pid, {"sort_index": t.order}))
    run_named = False
    for t in layout.tracks:
        if t.pid is not None:
            continue
        pid = pid_of.get(t.parent, RUN_PID)
        if pid == RUN_PID and not run_named:
            run_named = True
            events.append(_meta("process_name", RUN_PID, {"name": "pipetrace run"}))
        pid_of[t.uuid] = pid
        if not t.counter:
            events.append(_meta("thread_name", pid, {"name": t.name}, t.uuid))
            events.append(_meta("thread_sort_index", pid, {"sort_index": t.order}, t.uuid))
    return events, pid_of


_ID_ARGS = (A.STAGE, A.MICROBATCH, A.ITERATION, A.POSITION, A.PEER, A.SEQ, A.BYTES)


def _slice_events(layout: Layout, pid_of: dict[int, int]) -> list[dict[str, Any]]:
    """A complete event per slice; a send's slice starts its message's flow."""
    s, a, names = layout.slices, slice_args(layout), layout.names
    shapes = [str(list(shape)) for shape in layout.run.shapes]
    rows = (s.track, s.begin, s.end, s.name, s.unfinished, s.flow, s.note, a.loss)
    ids = (a.stage, a.microbatch, a.iteration, a.position, a.peer, a.seq, a.nbytes)
    messages = (a.op, a.channel, a.shape, a.dtype)
    events = []
    for (track, begin, end, name, unfinished, flow, note, loss), id_values, message in zip(
        _rows(rows), _rows(ids), _rows(messages)
    ):
        args = {key: value for key, value in zip(_ID_ARGS, id_values) if value >= 0}
        if message[0] >= 0:
            args.update(_message_args(layout, shapes, *message))
        if loss == loss:  # not NaN
            args[A.LOSS] = loss
        if unfinished:
            args[A.UNFINISHED] = True
        if note >= 0:
            args[A.FINDING] = layout.notes[note]
        event = {
            "ph": "X",
            "name": names[name],
            "pid": pid_of[track],
            "tid": track,
            "ts": _us(begin),
            "dur": _us(end - begin),
            "args": args,
        }
        if flow:
            event["bind_id"] = flow
            event["flow_out"] = True
        events.append(event)
    return events


def _rows(columns: tuple[np.ndarray, ...]) -> Iterator[tuple[Any, ...]]:
    """The columns' values row by row, as Python scalars."""
    return zip(*(c.tolist() for c in columns))


def _message_args(
    layout: Layout, shapes: list[str], op: int, channel: int, shape: int, dtype: int
) -> dict[str, Any]:
    """What a P2P slice's message is: op, channel, shape and dtype."""
    return {
        A.OP: OPS[op],
        A.CHANNEL: CHANNELS[channel] if 0 <= channel < len(CHANNELS) else "?",
        A.SHAPE: shapes[shape] if shape >= 0 else None,
        A.DTYPE: layout.run.dtypes[dtype] if dtype >= 0 else None,
    }


def _instant_events(layout: Layout, pid_of: dict[int, int]) -> list[dict[str, Any]]:
    """Instants; a message's arrival is a zero-length slice that ends its flow."""
    ins, names = layout.instants, layout.names
    events: list[dict[str, Any]] = []
    for track, ts, name, kind, flow, detail in _rows(
        (ins.track, ins.ts, ins.name, ins.kind, ins.flow, ins.detail)
    ):
        event: dict[str, Any] = {"name": names[name], "pid": pid_of[track], "tid": track}
        if kind == INSTANT_ARRIVAL:
            event = {"ph": "X", **event, "ts": _us(ts), "dur": 0}
            if flow:
                event["bind_id"] = flow
                event["flow_in"] = True
        else:
            details = layout.details[detail] if detail >= 0 else {}
            event = {"ph": "i", "s": "t", **event, "ts": _us(ts), "args": details}
        events.append(event)
    return events


def _counter_events(layout: Layout, pid_of: dict[int, int]) -> list[dict[str, Any]]:
    c = layout.counters
    by_uuid = {t.uuid: t for t in layout.tracks}
    events = []
    for track, ts, value in _rows((c.track, c.ts, c.value)):
        # importers name a counter "NAME KEY": "activations" + "in flight"
        name, key = _counter_name(by_uuid[track].name)
        events.append(
            {"ph": "C", "name": name, "pid": pid_of[track], "ts": _us(ts), "args": {key: value}}
        )
    return events


def _counter_name(track: str) -> tuple[str, str]:
    head, sep, tail = track.partition(" in ")
    return (head, "in " + tail) if sep else (track, "value")


def _us(ns: int) -> float:
    return (ns + 0.1) / 1000


def write_chrome_json(layout: Layout, out: IO[bytes], *, progress: Progress | None = None) -> int:
    """Write the trace to ``out``; returns the number of bytes written."""
    events = chrome_events(layout)
    if progress:
        progress(0.5)
    doc = {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {
            "pipetrace_run": str(layout.run.path),
            "t0_ns": layout.run.t0_ns,
            "schedule": layout.run.schedule_name,
        },
    }
    data = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if progress:
        progress(1.0)
    return out.write(data)
