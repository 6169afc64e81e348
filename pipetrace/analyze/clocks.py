"""Putting every rank on rank 0's clock: the recorded offsets, then a refinement.

1. Recorded offsets (`clock` events, docs/trace-format.md): a rank with both a start and an
   end offset gets a linear interpolation between them (clock drift); with one, a constant.
   If no refinement can make that consistent (a badly measured offset makes the
   interpolation wrong), constant offsets are tried, then message-only alignment.
2. Refinement: a message cannot complete on its receiver before its sender posted it. Each
   matched pair (send posted at ``p`` on rank a, recv done at ``d`` on rank b) gives the
   difference constraint ``c_a - c_b <= d - p`` on per-rank corrections ``c``. The greatest
   solution with every ``c <= 0`` and the least with every ``c >= 0`` are found by
   Bellman-Ford (vectorized over rank pairs); their midpoint (floored) is feasible too and
   moves ranks symmetrically, and it is 0 when no message arrives early. When even the
   message-only alignment is infeasible (a negative cycle), the recorded offsets are kept
   and the problem is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipetrace.analyze.derive import counterpart_values, run_bounds, run_starts
from pipetrace.analyze.model import OP_SEND, OPEN, ClockInfo, LifecycleEvent, RankTimeline
from pipetrace.recorder import format as fmt

OffsetFn = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class ConstantOffset:
    """An offset that does not depend on the time (one recorded measurement, or none): a
    rank's times all move by one value, which `load._shift_times` adds to its columns
    without making an array of it per column."""

    value: int

    def __call__(self, t: np.ndarray) -> np.ndarray:
        return np.full(len(t), self.value, np.int64)


def offset_models(clock_events: list[LifecycleEvent]) -> tuple[ClockInfo, dict[str, OffsetFn]]:
    """A rank's recorded clock information and its candidate offset functions (of its own
    time, ns): "interpolated" (start and end, linear drift), "start", "end", and "none"."""
    start = end = None
    for ev in clock_events:
        phase = ev.fields.get("phase")
        offset = ev.fields.get("offset_ns")
        if not isinstance(offset, int) or isinstance(offset, bool):
            continue
        if phase in ("start", None) and start is None:  # without its phase: the first one
            start = ev
        elif phase == "end":
            end = ev
    uncertainties = [ev.fields.get("uncertainty_ns") for ev in (start, end) if ev is not None]
    uncertainties = [u for u in uncertainties if isinstance(u, int)]
    info = ClockInfo(
        offset_start_ns=start.fields["offset_ns"] if start else None,
        offset_end_ns=end.fields["offset_ns"] if end else None,
        uncertainty_ns=min(uncertainties) if uncertainties else None,
        drift_ns=(end.fields["offset_ns"] - start.fields["offset_ns"]) if start and end else 0,
    )
    models: dict[str, OffsetFn] = {}

    def uncertainty(ev: LifecycleEvent) -> int:
        u = ev.fields.get("uncertainty_ns")
        return u if isinstance(u, int) and u >= 0 else 2**62

    constants = sorted((ev for ev in (start, end) if ev is not None), key=uncertainty)
    if (
        start is not None
        and end is not None
        and end.t > start.t
        and abs(info.drift_ns) > uncertainty(start) + uncertainty(end)
    ):
        # the two measurements disagree beyond their uncertainty: the clocks drifted
        t_start, o_start = start.t, start.fields["offset_ns"]
        slope = info.drift_ns / (end.t - start.t)
        models["interpolated"] = lambda t: (
            o_start + (t - t_start).astype(np.float64) * slope
        ).astype(np.int64)
    for ev in constants:  # the more certain measurement first
        phase = "start" if ev is start else "end"
        models[phase] = ConstantOffset(int(ev.fields["offset_ns"]))
    models["none"] = ConstantOffset(0)
    return info, models


def offsets_recorded(models: dict[int, dict[str, OffsetFn]]) -> bool:
    """Did any rank record a clock offset (a model besides "none")?"""
    return any(len(m) > 1 for m in models.values())


# Alignment models tried in turn: the first that lets every matched message arrive after it
# was sent (after refinement) wins. A badly measured offset makes an interpolation wrong in
# between; a constant then often still works.
def preference(models: dict[str, OffsetFn], attempt: int) -> str:
    """Attempt 0: the recorded model (drift when significant, else the more certain
    measurement); 1: a constant; 2: none."""
    names = [n for n in models if n != "interpolated" or attempt == 0]  # dict order: best first
    return names[0] if attempt < 2 else "none"


_ATTEMPTS = 3


def message_pairs(ranks: list[RankTimeline]) -> tuple[np.ndarray, ...]:
    """Every matched, completed message: (sender, receiver, when it was sent on the
    sender's clock, when it had arrived on the receiver's clock).

    Host times, unless the receiver timed its ops on the device: then the send's device
    begin and the recv's device end. An NCCL ``wait()`` returns at once (it makes a stream
    wait, not the host), so a device-timed recv's host ``done`` may come before its send was
    even posted; a message without both device times there is not compared."""
    dones = counterpart_values(ranks, "done")  # unmatched ops read OPEN
    device_ends = counterpart_values(ranks, "dend")
    timed = np.zeros(max((r.rank for r in ranks), default=0) + 1, bool)
    timed[[r.rank for r in ranks]] = [_device_timed(r) for r in ranks]
    out: list[list[np.ndarray]] = [[], [], [], []]
    for rank in ranks:
        p = rank.p2p
        sends = p.op == OP_SEND
        by_device = sends & timed[np.maximum(p.match_rank, 0)] & (p.match_rank >= 0)
        done = np.where(by_device, device_ends[rank.rank], dones[rank.rank])
        sent = np.where(by_device, p.dbegin, p.post)
        rows = np.flatnonzero(sends & (done != OPEN) & (sent != OPEN))
        out[0].append(np.full(len(rows), rank.rank, np.int64))
        out[1].append(p.match_rank[rows].astype(np.int64))
        out[2].append(sent[rows])
        out[3].append(done[rows])
    return tuple(np.concatenate(x) if x else np.empty(0, np.int64) for x in out)


def _device_timed(rank: RankTimeline) -> bool:
    """Did the rank time its P2P ops on the device (a `device` event for any of them)?"""
    return bool(np.any(rank.p2p.dend != OPEN))


def apply_offsets(fns: dict[int, OffsetFn], owner: np.ndarray, times: np.ndarray) -> np.ndarray:
    """times - offset_of_owner(times), grouping by owner (one sort, no per-rank scan)."""
    out = times.copy()
    if not len(times):
        return out
    order = np.argsort(owner, kind="stable")
    sorted_owner = owner[order]
    bounds = run_bounds(run_starts(sorted_owner), len(order))
    for lo, hi in zip(bounds, bounds[1:]):
        fn = fns.get(int(sorted_owner[lo]))
        if fn is not None:
            idx = order[lo:hi]
            out[idx] = times[idx] - fn(times[idx])
    return out


def tightest_bounds(src: np.ndarray, dst: np.ndarray, slack: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per directed rank pair, the smallest slack."""
    if not len(slack):
        return src, dst, slack
    order = np.lexsort((slack, dst, src))
    src, dst, slack = src[order], dst[order], slack[order]
    first = run_starts(src, dst)
    return src[first], dst[first], slack[first]


def _bellman_ford(
    n: int, src: np.ndarray, dst: np.ndarray, w: np.ndarray, up: bool
) -> np.ndarray | None:
    """Greatest x <= 0 with x[src] - x[dst] <= w (or, ``up``, least x >= 0); None if infeasible."""
    x = np.zeros(n, np.int64)
    for _ in range(n + 1):
        before = x.copy()
        if up:  # x[dst] >= x[src] - w
            np.maximum.at(x, dst, x[src] - w)
        else:  # x[src] <= x[dst] + w
            np.minimum.at(x, src, x[dst] + w)
        if np.array_equal(before, x):
            return x
    return None


def align(
    ranks: list[RankTimeline], world_size: int, models: dict[int, dict[str, OffsetFn]]
) -> tuple[dict[int, OffsetFn], dict[str, Any]]:
    """Choose each rank's offset function and correction (`ClockInfo.applied`,
    ``correction_ns``); returns the functions and the alignment quality for the report."""
    src, dst, post, done = message_pairs(ranks)
    quality: dict[str, Any] = {
        "message_pairs_checked": 0,
        "early_receives_before": 0,
        "worst_early_ns": 0,
        "refined": False,
        "feasible": True,
        "model": None,
    }
    attempts = []
    for attempt in range(_ATTEMPTS):
        names = {r.rank: preference(models[r.rank], attempt) for r in ranks}
        fns = {r: models[r][n] for r, n in names.items()}
        sent = apply_offsets(fns, src, post)
        arrived = apply_offsets(fns, dst, done)
        slack = arrived - sent
        b_src, b_dst, w = tightest_bounds(src, dst, slack)
        attempts.append((names, fns, slack, b_src, b_dst, w, _refine(world_size, b_src, b_dst, w)))
        if attempts[-1][-1] is not None:
            break
    first_slack = attempts[0][2]
    quality.update(
        {
            "message_pairs_checked": len(attempts[0][5]),
            "early_receives_before": int((first_slack < 0).sum()),
            "worst_early_ns": int(-first_slack.min())
            if len(first_slack) and first_slack.min() < 0
            else 0,
        }
    )
    feasible = attempts[-1][-1] is not None
    names, fns, _, b_src, b_dst, w, result = attempts[-1] if feasible else attempts[0]
    labels = ("recorded", "constant offsets", "messages only")
    quality["model"] = (
        labels[len(attempts) - 1] if feasible else "recorded (no consistent alignment)"
    )
    quality["offsets_recorded"] = offsets_recorded(models)
    if all(name == "none" for name in names.values()):  # no rank recorded an offset
        quality["model"] = "messages only" if feasible else "none (no consistent alignment)"
    quality["feasible"] = feasible
    for rank in ranks:
        rank.clock.applied = names[rank.rank]
        rank.clock.correction_ns = int(result[rank.rank]) if result is not None else 0
    if result is not None and len(w):
        quality["refined"] = bool(np.any(result))
        quality["min_slack_ns"] = int((w + result[b_dst] - result[b_src]).min())
        quality["max_correction_ns"] = int(np.abs(result).max())
    else:
        quality["min_slack_ns"] = int(w.min()) if len(w) else None
        quality["max_correction_ns"] = 0  # nothing refined: every correction is 0
    return fns, quality


def _refine(world_size: int, src: np.ndarray, dst: np.ndarray, w: np.ndarray) -> np.ndarray | None:
    """Corrections c (ns) with c[src] - c[dst] <= w for every bound; zeros when none is
    violated; None when no such c exists."""
    if not len(w) or w.min() >= 0:
        return np.zeros(world_size, np.int64)
    down = _bellman_ford(world_size, src, dst, w, up=False)
    up = _bellman_ford(world_size, src, dst, w, up=True)
    if down is None or up is None:
        return None
    return (down + up) // 2


def clock_events(lifecycle: list[LifecycleEvent]) -> list[LifecycleEvent]:
    return [ev for ev in lifecycle if ev.e == fmt.CLOCK]
