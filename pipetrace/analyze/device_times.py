"""Device times in the analysis: which times the analyzers use, and what the device did.

On CUDA a step's host times are only when its kernels were enqueued; the recorder's
``device`` events (joined to their step or P2P op by the loader: the ``dbegin``/``dend``
columns) say when the device ran them. `timed_run` gives the run the performance analyzers
read (metrics, bubbles, critical path, stragglers, exposed comm): device times where a row
has them, host times otherwise. Hang and failure analysis keep the host times: what a host
thread waits in is a host fact.

`device_timing` says which times were used, how many steps were launch-bound or
device-bound (`pipetrace.recorder.device.classify`), and names the work a rank's last stall
dump, exception or run_end lists as never completed on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pipetrace.analyze.model import OPEN, RankTimeline, Run
from pipetrace.recorder import format as fmt
from pipetrace.recorder.device.classify import Boundness, classify
from pipetrace.recorder.device.spans import DeviceSpan, PendingWork
from pipetrace.records import JsonRecord, record_json

DEVICE, HOST = "device", "host"
"""The values of ``metrics.timing.source``."""
_LISTING = (fmt.RUN_END, fmt.EXCEPTION, fmt.DUMP, fmt.STALL)
"""The events that list ``device_pending``."""


def device_rows(begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """The rows with both device times (a step or op the device was seen to run)."""
    return (begin != OPEN) & (end != OPEN)


def timed_run(run: Run) -> Run:
    """``run`` with device times in place of host times wherever a row has them; the run
    itself when no rank recorded device times."""
    if not any(device_rows(r.steps.dbegin, r.steps.dend).any() for r in run.present_ranks):
        return run
    return replace(run, ranks=[_timed_rank(r) for r in run.ranks])


def _timed_rank(rank: RankTimeline) -> RankTimeline:
    s, p = rank.steps, rank.p2p
    on_step = device_rows(s.dbegin, s.dend)
    on_op = device_rows(p.dbegin, p.dend)
    steps = replace(
        s, begin=np.where(on_step, s.dbegin, s.begin), end=np.where(on_step, s.dend, s.end)
    )
    p2p = replace(p, post=np.where(on_op, p.dbegin, p.post), done=np.where(on_op, p.dend, p.done))
    return replace(rank, steps=steps, p2p=p2p)


@dataclass
class RankDeviceTiming(JsonRecord):
    """One rank's device timing: how many steps had device times and how they were bound."""

    rank: int
    source: str
    """`DEVICE` when the rank recorded device times, else `HOST`."""
    device_steps: int
    launch_bound_steps: int
    device_bound_steps: int
    max_lag_ns: int | None
    """The longest lag (device end minus host end) of a step; None without device times."""
    worst_step: str | None
    """The step with that lag."""


@dataclass
class DevicePending:
    """The oldest work a rank's last listing (stall, dump, exception or run_end) names as
    enqueued and never completed on the device: what the rest is queued behind."""

    rank: int
    work: PendingWork
    behind: int
    """How many more items the listing names (later work, queued behind it or stuck too)."""

    @property
    def message(self) -> str:
        """``rank 3: 3SEND_B5 enqueued 41 s ago, never completed on the device``."""
        return f"rank {self.rank}: {self.work.describe()}"

    def to_json(self) -> dict[str, Any]:
        w = self.work
        return {
            "rank": self.rank,
            "step": w.label,
            "stream": w.stream,
            "age_s": round(w.age_ns / 1e9, 3),
            "started": w.started,
            "behind": self.behind,
            "message": self.message,
        }


@dataclass
class DeviceTiming:
    """``metrics.timing`` of `pipetrace analyze --json` (docs/analyze.md)."""

    source: str
    """`DEVICE` when the analyzers used device times (any rank recorded them), else `HOST`."""
    ranks: list[RankDeviceTiming]
    device_pending: list[DevicePending]

    def to_json(self) -> dict[str, Any]:
        return record_json(
            self,
            ranks=[r.to_json() for r in self.ranks],
            device_pending=[p.to_json() for p in self.device_pending],
        )


def device_timing(run: Run) -> DeviceTiming:
    ranks = [_rank_timing(run, r) for r in run.present_ranks]
    source = DEVICE if any(r.source == DEVICE for r in ranks) else HOST
    pending = [p for p in map(pending_work, run.present_ranks) if p is not None]
    return DeviceTiming(source, ranks, pending)


@dataclass
class StepBoundness:
    """A rank's ended steps with device times, and which of them were device-bound."""

    rows: np.ndarray
    """Rows of the rank's `StepTable`."""
    device_bound: np.ndarray
    """Per row of ``rows``: `classify` said device-bound."""
    lag_ns: np.ndarray
    """Per row of ``rows``: device end minus host end."""


def step_boundness(rank: RankTimeline) -> StepBoundness:
    """Launch-bound or device-bound, for every ended step the device was seen to run (also
    for the Perfetto export's device tracks)."""
    s = rank.steps
    rows = np.flatnonzero(device_rows(s.dbegin, s.dend) & (s.end != OPEN))
    unc = _uncertainty(rank)
    spans = [
        DeviceSpan(i, "", "compute", *(int(c[i]) for c in (s.begin, s.end, s.dbegin, s.dend)), unc)
        for i in rows.tolist()
    ]
    device_bound = np.array([classify(span) is Boundness.DEVICE for span in spans], bool)
    return StepBoundness(rows, device_bound, s.dend[rows] - s.end[rows])


def _rank_timing(run: Run, rank: RankTimeline) -> RankDeviceTiming:
    bound = step_boundness(rank)
    if not len(bound.rows):
        return RankDeviceTiming(rank.rank, HOST, 0, 0, 0, None, None)
    worst = int(np.argmax(bound.lag_ns))
    device_bound = int(bound.device_bound.sum())
    return RankDeviceTiming(
        rank.rank,
        DEVICE,
        len(bound.rows),
        len(bound.rows) - device_bound,
        device_bound,
        int(bound.lag_ns[worst]),
        run.catalog.texts[int(rank.steps.code[bound.rows[worst]])],
    )


def _uncertainty(rank: RankTimeline) -> int:
    """The largest anchor uncertainty the rank recorded (device times lie within ± this)."""
    anchors = rank.events_of(fmt.DEVICE_ANCHOR)
    values = [a.fields.get("uncertainty_ns") for a in anchors]
    return max((v for v in values if fmt.is_int64(v)), default=0)


def pending_work(rank: RankTimeline) -> DevicePending | None:
    """The oldest work the rank's last listing names (None: nothing listed)."""
    listings = [ev for ev in rank.lifecycle if ev.e in _LISTING and "device_pending" in ev.fields]
    items = listings[-1].fields["device_pending"] if listings else None
    works = [w for w in map(_work, items) if w is not None] if isinstance(items, list) else []
    if not works:
        return None
    oldest = min(works, key=lambda work: work.enqueued_ns)
    return DevicePending(rank.rank, oldest, len(works) - 1)


def _work(item: Any) -> PendingWork | None:
    """One ``device_pending`` entry, None when it lacks what the message needs (the loader
    counted such an entry as damage)."""
    if not fmt.is_pending_entry(item):
        return None
    age = item["age_s"]
    stream = item.get("stream") if isinstance(item.get("stream"), str) else "compute"
    key = item["id"] if fmt.is_int64(item.get("id")) else -1
    enqueued = item["enqueued_t"] if fmt.is_int64(item.get("enqueued_t")) else 0
    return PendingWork(
        key, item["step"], stream, enqueued, int(age * 1e9), item.get("started") is True
    )
