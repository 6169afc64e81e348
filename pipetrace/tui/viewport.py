"""The visible time window of the timeline (zoom and pan arithmetic), with no UI.

Times are ns since Run.t0_ns, as floats; a column is ``span / columns`` ns wide.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_NS_PER_COLUMN = 10.0


@dataclass
class Viewport:
    start: float  # ns at the left edge of the time area
    span: float  # ns across the whole time area
    columns: int  # width of the time area in cells
    lo: float = 0.0  # the run's extent: the view may not leave [lo - margin, hi + margin]
    hi: float = 1.0

    @property
    def end(self) -> float:
        return self.start + self.span

    @property
    def ns_per_column(self) -> float:
        return self.span / max(self.columns, 1)

    def time_at(self, column: float) -> float:
        return self.start + column * self.ns_per_column

    def column_of(self, t: float) -> float:
        return (t - self.start) / self.ns_per_column

    def resize(self, columns: int) -> None:
        """Keep ns per column when the widget is resized, so blocks keep their size."""
        columns = max(columns, 1)
        if columns != self.columns:
            self.span = self.ns_per_column * columns
            self.columns = columns
            self._clamp()

    def fit(self, t0: float, t1: float, *, margin: float = 0.02) -> None:
        """Show [t0, t1] with a small margin on each side."""
        width = max(t1 - t0, MIN_NS_PER_COLUMN * self.columns)
        pad = width * margin
        self.start, self.span = t0 - pad, width + 2 * pad
        self._clamp()

    def fit_all(self) -> None:
        self.fit(self.lo, self.hi, margin=0.01)

    def zoom(self, factor: float, *, anchor_column: float | None = None) -> None:
        """Zoom by ``factor`` (>1 in) keeping the time under ``anchor_column`` in place."""
        anchor = self.columns / 2 if anchor_column is None else anchor_column
        t = self.time_at(anchor)
        self.span = min(max(self.span / factor, MIN_NS_PER_COLUMN * self.columns), self._max_span)
        self.start = t - anchor * self.ns_per_column
        self._clamp()

    def pan(self, columns: float) -> None:
        self.start += columns * self.ns_per_column
        self._clamp()

    def center_on(self, t: float) -> None:
        self.start = t - self.span / 2
        self._clamp()

    def reveal(self, t0: float, t1: float, *, margin_columns: int = 4) -> None:
        """Pan as little as possible so that [t0, t1] is in view; zoom out only if it cannot fit."""
        margin = margin_columns * self.ns_per_column
        if t1 - t0 + 2 * margin > self.span:
            if t1 - t0 > self.span:
                self.fit(t0, t1)
                return
            self.center_on((t0 + t1) / 2)
            return
        if t0 - margin < self.start:
            self.start = t0 - margin
        elif t1 + margin > self.end:
            self.start = t1 + margin - self.span
        self._clamp()

    @property
    def _max_span(self) -> float:
        return max((self.hi - self.lo) * 4, MIN_NS_PER_COLUMN * self.columns)

    def _clamp(self) -> None:
        """Keep the centre of the view on the run."""
        center = min(max(self.start + self.span / 2, self.lo), self.hi)
        self.start = center - self.span / 2


@dataclass
class History:
    """Where the cursor was before each jump (jump to peer, to a finding, to an iteration)."""

    limit: int = 100

    def __post_init__(self) -> None:
        self._stack: list[tuple[int, int]] = []

    def push(self, place: tuple[int, int]) -> None:
        if not self._stack or self._stack[-1] != place:
            self._stack.append(place)
            del self._stack[: -self.limit]

    def pop(self) -> tuple[int, int] | None:
        return self._stack.pop() if self._stack else None

    def __len__(self) -> int:
        return len(self._stack)


@dataclass
class ViewState:
    """What the timeline shows, owned by the app and read by the timeline and the ruler."""

    viewport: Viewport
    lane_ids: list[int]  # lanes drawn, top to bottom
    cursor: tuple[int, int] | None = None  # (lane, item)
    highlight: frozenset[tuple[int, int]] = frozenset()  # (lane, item) of the selected finding
    show_comm: bool = True
    show_plan: bool = False
    version: int = 0  # bumped on any change that needs a redraw (filter, highlight)

    def highlighted_in(self, lane_id: int) -> list[int]:
        return [item for lane, item in self.highlight if lane == lane_id]
