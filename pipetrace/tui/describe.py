"""What the details panel says about the selected timeline item, as plain rows (no UI)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipetrace import units
from pipetrace.analyze.model import CHANNELS, OPEN, OPS
from pipetrace.tui.lanes import DEVICE, MAIN, P2P, PLAN, SAMPLES
from pipetrace.tui.session import Session

_KIND_WORDS = {
    "F": "forward",
    "B": "backward",
    "I": "backward, inputs (dx)",
    "W": "backward, weights (dw)",
    "SEND_F": "send activations",
    "SEND_B": "send gradients",
    "RECV_F": "receive activations",
    "RECV_B": "receive gradients",
    "OVERLAP_F_B": "forward and backward overlapped",
    "UNSHARD": "FSDP unshard",
    "RESHARD": "FSDP reshard",
    "REDUCE_GRAD": "FSDP gradient reduce",
    "TIED_REDUCE": "tied-weight gradient reduce",
}


@dataclass
class Description:
    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)  # (label, value)
    notes: list[str] = field(default_factory=list)  # lines under the rows (findings, warnings)


def describe(session: Session, lane_id: int, item: int) -> Description:
    lane = session.index.lanes[lane_id]
    if lane.source == P2P:
        return _describe_op(session, lane.rank, int(lane.rows[item]))
    if lane.source == PLAN:
        return _describe_planned(session, lane_id, item)
    if lane.source == SAMPLES:
        return _describe_sample(session, lane_id, item)
    return _describe_step(session, lane_id, item)


def _t(session: Session, ns: int) -> str:
    return units.duration(ns) if ns != OPEN else "never"


def _step_parts(session: Session, code: int) -> list[tuple[str, str]]:
    catalog = session.run.catalog
    kind = catalog.kind_of(code)
    rows = [
        (
            "kind",
            f"{kind.value} ({_KIND_WORDS.get(kind.value, '')})" if kind else "unparsable step text",
        )
    ]
    stage, mb = int(catalog.stage[code]), int(catalog.microbatch[code])
    step = catalog.step(code)
    if step is not None and step.sub_steps:
        rows.append(("sub-steps", " + ".join(str(s) for s in step.sub_steps)))
    else:
        rows.append(("stage", str(stage) if stage >= 0 else "-"))
        rows.append(("micro-batch", str(mb) if mb >= 0 else "-"))
    return rows


def _describe_step(session: Session, lane_id: int, item: int) -> Description:
    index, run = session.index, session.run
    lane = index.lanes[lane_id]
    rank = run.ranks[lane.rank]
    row = int(lane.rows[item])
    steps = rank.steps
    code = int(steps.code[row])
    text = run.catalog.texts[code]
    it, pos = int(steps.it[row]), int(steps.pos[row])
    begin, end = int(steps.begin[row]), int(steps.end[row])
    d = Description(f"{run.rank_name(lane.rank)} · {text}" + _lane_suffix(lane.role, lane.name))
    d.rows += _step_parts(session, code)
    d.rows.append(("iteration", str(it)))
    d.rows.append(("plan position", f"{pos} of {len(rank.plan)}" if rank.plan else str(pos)))
    span = index.iteration_span(it)
    since = f" (+{units.duration(begin - span[0])} in it {it})" if span else ""
    d.rows.append(("begin", units.duration(begin) + since))
    if end == OPEN:
        d.rows.append(("end", "never: still running when the log ends"))
        d.rows.append(("open for", "≥ " + units.duration(index.log_end[lane.rank] - begin)))
    else:
        d.rows.append(("end", units.duration(end)))
        d.rows.append(("duration", units.duration(end - begin)))
    d.rows += _device_rows(steps.dbegin[row], steps.dend[row], end)
    planned = session.planned.offsets.get(lane.rank, {}).get(pos) if session.planned else None
    if planned is not None and span is not None:
        late = (begin - span[0]) - planned[0]
        d.rows.append(
            (
                "planned",
                f"+{units.duration(planned[0])} for {units.duration(planned[1] - planned[0])}"
                f" ({'late' if late >= 0 else 'early'} {units.duration(abs(late))})",
            )
        )
    for op_rank, op_row in index.p2p_rows(lane_id, item):
        d.rows += _op_rows(session, op_rank, op_row)
    _sub_step_rows(session, lane.rank, row, d)
    _finding_notes(session, lane_id, item, d)
    return d


def _lane_suffix(role: str, name: str) -> str:
    if role == MAIN:
        return ""
    return " · on the device" if role == DEVICE else f" · thread {name}"


def _device_rows(dbegin: int, dend: int, host_end: int) -> list[tuple[str, str]]:
    """When the device ran the step (with device timing), and how far behind the host."""
    if dbegin == OPEN or dend == OPEN:
        return []
    rows = [("on the device", f"{units.duration(dbegin)} for {units.duration(dend - dbegin)}")]
    if host_end != OPEN:
        rows.append(("device lag", units.duration(dend - host_end)))
    return rows


def _sub_step_rows(session: Session, rank_id: int, row: int, d: Description) -> None:
    """For a composite, the times of its sub-steps (recorded on several threads)."""
    run = session.run
    steps = run.ranks[rank_id].steps
    step = run.catalog.step(int(steps.code[row]))
    if step is None or not step.sub_steps:
        return
    same = np.flatnonzero((steps.pos == steps.pos[row]) & (steps.it == steps.it[row]))
    for r in same:
        if r == row:
            continue
        e = int(steps.end[r])
        dur = units.duration(e - int(steps.begin[r])) if e != OPEN else "open"
        d.rows.append(
            (
                f"  {run.catalog.texts[int(steps.code[r])]}",
                f"{run.threads[int(steps.thread[r])]}, {dur}",
            )
        )


def _op_rows(session: Session, rank_id: int, row: int) -> list[tuple[str, str]]:
    run = session.run
    p = run.ranks[rank_id].p2p
    op = OPS[int(p.op[row])]
    ch = CHANNELS[int(p.ch[row])] if 0 <= p.ch[row] < len(CHANNELS) else "?"
    shape = run.shapes[int(p.shape[row])] if 0 <= p.shape[row] < len(run.shapes) else ()
    dtype = run.dtypes[int(p.dtype[row])] if 0 <= p.dtype[row] < len(run.dtypes) else "?"
    post, done = int(p.post[row]), int(p.done[row])
    direction = "to" if op == "send" else "from"
    rows = [
        (op, f"{direction} {run.rank_name(int(p.peer[row]))}, channel {ch}, seq {int(p.seq[row])}"),
        ("message", f"{units.size(int(p.nbytes[row]))} {dtype}{list(shape)}"),
        (
            "posted → done",
            f"{units.duration(post)} → "
            + (units.duration(done) if done != OPEN else "never")
            + (f" ({units.duration(done - post)})" if done != OPEN else ""),
        ),
    ]
    other = int(p.match_rank[row])
    if other < 0:
        rows.append(("matched", "no matching op on the peer"))
    else:
        o = run.ranks[other].p2p
        j = int(p.match_index[row])
        odone = int(o.done[j])
        rows.append(
            (
                "matched",
                f"{run.rank_name(other)} {run.catalog.texts[int(o.code[j])]}, "
                f"posted {units.duration(int(o.post[j]))}"
                + (f", done {units.duration(odone)}" if odone != OPEN else ", never done"),
            )
        )
    return rows


def _describe_op(session: Session, rank_id: int, row: int) -> Description:
    run = session.run
    p = run.ranks[rank_id].p2p
    code = int(p.code[row])
    d = Description(
        f"{run.rank_name(rank_id)} · {OPS[int(p.op[row])]} of {run.catalog.texts[code]} "
        f"· iteration {int(p.it[row])}"
    )
    d.rows += _op_rows(session, rank_id, row)
    d.rows += _step_parts(session, code)
    lane = session.index.lane_of(rank_id, "comm")
    if lane is not None:
        item = session.index.lanes[lane].item_of_row(row)
        if item is not None:
            _finding_notes(session, lane, item, d)
    return d


def _describe_sample(session: Session, lane_id: int, item: int) -> Description:
    """A memory sample: what each stage of the rank held from then until the next sample."""
    lane = session.index.lanes[lane_id]
    rank = session.run.ranks[lane.rank]
    memory, row = rank.memory, int(lane.rows[item])
    code = int(lane.code[item])
    after = session.run.catalog.texts[code] if code >= 0 else "-"
    d = Description(f"{session.run.rank_name(lane.rank)} · memory after {after}")
    d.rows.append(
        (
            "from",
            f"{units.duration(int(lane.begin[item]))} for "
            f"{units.duration(int(lane.end[item] - lane.begin[item]))}",
        )
    )
    for slot, stage in enumerate(rank.stages):
        saved, inflight = int(memory.saved[row, slot]), int(memory.inflight[row, slot])
        d.rows.append(
            (
                f"stage {stage}",
                f"{units.size(saved)} saved for backward, "
                f"{units.size(inflight)} received, not yet used",
            )
        )
    if memory.allocated[row] >= 0:
        d.rows.append(
            (
                "device allocator",
                f"{units.size(int(memory.allocated[row]))} "
                f"allocated, {units.size(int(memory.reserved[row]))} reserved",
            )
        )
    if lane.levels is not None and int(lane.levels[item]) == int(lane.levels.max()):
        d.notes.append("the rank's peak")
    return d


def _describe_planned(session: Session, lane_id: int, item: int) -> Description:
    index, run = session.index, session.run
    lane = index.lanes[lane_id]
    code, it, pos = int(lane.code[item]), int(lane.it[item]), int(lane.rows[item])
    text = run.catalog.texts[code] if code >= 0 else "?"
    d = Description(f"{run.rank_name(lane.rank)} · planned {text} · iteration {it}")
    d.rows += _step_parts(session, code) if code >= 0 else []
    d.rows.append(("plan position", str(pos)))
    span = index.iteration_span(it)
    start = int(lane.begin[item]) - (span[0] if span else 0)
    length = int(lane.end[item] - lane.begin[item])
    d.rows.append(("planned", f"+{units.duration(start)} for {units.duration(length)}"))
    actual = index.step_item(lane.rank, code, it) if code >= 0 else None
    if actual is None:
        d.notes.append("not run in this iteration")
    else:
        alane = index.lanes[actual[0]]
        b = int(alane.begin[actual[1]]) - (span[0] if span else 0)
        d.rows.append(
            (
                "actual",
                f"+{units.duration(b)} ({'late' if b >= start else 'early'} "
                f"{units.duration(abs(b - start))})",
            )
        )
    d.notes.append(
        f"simulated with this run's mean step costs; one iteration takes "
        f"{units.duration(session.planned.makespan_ns)} as planned"
        if session.planned
        else ""
    )
    return d


def _finding_notes(session: Session, lane_id: int, item: int, d: Description) -> None:
    for view in session.findings:
        if (lane_id, item) in view.items:
            d.notes.append(f"{view.finding.severity}: {view.finding.message}")
