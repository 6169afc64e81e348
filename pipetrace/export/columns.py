"""The columns of an export (`Layout`) and the builder that fills them; see `layout`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from pipetrace.analyze.model import Run
from pipetrace.interning import Interner

SLICE_STEP, SLICE_P2P, SLICE_BUBBLE, SLICE_ITERATION = range(4)
INSTANT_ARRIVAL, INSTANT_FINDING, INSTANT_EVENT = range(3)
ARRIVED, NEVER_ARRIVED, BUBBLE = "arrived", "never arrived", "bubble"
FINDINGS_TRACK = "pipetrace findings"

# sibling order of a process's tracks
TRACK_ORDER = {
    "findings": 0,
    "events": 1,
    "iterations": 2,
    "steps": 10,
    "bubbles": 40,
    "p2p": 50,
    "counters": 100_000,
}


@dataclass
class Track:
    uuid: int
    name: str
    parent: int = 0  # uuid of the parent track, 0 for top level
    rank: int | None = None
    order: int = 0  # position among its siblings
    counter: bool = False
    pid: int | None = None  # set on a rank's process track


@dataclass
class Slices:
    track: np.ndarray  # int64 track uuid
    begin: np.ndarray  # int64 ns since Run.t0_ns
    end: np.ndarray  # int64, never OPEN (unfinished spans end at t_end)
    name: np.ndarray  # int32 into Layout.names
    kind: np.ndarray  # int8 SLICE_*
    rank: np.ndarray  # int32
    row: (
        np.ndarray
    )  # int64: row in the rank's step / P2P table; the iteration for bubbles, iterations
    unfinished: np.ndarray  # bool
    flow: np.ndarray  # int64 id of the flow that starts here, 0 for none
    note: np.ndarray  # int32 into Layout.notes, -1 for none

    def __len__(self) -> int:
        return len(self.begin)


@dataclass
class Instants:
    track: np.ndarray  # int64
    ts: np.ndarray  # int64
    name: np.ndarray  # int32 into Layout.names
    kind: np.ndarray  # int8 INSTANT_*
    rank: np.ndarray  # int32, -1 for run-wide findings
    flow: np.ndarray  # int64 id of the flow that ends here, 0 for none
    parent: np.ndarray  # int64 index of the slice it sits in (arrivals), -1 for none
    detail: np.ndarray  # int32 into Layout.details, -1 for none

    def __len__(self) -> int:
        return len(self.ts)


@dataclass
class Counters:
    track: np.ndarray
    ts: np.ndarray
    value: np.ndarray

    def __len__(self) -> int:
        return len(self.ts)


@dataclass
class Layout:
    run: Run
    t_end: int
    tracks: list[Track]
    names: list[str]  # slice and instant names; names[code] is the step text of code
    slices: Slices
    instants: Instants
    counters: Counters
    details: list[dict[str, Any]]  # annotations of finding and recorded-event instants
    notes: list[str]  # ``finding`` annotations of slices
    num_flows: int


def concat(cls, parts: list[dict[str, np.ndarray]], dtypes: dict[str, Any]):
    """One ``cls`` table from the builder's chunks of columns."""
    cols = {}
    for f in fields(cls):
        arrays = [p[f.name] for p in parts]
        cols[f.name] = (
            np.concatenate(arrays).astype(dtypes[f.name]) if arrays else np.empty(0, dtypes[f.name])
        )
    return cls(**cols)


SLICE_TYPES = {
    "track": np.int64,
    "begin": np.int64,
    "end": np.int64,
    "name": np.int32,
    "kind": np.int8,
    "rank": np.int32,
    "row": np.int64,
    "unfinished": bool,
    "flow": np.int64,
    "note": np.int32,
}
INSTANT_TYPES = {
    "track": np.int64,
    "ts": np.int64,
    "name": np.int32,
    "kind": np.int8,
    "rank": np.int32,
    "flow": np.int64,
    "parent": np.int64,
    "detail": np.int32,
}
COUNTER_TYPES = {"track": np.int64, "ts": np.int64, "value": np.int64}


class Builder:
    """Collects tracks (uuids from 1, in creation order), interned names (the run's step
    texts first, so that a step's name id is its catalog code) and chunks of columns."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.tracks: list[Track] = []
        self._names = Interner(list(run.catalog.texts))
        self.names: list[str] = self._names.values
        self.slices: list[dict[str, np.ndarray]] = []
        self.num_slices = 0
        self.instants: list[dict[str, np.ndarray]] = []
        self.counters: list[dict[str, np.ndarray]] = []

    def track(self, name: str, **kw: Any) -> int:
        uuid = len(self.tracks) + 1
        self.tracks.append(Track(uuid, name, **kw))
        return uuid

    def name(self, text: str) -> int:
        return self._names.get(text)

    def add_slices(
        self,
        track: int,
        begin: np.ndarray,
        end: np.ndarray,
        name,
        kind: int,
        rank: int,
        row,
        unfinished,
    ) -> np.ndarray:
        n = len(begin)
        first = self.num_slices
        self.num_slices += n
        self.slices.append(
            {
                "track": np.full(n, track),
                "begin": begin,
                "end": end,
                "name": np.broadcast_to(name, n),
                "kind": np.full(n, kind),
                "rank": np.full(n, rank),
                "row": np.broadcast_to(row, n),
                "unfinished": np.broadcast_to(unfinished, n),
                "flow": np.zeros(n, np.int64),
                "note": np.full(n, -1),
            }
        )
        return np.arange(first, first + n)

    def add_instants(
        self, track, ts, name, kind: int, rank, *, flow=0, parent=-1, detail=-1
    ) -> None:
        n = len(ts)
        self.instants.append(
            {
                "track": np.broadcast_to(track, n),
                "ts": ts,
                "name": np.broadcast_to(name, n),
                "kind": np.full(n, kind),
                "rank": np.broadcast_to(rank, n),
                "flow": np.broadcast_to(flow, n),
                "parent": np.broadcast_to(parent, n),
                "detail": np.broadcast_to(detail, n),
            }
        )

    def add_counter(self, track: int, ts: np.ndarray, value: np.ndarray) -> None:
        if len(ts) and ts[0] > 0:  # start the series at 0 so the track reads 0 before
            ts, value = np.r_[0, ts], np.r_[0, value]
        self.counters.append({"track": np.full(len(ts), track), "ts": ts, "value": value})
