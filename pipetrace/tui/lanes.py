"""One row of the timeline and what it costs to draw, with no UI.

A *lane* is one screen row: a rank's main-thread steps, one of its other threads, its steps
as the device ran them (with device timing), its P2P ops in flight, its planned steps, or
its memory samples (each item one sample, held until the next; drawn as a level, not
coloured by category).
Its *items* are its spans sorted by begin time; ``item`` numbers index that order. Each item
has a *category* (what it is coloured by).

Zoomed out, a screen column covers many spans. `Lane.columns` answers "which category covers
most of this column" for every column at once, in O(columns x categories x log n): per
category the lane keeps its begins and ends sorted with prefix sums, so the time covered up
to ``t`` is ``t * (#begun - #ended) - (sum of begins - sum of ends)``; that holds for
overlapping spans too (P2P ops in flight overlap). Nothing here is proportional to the
number of spans in view, so a frame costs the same at any zoom.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipetrace.analyze.model import KINDS
from pipetrace.schedule.ir import StepKind

# Categories: what a block is coloured by. Small ints so a column is one int8.
CATEGORIES = ("F", "B", "I", "W", "send", "recv", "overlapped", "fsdp", "other", "dimmed")
CAT_F, CAT_B, CAT_I, CAT_W, CAT_SEND, CAT_RECV, CAT_OVERLAP, CAT_FSDP, CAT_OTHER, CAT_DIM = range(
    10
)
BUBBLE = -2  # idle inside an iteration (main and plan lanes)
BLANK = -1  # nothing: outside any iteration, or an idle sub-row
NONE = -3  # no runner-up: the column is clear-cut

_CAT_OF_KIND = {
    StepKind.F: CAT_F,
    StepKind.B: CAT_B,
    StepKind.I: CAT_I,
    StepKind.W: CAT_W,
    StepKind.SEND_F: CAT_SEND,
    StepKind.SEND_B: CAT_SEND,
    StepKind.RECV_F: CAT_RECV,
    StepKind.RECV_B: CAT_RECV,
    StepKind.OVERLAP_F_B: CAT_OVERLAP,
    StepKind.UNSHARD: CAT_FSDP,
    StepKind.RESHARD: CAT_FSDP,
    StepKind.REDUCE_GRAD: CAT_FSDP,
    StepKind.TIED_REDUCE: CAT_FSDP,  # a gradient collective, drawn like FSDP's
}
# catalog kind code (index into KINDS, -1 unparsable) + 1 -> category
CATEGORY_OF_KIND_CODE = np.array(
    [CAT_OTHER] + [_CAT_OF_KIND.get(k, CAT_OTHER) for k in KINDS], np.int8
)

MAIN, THREAD, DEVICE, COMM, PLAN, MEMORY = "main", "thread", "device", "comm", "plan", "memory"
SHORT_THREAD_NAMES = {"overlap": "ovlp"}  # lane names are 4 characters in the gutter
STEPS, P2P, SAMPLES = "steps", "p2p", "samples"


def category_of_kind(kind: str) -> int:
    """The category of a StepKind value such as ``"SEND_F"`` (the simulator's kinds)."""
    try:
        return _CAT_OF_KIND.get(StepKind(kind), CAT_OTHER)
    except ValueError:
        return CAT_OTHER


@dataclass
class _Coverage:
    """One category's spans of a lane: begins and ends each sorted, with prefix sums."""

    begins: np.ndarray
    begin_sums: np.ndarray  # [0, b0, b0+b1, ...]
    ends: np.ndarray
    end_sums: np.ndarray

    @classmethod
    def of(cls, begin: np.ndarray, end: np.ndarray) -> _Coverage:
        b, e = np.sort(begin), np.sort(end)
        return cls(b, np.r_[0, np.cumsum(b)], e, np.r_[0, np.cumsum(e)])

    def covered_until(self, t: np.ndarray) -> np.ndarray:
        """Total time covered by the spans up to each time in ``t`` (float64 ns)."""
        nb = np.searchsorted(self.begins, t, side="right")
        ne = np.searchsorted(self.ends, t, side="right")
        return t * (nb - ne) - (self.begin_sums[nb] - self.end_sums[ne]).astype(np.float64)


@dataclass
class Cells:
    """One lane drawn into ``width`` columns."""

    cat: np.ndarray  # int8 per column: a category, BUBBLE or BLANK
    item: np.ndarray  # int64 per column: the item drawn there, -1 when zoomed out or none
    second: (
        np.ndarray
    )  # int8 per column: the runner-up (category, BUBBLE or BLANK), NONE if clear-cut


@dataclass
class Lane:
    """One row of the timeline. Arrays are per item, items sorted by begin."""

    rank: int
    role: str  # MAIN, THREAD, DEVICE, COMM, PLAN or MEMORY
    name: str  # gutter label: "main", a thread name, "dev", "p2p", "plan", "mem"
    source: str  # STEPS (rows of the rank's StepTable), P2P (its P2PTable), PLAN or
    # SAMPLES (its MemoryTable)
    rows: np.ndarray  # int64: row in the source table (PLAN: plan position)
    begin: np.ndarray  # int64 ns since Run.t0_ns
    end: np.ndarray  # int64 drawn end: an open span ends where the rank's log ends
    open: np.ndarray  # bool: the span never ended
    code: np.ndarray  # int32 into Run.catalog (-1 unknown)
    it: np.ndarray  # int32 iteration
    base_cat: np.ndarray  # int8 category by kind
    iter_spans: tuple[np.ndarray, np.ndarray] = (np.empty(0, np.int64), np.empty(0, np.int64))
    cat: np.ndarray = field(default=None)  # type: ignore[assignment]  # after the filter
    levels: np.ndarray | None = None  # int64 per item on a MEMORY lane: the bytes it shows
    _coverage: dict[int, _Coverage] | None = field(default=None, repr=False)
    _item_of_row: dict[int, int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.cat is None:
            self.set_categories(self.base_cat)

    def __len__(self) -> int:
        return len(self.begin)

    def set_categories(self, cat: np.ndarray) -> None:
        self.cat = cat
        self._coverage = None  # made again on the next draw: a lane may never be drawn

    def coverage(self) -> dict[int, _Coverage]:
        """Per category of ``cat``, its spans' coverage (made on the first draw)."""
        if self._coverage is None:
            cat = self.cat
            self._coverage = {
                int(c): _Coverage.of(self.begin[cat == c], self.end[cat == c])
                for c in np.unique(cat)
            }
        return self._coverage

    def item_of_row(self, row: int) -> int | None:
        if self._item_of_row is None:
            self._item_of_row = {int(r): i for i, r in enumerate(self.rows)}
        return self._item_of_row.get(int(row))

    # -- drawing ---------------------------------------------------------------------------

    def columns(self, t0: float, dt: float, width: int, *, max_items: int | None = None) -> Cells:
        """Which category dominates each of ``width`` columns of ``dt`` ns from ``t0``.

        Idle time competes too: a column that is mostly idle shows BUBBLE inside an
        iteration (main and plan lanes) and BLANK elsewhere. When at most ``max_items``
        (default: 4 per column) items are in view, each column also names its item.
        """
        bounds = t0 + dt * np.arange(width + 1, dtype=np.float64)
        coverage = self.coverage()
        cats = sorted(coverage)
        cols = np.arange(width)
        idle_code = BLANK
        if self.role in (MAIN, PLAN) and len(self.iter_spans[0]):
            centers = bounds[:-1] + dt / 2
            ib, ie = self.iter_spans
            k = np.searchsorted(ib, centers, side="right") - 1
            inside = (k >= 0) & (centers < ie[np.maximum(k, 0)])
            idle_code = np.where(inside, BUBBLE, BLANK).astype(np.int8)
        if cats:
            cov = np.stack(
                [np.diff(coverage[c].covered_until(bounds)) for c in cats] + [np.zeros(width)]
            )
            cov[-1] = np.maximum(dt - cov[:-1].sum(axis=0), 0)  # idle
            codes = np.array(cats + [0], np.int8)
            best = np.argmax(cov, axis=0)
            top = cov[best, cols]
            cov[best, cols] = -1.0
            runner = np.argmax(cov, axis=0)
            runner_up = cov[runner, cols]
            is_idle = best == len(cats)
            cat = np.where(is_idle, idle_code, codes[best]).astype(np.int8)
            # a column where a second category (or idle) covers a quarter or more is "mixed"
            mixed = (runner_up >= dt / 4) & (top < dt)
            second = np.where(runner == len(cats), idle_code, codes[runner]).astype(np.int8)
            second = np.where(mixed, second, NONE).astype(np.int8)
        else:
            cat = np.broadcast_to(np.asarray(idle_code, np.int8), (width,)).copy()
            second = np.full(width, NONE, np.int8)
        item = np.full(width, -1, np.int64)
        lo, hi = self.in_view(t0, t0 + dt * width)
        if hi - lo <= (max_items if max_items is not None else 4 * width):
            idx = np.arange(lo, hi)
            c0 = np.clip(np.floor((self.begin[idx] - t0) / dt), 0, width).astype(np.int64)
            c1 = np.clip(np.ceil((self.end[idx] - t0) / dt), 0, width).astype(np.int64)
            c1 = np.maximum(c1, np.minimum(c0 + 1, width))
            for i, a, b in zip(idx.tolist(), c0.tolist(), c1.tolist()):
                if a >= width:
                    continue
                # a thin span never paints over a column another span dominates
                if (
                    b - a == 1
                    and item[a] >= 0
                    and self.cat[item[a]] == cat[a]
                    and self.cat[i] != cat[a]
                ):
                    continue
                item[a:b] = i
        return Cells(cat, item, second)

    def in_view(self, t0: float, t1: float) -> tuple[int, int]:
        """The range of items that may show between t0 and t1 (a few before t0 included,
        since spans may overlap and a long one can start before the view)."""
        lo = int(np.searchsorted(self.begin, t0, side="right"))
        hi = int(np.searchsorted(self.begin, t1, side="left"))
        back = 1 if self.role != COMM else 8
        while back and lo > 0:
            lo -= 1
            back -= 1
        while lo < hi and self.end[lo] < t0:
            lo += 1
        return lo, hi

    def columns_of(self, item: int, t0: float, dt: float, width: int) -> tuple[int, int] | None:
        """Columns [c0, c1) an item covers (at least one), None when out of view."""
        b, e = float(self.begin[item]), float(self.end[item])
        if e < t0 or b >= t0 + dt * width:
            return None
        c0 = max(int((b - t0) // dt), 0)
        c1 = min(max(int(np.ceil((e - t0) / dt)), c0 + 1), width)
        return c0, max(c1, c0 + 1)

    # -- lookups ---------------------------------------------------------------------------

    def item_at(self, t: float, tolerance: float = 0.0) -> int | None:
        """The item covering time t (the latest begun, if several), else the nearest one
        within ``tolerance`` ns, else None."""
        if not len(self):
            return None
        j = int(np.searchsorted(self.begin, t, side="right"))
        for i in range(j - 1, max(j - 64, -1), -1):
            if self.begin[i] <= t <= self.end[i]:
                return i
            if self.role != COMM:
                break
        best, gap = None, tolerance
        for i in (j - 1, j):
            if 0 <= i < len(self):
                d = max(self.begin[i] - t, t - self.end[i], 0)
                if d <= gap:
                    best, gap = i, d
        return best

    def nearest(self, t: float, *, allowed: np.ndarray | None = None) -> int | None:
        """The item whose span is closest to t (ties: the earlier)."""
        n = len(self)
        if not n:
            return None
        candidates = np.arange(n) if allowed is None else np.flatnonzero(allowed)
        if not len(candidates):
            return None
        j = int(np.searchsorted(self.begin[candidates], t, side="right"))
        best, gap = None, None
        for k in range(max(j - 2, 0), min(j + 1, len(candidates))):
            i = int(candidates[k])
            d = max(self.begin[i] - t, t - self.end[i], 0)
            if gap is None or d < gap:
                best, gap = i, d
        return best
