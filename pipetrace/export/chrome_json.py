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

from collections.abc import Callable
from typing import IO, Any

import orjson

from pipetrace.analyze.model import CHANNELS, OPS
from pipetrace.export import args as A
from pipetrace.export.args import slice_args
from pipetrace.export.columns import INSTANT_ARRIVAL, Layout

RUN_PID = 0  # the process that holds run-wide tracks (findings about no rank)

Progress = Callable[[float], None]


def chrome_events(layout: Layout) -> list[dict[str, Any]]:
    """Every event of the trace, metadata first."""
    run = layout.run
    names = layout.names
    by_uuid = {t.uuid: t for t in layout.tracks}
    pid_of: dict[int, int] = {}
    events: list[dict[str, Any]] = []
    named: set[int] = set()
    for t in layout.tracks:
        if t.pid is not None:
            pid_of[t.uuid] = t.pid
            events.append(
                {"ph": "M", "name": "process_name", "pid": t.pid, "args": {"name": t.name}}
            )
            events.append(
                {
                    "ph": "M",
                    "name": "process_sort_index",
                    "pid": t.pid,
                    "args": {"sort_index": t.order},
                }
            )
    for t in layout.tracks:
        if t.pid is not None:
            continue
        pid = pid_of.get(t.parent, RUN_PID)
        if pid == RUN_PID and RUN_PID not in named:
            named.add(RUN_PID)
            events.append(
                {
                    "ph": "M",
                    "name": "process_name",
                    "pid": RUN_PID,
                    "args": {"name": "pipetrace run"},
                }
            )
        pid_of[t.uuid] = pid
        if not t.counter:
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid,
                    "tid": t.uuid,
                    "args": {"name": t.name},
                }
            )
            events.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pid,
                    "tid": t.uuid,
                    "args": {"sort_index": t.order},
                }
            )
    s, a = layout.slices, slice_args(layout)
    shapes = [str(list(shape)) for shape in run.shapes]
    columns = (
        s.track,
        s.begin,
        s.end,
        s.name,
        s.unfinished,
        s.flow,
        s.note,
        a.stage,
        a.microbatch,
        a.iteration,
        a.position,
        a.op,
        a.peer,
        a.channel,
        a.seq,
        a.nbytes,
        a.shape,
        a.dtype,
        a.loss,
    )
    for (
        track,
        begin,
        end,
        name,
        unfinished,
        flow,
        note,
        stage,
        mb,
        it,
        pos,
        op,
        peer,
        ch,
        seq,
        nbytes,
        shape,
        dtype,
        loss,
    ) in zip(*(c.tolist() for c in columns)):
        args: dict[str, Any] = {}
        for key, value in (
            (A.STAGE, stage),
            (A.MICROBATCH, mb),
            (A.ITERATION, it),
            (A.POSITION, pos),
            (A.PEER, peer),
            (A.SEQ, seq),
            (A.BYTES, nbytes),
        ):
            if value >= 0:
                args[key] = value
        if op >= 0:
            args[A.OP] = OPS[op]
            args[A.CHANNEL] = CHANNELS[ch] if 0 <= ch < len(CHANNELS) else "?"
            args[A.SHAPE] = shapes[shape] if shape >= 0 else None
            args[A.DTYPE] = run.dtypes[dtype] if dtype >= 0 else None
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
    ins = layout.instants
    for track, ts, name, kind, flow, detail in zip(
        *(c.tolist() for c in (ins.track, ins.ts, ins.name, ins.kind, ins.flow, ins.detail))
    ):
        pid = pid_of[track]
        if kind == INSTANT_ARRIVAL:
            event = {
                "ph": "X",
                "name": names[name],
                "pid": pid,
                "tid": track,
                "ts": _us(ts),
                "dur": 0,
            }
            if flow:
                event["bind_id"] = flow
                event["flow_in"] = True
        else:
            event = {
                "ph": "i",
                "s": "t",
                "name": names[name],
                "pid": pid,
                "tid": track,
                "ts": _us(ts),
                "args": layout.details[detail] if detail >= 0 else {},
            }
        events.append(event)
    c = layout.counters
    for track, ts, value in zip(c.track.tolist(), c.ts.tolist(), c.value.tolist()):
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
