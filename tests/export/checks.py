"""Checks of a decoded export against the run model it came from (both formats)."""

from __future__ import annotations

from collections import Counter

from pipetrace.analyze.model import OP_RECV, OP_SEND, OPEN, Run
from pipetrace.export.columns import ARRIVED, NEVER_ARRIVED
from pipetrace.export.layout import last_time

from .decode import Decoded, JsonTrace

STEP_TRACKS = ("compute", "overlap (backward)")


def expected_steps(run: Run) -> Counter:
    """(rank, step text, begin, end) of every recorded step; open steps end at the last time."""
    t_end = last_time(run)
    out: Counter = Counter()
    for rank in run.present_ranks:
        s = rank.steps
        for code, b, e in zip(s.code.tolist(), s.begin.tolist(), s.end.tolist()):
            out[(rank.rank, run.catalog.texts[code], b, t_end if e == OPEN else e)] += 1
    return out


def expected_ops(run: Run) -> Counter:
    t_end = last_time(run)
    out: Counter = Counter()
    for rank in run.present_ranks:
        p = rank.p2p
        for i in range(len(p)):
            end = t_end if p.done[i] == OPEN else int(p.done[i])
            if p.op[i] == OP_RECV and p.match_rank[i] >= 0:
                end = max(end, int(run.ranks[p.match_rank[i]].p2p.post[p.match_index[i]]))
            arrow = "→" if p.op[i] == OP_SEND else "←"
            out[
                (
                    rank.rank,
                    f"{run.catalog.texts[p.code[i]]} {arrow} {p.peer[i]}",
                    int(p.post[i]),
                    end,
                )
            ] += 1
    return out


def matched_messages(run: Run) -> int:
    return sum(
        int(((r.p2p.op == OP_SEND) & (r.p2p.match_rank >= 0)).sum()) for r in run.present_ranks
    )


def check_perfetto(run: Run, dec: Decoded) -> None:
    """Everything the model holds is in the trace, once, where it belongs."""
    assert dec.t0_ns == run.t0_ns
    root = dec.tracks[0]
    assert root.process_ordering == root.PROCESS_ORDERING_EXPLICIT
    for uuid, t in dec.tracks.items():
        if t.HasField("process"):
            rank = dec.rank_of(uuid)
            assert t.sibling_order_rank == rank and t.process.process_name.startswith(
                f"rank {rank}"
            )
    t_end = last_time(run)
    assert max(e.ts for e in dec.events) == t_end
    steps = [
        s for s in dec.slices if dec.track_name(s.track).split(" (overlapping")[0] in STEP_TRACKS
    ]
    got = Counter((dec.rank_of(s.track), s.name, s.begin, s.end) for s in steps)
    assert got == expected_steps(run)
    for s in steps:
        assert {"iteration", "position"} <= set(s.args)
        code = run.catalog.code(s.name)
        for key, column in (("stage", run.catalog.stage), ("microbatch", run.catalog.microbatch)):
            assert s.args.get(key, -1) == column[code]
        assert bool(s.args.get("unfinished")) == _open_at(run, dec.rank_of(s.track), s)
    ops = [s for s in dec.slices if dec.track_name(s.track).startswith("p2p ")]
    assert Counter((dec.rank_of(s.track), s.name, s.begin, s.end) for s in ops) == expected_ops(run)
    assert all(s.depth == 0 for s in ops)  # one op per track at a time
    for s in ops:
        assert {"op", "peer", "channel", "seq", "bytes", "shape", "dtype", "iteration"} <= set(
            s.args
        )
    # one flow per matched message, from the send's slice to its recv's completion
    assert len(dec.flows) == matched_messages(run)
    for begin, end in dec.flows.values():
        send = next(s for s in ops if s.flow_ids == begin.flow_ids)
        assert send.args["op"] == "send" and begin.ts == send.begin
        recv = end.args["_parent"]
        assert (
            end.name in (ARRIVED, NEVER_ARRIVED) and recv is not None and recv.args["op"] == "recv"
        )
        assert end.ts == recv.end >= begin.ts
        assert (
            dec.rank_of(recv.track) == send.args["peer"]
            and dec.rank_of(send.track) == recv.args["peer"]
        )
    # counters never go below zero
    by_track: dict[int, list[int]] = {}
    for c in dec.counters:
        by_track.setdefault(c.track, []).append(c.value)
    assert by_track and all(min(v) >= 0 for v in by_track.values())
    # bubbles lie inside the rank's iterations and outside its compute steps
    for rank in run.present_ranks:
        compute = [
            s
            for s in steps
            if dec.rank_of(s.track) == rank.rank
            and s.end > s.begin
            and not any(k in s.name for k in ("SEND", "RECV"))
        ]
        iterations = dec.on(rank.rank, "iterations")
        for bubble in dec.on(rank.rank, "bubbles"):
            assert any(i.begin <= bubble.begin and bubble.end <= i.end for i in iterations)
            assert not any(c.begin < bubble.end and bubble.begin < c.end for c in compute)


def _open_at(run: Run, rank: int, s) -> bool:
    steps = run.ranks[rank].steps
    code = run.catalog.code(s.name)
    return bool(((steps.code == code) & (steps.begin == s.begin) & (steps.end == OPEN)).any())


def check_chrome_json(run: Run, trace: JsonTrace) -> None:
    t_end = last_time(run)
    steps = [
        e
        for e in trace.events
        if e["ph"] == "X"
        and trace.threads.get((e["pid"], e["tid"]), "").split(" (overlapping")[0] in STEP_TRACKS
    ]
    got = Counter(
        (trace.rank_of(e["pid"]), e["name"], _ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"]))
        for e in steps
    )
    assert got == expected_steps(run)
    assert all("position" in e["args"] for e in steps)
    ops = [
        e
        for e in trace.events
        if e["ph"] == "X"
        and trace.threads.get((e["pid"], e["tid"]), "").startswith("p2p ")
        and "op" in e.get("args", {})
    ]
    got = Counter(
        (trace.rank_of(e["pid"]), e["name"], _ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"]))
        for e in ops
    )
    assert got == expected_ops(run)
    outs = {e["bind_id"]: e for e in trace.events if e.get("flow_out")}
    ins = {e["bind_id"]: e for e in trace.events if e.get("flow_in")}
    assert len(outs) == len(ins) == matched_messages(run)
    for fid, arrival in ins.items():
        assert arrival["ts"] >= outs[fid]["ts"] and arrival["dur"] == 0
    # complete events nest per thread, in nanoseconds as an importer that truncates reads them
    per_thread: dict[tuple, list[tuple[int, int]]] = {}
    for e in trace.events:
        if e["ph"] == "X":
            per_thread.setdefault((e["pid"], e["tid"]), []).append(
                (_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"]))
            )
    for spans in per_thread.values():
        stack: list[int] = []
        for b, e in sorted(spans, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1] <= b:
                stack.pop()
            assert not stack or e <= stack[-1]
            if e > b:
                stack.append(e)
    assert max(_ns(e["ts"]) + _ns(e.get("dur", 0)) for e in trace.events if "ts" in e) == t_end


def _ns(us: float) -> int:
    """Microseconds back to nanoseconds; truncating and rounding must agree."""
    ns = int(us * 1000)
    assert ns == round(us * 1000)
    return ns
