"""What an export shows, whatever the file format: tracks, slices, instants and counters.

`build_layout(run, findings)` turns the run model into flat columns that both writers
(`perfetto`, `chrome_json`) render. Per rank, one process named with its rank and stages:

- ``pipetrace findings``: an instant where each finding happened (every blocked step of a
  deadlock, a failed step, ...); the slices it points at carry a ``finding`` annotation;
- ``recorded events``: stall, dump, abort, signal, exception and run_end as recorded;
- ``iterations``: one slice per iteration;
- ``compute``: the main thread's steps (a composite holds its forward sub-step);
  ``overlap (backward)``: the backward sub-steps of OVERLAP_F_B steps (thread ``overlap``);
- with device timing (CUDA), beside the host tracks: ``device (launch-bound)`` and ``device
  (device-bound)``, the steps at the times the device ran them, split by
  `pipetrace.analyze.device_times.step_boundness`, and ``device p2p``, the P2P ops on the
  device's P2P stream;
- ``bubbles``: idle gaps of the compute inside iterations (`derived.bubbles`);
- ``p2p 0``, ``p2p 1``, ...: P2P ops from post to completion, one op per track at a time
  (slices of a track must nest), the lowest free track first;
- counters ``activations in flight`` and ``messages in flight``; for a run with memory
  samples also ``activation bytes`` (all stages of the rank: saved for backward plus
  received and not yet consumed) and, on CUDA, ``device allocated bytes``.

A flow goes from each send to the completion of the recv it matched: it starts on the send
op's slice and ends on an ``arrived`` instant at the recv's completion inside the recv slice
(the only arrangement the trace processor draws in the right direction). Spans that never
ended end at `Layout.t_end`, the last recorded time, and are marked ``unfinished``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetrace.analyze.device_times import device_rows, step_boundness
from pipetrace.analyze.findings import Finding
from pipetrace.analyze.model import OP_RECV, OP_SEND, OPEN, RankState, RankTimeline, Run
from pipetrace.export import derived
from pipetrace.export.columns import (
    ARRIVED,
    BUBBLE,
    COUNTER_TYPES,
    INSTANT_ARRIVAL,
    INSTANT_TYPES,
    NEVER_ARRIVED,
    SLICE_BUBBLE,
    SLICE_ITERATION,
    SLICE_P2P,
    SLICE_STEP,
    SLICE_TYPES,
    TRACK_ORDER,
    Builder,
    Counters,
    Instants,
    Layout,
    Slices,
    concat,
)
from pipetrace.export.marks import Marks
from pipetrace.export.tracks import nest_lanes, pool_lanes

_THREAD_TRACKS = {"main": "compute", "overlap": "overlap (backward)"}


@dataclass
class _Ops:
    """A rank's P2P slices: where each op row went."""

    slice_index: np.ndarray
    track: np.ndarray
    end: np.ndarray
    name: np.ndarray  # each op's slice name (into Layout.names)


def build_layout(run: Run, findings: list[Finding] | None = None) -> Layout:
    t_end = last_time(run)
    b = Builder(run)
    pids = _pids(run)
    marks = Marks(b, run, t_end)
    step_index: dict[int, np.ndarray] = {}
    ops: dict[int, _Ops] = {}
    for rank in run.ranks:
        proc = b.track(
            process_name(run, rank), rank=rank.rank, order=rank.rank, pid=pids[rank.rank]
        )
        marks.process[rank.rank] = proc
        if not rank.present:
            continue
        step_index[rank.rank] = _steps(b, run, rank, proc, t_end)
        ops[rank.rank] = _p2p(b, run, rank, proc, t_end)
        _iterations(b, rank, proc, t_end)
        _device_steps(b, rank, proc)
        _device_never(b, rank, proc, t_end)
        _device_ops(b, rank, proc, ops[rank.rank])
        _bubbles(b, run, rank, proc, t_end)
        b.add_counter(
            b.track(
                "activations in flight",
                parent=proc,
                rank=rank.rank,
                order=TRACK_ORDER["counters"],
                counter=True,
            ),
            *derived.activations_in_flight(rank, run.catalog),
        )
        b.add_counter(
            b.track(
                "messages in flight",
                parent=proc,
                rank=rank.rank,
                order=TRACK_ORDER["counters"] + 1,
                counter=True,
            ),
            *derived.messages_in_flight(rank),
        )
        _memory_counters(b, rank, proc)
        marks.recorded_events(rank)
    slices = concat(Slices, b.slices, SLICE_TYPES)
    num_flows = _flows(b, run, slices, ops)
    marks.findings(findings or [], slices, step_index)
    return Layout(
        run=run,
        t_end=t_end,
        tracks=b.tracks,
        names=b.names,
        slices=slices,
        instants=concat(Instants, b.instants, INSTANT_TYPES),
        counters=concat(Counters, b.counters, COUNTER_TYPES),
        details=marks.details,
        notes=marks.notes,
        num_flows=num_flows,
    )


def _memory_counters(b: Builder, rank: RankTimeline, proc: int) -> None:
    """The rank's memory samples as counters (nothing for a rank without samples)."""
    memory = rank.memory
    if not len(memory):
        return
    series = [("activation bytes", memory.saved.sum(axis=1) + memory.inflight.sum(axis=1))]
    if (memory.allocated >= 0).any():
        series.append(("device allocated bytes", memory.allocated))
    for offset, (name, values) in enumerate(series, 2):
        order = TRACK_ORDER["counters"] + offset
        track = b.track(name, parent=proc, rank=rank.rank, order=order, counter=True)
        b.add_counter(track, memory.t, values)


def last_time(run: Run) -> int:
    """The last time recorded anywhere in the run: where unfinished spans end."""
    return max((rank.last_time() for rank in run.present_ranks), default=0)


def process_name(run: Run, rank: RankTimeline) -> str:
    """``rank 3 (stage 1)``; with several replicas ``replica 1, stage 1, global rank 3``."""
    stages = run.stages_of(rank.rank)
    text = run.rank_name(rank.rank)
    if stages and not run.pipelines.several:
        text += f" (stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))})"
    if rank.status.state != RankState.FINISHED:
        text += f" [{rank.status.state}]"
    return text


def _pids(run: Run) -> list[int]:
    """The recorded process ids when they tell the ranks apart, else made-up ones (above any
    Linux pid) so that no two ranks share a process in the UI."""
    pids = [r.header.get("pid") for r in run.ranks]
    if all(isinstance(p, int) and p > 0 for p in pids) and len(set(pids)) == len(pids):
        return pids  # type: ignore[return-value]
    return [10_000_000 + r for r in range(run.world_size)]


def _steps(b: Builder, run: Run, rank: RankTimeline, proc: int, t_end: int) -> np.ndarray:
    steps = rank.steps
    index = np.full(len(steps), -1, np.int64)
    end = derived.ended(steps.end, t_end)
    unfinished = steps.end == OPEN
    for thread in np.unique(steps.thread).tolist():
        rows = np.flatnonzero(steps.thread == thread)
        lanes = nest_lanes(steps.begin[rows], end[rows])
        base = _THREAD_TRACKS.get(str(run.threads[thread]), f"thread {run.threads[thread]}")
        for lane in np.unique(lanes).tolist():
            sel = rows[lanes == lane]
            name = base if lane == 0 else f"{base} (overlapping {lane})"
            track = b.track(
                name, parent=proc, rank=rank.rank, order=TRACK_ORDER["steps"] + 5 * thread + lane
            )
            index[sel] = b.add_slices(
                track,
                steps.begin[sel],
                end[sel],
                steps.code[sel],
                SLICE_STEP,
                rank.rank,
                sel,
                unfinished[sel],
            )
    return index


def _p2p(b: Builder, run: Run, rank: RankTimeline, proc: int, t_end: int) -> _Ops:
    p2p = rank.p2p
    n = len(p2p)
    end = derived.ended(p2p.done, t_end)
    # a recv cannot complete before its send was posted: keep the arrival after the flow's start
    recv = np.flatnonzero((p2p.op == OP_RECV) & (p2p.match_rank >= 0))
    for peer in np.unique(p2p.match_rank[recv]).tolist():
        rows = recv[p2p.match_rank[recv] == peer]
        end[rows] = np.maximum(end[rows], run.ranks[peer].p2p.post[p2p.match_index[rows]])
    lanes = pool_lanes(p2p.post, end)
    keys = (
        (p2p.code.astype(np.int64) << 33)
        | (p2p.peer.astype(np.int64) << 1)
        | p2p.op.astype(np.int64)
    )
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    arrows = ("←", "→")
    ids = [
        b.name(
            f"{run.catalog.texts[int(p2p.code[row])]} "
            f"{arrows[int(p2p.op[row] == OP_SEND)]} {int(p2p.peer[row])}"
        )
        for row in first.tolist()
    ]
    names = np.array(ids, np.int32)[inverse.reshape(-1)] if n else np.empty(0, np.int32)
    index = np.full(n, -1, np.int64)
    track_of = np.zeros(n, np.int64)
    for lane in np.unique(lanes).tolist():
        sel = np.flatnonzero(lanes == lane)
        track = b.track(f"p2p {lane}", parent=proc, rank=rank.rank, order=TRACK_ORDER["p2p"] + lane)
        index[sel] = b.add_slices(
            track,
            p2p.post[sel],
            end[sel],
            names[sel],
            SLICE_P2P,
            rank.rank,
            sel,
            p2p.done[sel] == OPEN,
        )
        track_of[sel] = track
    return _Ops(index, track_of, end, names)


def _device_steps(b: Builder, rank: RankTimeline, proc: int) -> None:
    """The steps the device ran, at their device times: launch-bound ones on one track,
    device-bound ones (the device finished them long after the host enqueued them) on
    another, so that a device backlog stands out."""
    bound = step_boundness(rank)
    steps = rank.steps
    for order, (name, which) in enumerate(
        (
            ("device (launch-bound)", ~bound.device_bound),
            ("device (device-bound)", bound.device_bound),
        )
    ):
        sel = bound.rows[which]
        if not len(sel):
            continue
        track = b.track(name, parent=proc, rank=rank.rank, order=TRACK_ORDER["device"] + order)
        begin, end = steps.dbegin[sel], steps.dend[sel]
        lanes = nest_lanes(begin, end)
        for lane in np.unique(lanes).tolist():
            mine = lanes == lane
            if lane:
                track = b.track(
                    f"{name} ({lane})", parent=proc, rank=rank.rank, order=TRACK_ORDER["device"] + 2
                )
            rows = sel[mine]
            code = steps.code[rows]
            b.add_slices(track, begin[mine], end[mine], code, SLICE_STEP, rank.rank, rows, False)


def _device_never(b: Builder, rank: RankTimeline, proc: int, t_end: int) -> None:
    """On a rank with device times, the oldest step the host enqueued (and ended) that the
    device never completed: from its enqueue to the end of the trace, unfinished, on a track
    of its own. What is queued behind it never completed either."""
    steps = rank.steps
    timed = steps.dend != OPEN
    never = np.flatnonzero((steps.end != OPEN) & ~timed)
    if not timed.any() or not len(never):
        return
    row = never[np.argmin(steps.begin[never])]
    track = b.track(
        "device (never completed)", parent=proc, rank=rank.rank, order=TRACK_ORDER["device"] + 2
    )
    begin = steps.begin[row : row + 1]
    b.add_slices(
        track,
        begin,
        np.full(1, max(t_end, int(begin[0]))),
        steps.code[row],
        SLICE_STEP,
        rank.rank,
        row,
        True,
    )


def _device_ops(b: Builder, rank: RankTimeline, proc: int, ops: _Ops) -> None:
    """The P2P ops at the times the device's P2P stream ran them (named as on the host)."""
    p2p = rank.p2p
    sel = np.flatnonzero(device_rows(p2p.dbegin, p2p.dend))
    if not len(sel):
        return
    begin, end = p2p.dbegin[sel], p2p.dend[sel]
    lanes = pool_lanes(begin, end)
    names = ops.name[sel]
    for lane in np.unique(lanes).tolist():
        mine = lanes == lane
        track = b.track(
            f"device p2p {lane}",
            parent=proc,
            rank=rank.rank,
            order=TRACK_ORDER["device"] + 3 + lane,
        )
        b.add_slices(
            track, begin[mine], end[mine], names[mine], SLICE_P2P, rank.rank, sel[mine], False
        )


def _iterations(b: Builder, rank: RankTimeline, proc: int, t_end: int) -> None:
    its = rank.iterations
    if not len(its):
        return
    track = b.track("iterations", parent=proc, rank=rank.rank, order=TRACK_ORDER["iterations"])
    end = derived.ended(its.end, t_end)
    lanes = nest_lanes(its.begin, end)
    names = np.array([b.name(f"iteration {int(i)}") for i in its.it], np.int32)
    for lane in np.unique(lanes).tolist():
        sel = np.flatnonzero(lanes == lane)
        t = (
            track
            if lane == 0
            else b.track(
                f"iterations ({lane})", parent=proc, rank=rank.rank, order=TRACK_ORDER["iterations"]
            )
        )
        b.add_slices(
            t,
            its.begin[sel],
            end[sel],
            names[sel],
            SLICE_ITERATION,
            rank.rank,
            its.it[sel],
            its.end[sel] == OPEN,
        )


def _bubbles(b: Builder, run: Run, rank: RankTimeline, proc: int, t_end: int) -> None:
    found = derived.bubbles(rank, run.catalog, t_end)
    if not len(found.begin):
        return
    track = b.track("bubbles", parent=proc, rank=rank.rank, order=TRACK_ORDER["bubbles"])
    b.add_slices(
        track,
        found.begin,
        found.end,
        b.name(BUBBLE),
        SLICE_BUBBLE,
        rank.rank,
        found.iteration,
        found.unfinished,
    )


def _flows(b: Builder, run: Run, slices: Slices, ops: dict[int, _Ops]) -> int:
    """One flow per matched message: from its send's slice to an arrival instant at the
    completion of the recv (inside the recv's slice)."""
    next_id = 1
    arrived, never = b.name(ARRIVED), b.name(NEVER_ARRIVED)
    for rank in run.present_ranks:
        p2p = rank.p2p
        sends = np.flatnonzero((p2p.op == OP_SEND) & (p2p.match_rank >= 0))
        for peer in np.unique(p2p.match_rank[sends]).tolist():
            if peer not in ops:
                continue
            rows = sends[p2p.match_rank[sends] == peer]
            recv_rows = p2p.match_index[rows]
            ids = np.arange(next_id, next_id + len(rows), dtype=np.int64)
            next_id += len(rows)
            slices.flow[ops[rank.rank].slice_index[rows]] = ids
            target = ops[peer]
            done = run.ranks[peer].p2p.done[recv_rows] != OPEN
            b.add_instants(
                target.track[recv_rows],
                target.end[recv_rows],
                np.where(done, arrived, never),
                INSTANT_ARRIVAL,
                peer,
                flow=ids,
                parent=target.slice_index[recv_rows],
            )
    return next_id - 1
