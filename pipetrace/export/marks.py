"""Instants that mark what went wrong: the analyzers' findings and the recorded lifecycle
events (stall, abort, exception, ...), each on its rank's track, where it happened."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from pipetrace.analyze.findings import Finding, StepRef
from pipetrace.analyze.model import OPEN, RankTimeline, Run
from pipetrace.export.columns import (
    FINDINGS_TRACK,
    INSTANT_EVENT,
    INSTANT_FINDING,
    TRACK_ORDER,
    Builder,
    Slices,
)
from pipetrace.recorder import format as fmt

SHOWN_EVENTS = (fmt.STALL, fmt.DUMP, fmt.ABORT, fmt.SIGNAL, fmt.EXCEPTION, fmt.RUN_END)
_MAX_TEXT = 4000


class Marks:
    """Adds these instants to a layout being built (`layout.build_layout`)."""

    def __init__(self, builder: Builder, run: Run, t_end: int) -> None:
        self.b = builder
        self.run = run
        self.t_end = t_end
        self.process: dict[int, int] = {}  # rank -> process track uuid
        self._findings_tracks: dict[int, int] = {}
        self.details: list[dict[str, Any]] = []
        self.notes: list[str] = []

    def _track(self, rank: int) -> int:
        """The rank's findings track (a top-level one for findings about no rank)."""
        track = self._findings_tracks.get(rank)
        if track is None:
            if rank in self.process:
                track = self.b.track(
                    FINDINGS_TRACK,
                    parent=self.process[rank],
                    rank=rank,
                    order=TRACK_ORDER["findings"],
                )
            else:
                track = self.b.track(FINDINGS_TRACK)
            self._findings_tracks[rank] = track
        return track

    def _instant(
        self, rank: int, ts: int, name: str, kind: int, detail: dict[str, Any], track: int
    ) -> None:
        self.details.append(detail)
        self.b.add_instants(
            np.array([track]),
            np.array([min(max(ts, 0), self.t_end)], np.int64),
            self.b.name(name),
            kind,
            rank,
            detail=len(self.details) - 1,
        )

    def recorded_events(self, rank: RankTimeline) -> None:
        shown = [ev for ev in rank.lifecycle if ev.e in SHOWN_EVENTS]
        if not shown:
            return
        track = self.b.track(
            "recorded events",
            parent=self.process[rank.rank],
            rank=rank.rank,
            order=TRACK_ORDER["events"],
        )
        for ev in shown:
            detail = {k: _scalar(v) for k, v in ev.fields.items()}
            self._instant(rank.rank, ev.t, ev.e, INSTANT_EVENT, detail, track)

    def findings(
        self, findings: list[Finding], slices: Slices, step_index: dict[int, np.ndarray]
    ) -> None:
        """An instant per place a finding points at; the steps it names get a ``finding`` note."""
        notes: dict[int, list[str]] = {}
        for f in findings:
            base = {"severity": f.severity, "kind": f.kind, "message": f.message, "cause": f.cause}
            name = f"{f.severity}: {f.kind}"
            start = f.time_ns[0] if f.time_ns else None
            for ref in f.steps:
                row = self._locate(ref)
                ts = (
                    ref.time_ns
                    if ref.time_ns is not None
                    else (
                        int(self.run.ranks[ref.rank].steps.begin[row]) if row is not None else start
                    )
                )
                if ts is None:
                    ts = self._rank_end(ref.rank)
                detail = {
                    **base,
                    "step": ref.step,
                    "iteration": ref.iteration,
                    "note": ref.note,
                }
                self._instant(
                    ref.rank,
                    ts,
                    name,
                    INSTANT_FINDING,
                    {k: v for k, v in detail.items() if v is not None},
                    self._track(ref.rank if 0 <= ref.rank < self.run.world_size else -1),
                )
                if row is not None and ref.rank in step_index:
                    notes.setdefault(int(step_index[ref.rank][row]), []).append(
                        f"{f.severity} {f.kind}: {ref.note or f.message}"
                    )
            # every rank it names gets one, those without a step of theirs (the rank at the
            # end of a stall's chain, say) at the finding's time
            for r in sorted(set(f.ranks) - {ref.rank for ref in f.steps}):
                ts = start if start is not None else self._rank_end(r)
                self._instant(
                    r,
                    ts,
                    name,
                    INSTANT_FINDING,
                    base,
                    self._track(r if 0 <= r < self.run.world_size else -1),
                )
            if not f.steps and not f.ranks:
                self._instant(-1, start or 0, name, INSTANT_FINDING, base, self._track(-1))
        for index, texts in notes.items():
            slices.note[index] = len(self.notes)
            self.notes.append(" | ".join(dict.fromkeys(texts)))

    def _locate(self, ref: StepRef) -> int | None:
        """The step row a finding names: same text (and iteration, position when given); the
        one running at the finding's time, else the last."""
        if not 0 <= ref.rank < self.run.world_size or not self.run.ranks[ref.rank].present:
            return None
        code = self.run.catalog.code(ref.step)
        if code < 0:
            return None
        steps = self.run.ranks[ref.rank].steps
        rows = np.flatnonzero(steps.code == code)
        for column, value in ((steps.it, ref.iteration), (steps.pos, ref.position)):
            if value is not None and len(rows):
                narrowed = rows[column[rows] == value]
                rows = narrowed if len(narrowed) else rows
        if not len(rows):
            return None
        if ref.time_ns is not None:
            end = np.where(steps.end[rows] == OPEN, self.t_end, steps.end[rows])
            inside = rows[(steps.begin[rows] <= ref.time_ns) & (ref.time_ns <= end)]
            if len(inside):
                return int(inside[-1])
        return int(rows[-1])

    def _rank_end(self, rank: int) -> int:
        if not 0 <= rank < self.run.world_size or not self.run.ranks[rank].present:
            return self.t_end
        r = self.run.ranks[rank]
        times = [
            int(a.max()) for a in (r.steps.begin, r.steps.end, r.p2p.post, r.p2p.done) if len(a)
        ]
        times += [ev.t for ev in r.lifecycle]
        return max(times, default=self.t_end)


def _scalar(value: Any) -> Any:
    """A recorded field as an annotation value: scalars as they are, the rest as short JSON."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    text = value if isinstance(value, str) else orjson.dumps(value).decode()
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 1] + "…"
