"""Every move the user can make on the timeline, as plain state changes (no UI).

The app owns one `Navigator`; a key or a click calls one method, then the app redraws what
changed. A method returns None, or a one-line notice for the user (why nothing happened).
"""

from __future__ import annotations

import numpy as np

from pipetrace.tui.filters import FilterError, StepFilter, parse_filter
from pipetrace.tui.session import Session
from pipetrace.tui.viewport import History, Viewport, ViewState


class Navigator:
    def __init__(self, session: Session, columns: int = 80) -> None:
        self.session = session
        self.index = index = session.index
        viewport = Viewport(
            float(index.t_min),
            float(max(index.t_max - index.t_min, 1)),
            columns,
            float(index.t_min),
            float(index.t_max),
        )
        self.state = ViewState(viewport, index.lane_ids(comm=True, plan=False))
        self.history = History()
        self.filter = StepFilter()
        self.finding_index: int | None = None
        # the iteration `goto_iteration` last showed, with the view it left: `[` / `]` step
        # from it while the view is unmoved (a hung iteration can span nearly the whole run)
        self._shown_iteration: tuple[int, float, float] | None = None
        self._first_view: tuple[float, float] | None = None  # `open`'s view, until moved

    @property
    def viewport(self) -> Viewport:
        return self.state.viewport

    # -- opening ---------------------------------------------------------------------------

    def open(self, columns: int) -> bool:
        """The first view: the most severe error or warning if there is one (returns True),
        else the whole run with its first step selected. When the first iteration took more
        than twice as long as the others (start-up: imports, lazy initialization, ranks
        arriving late), the view starts at the second iteration instead, which is what the
        run looks like in steady state; `z` still shows everything."""
        self.viewport.resize(columns)
        self.viewport.fit_all()
        serious = [
            k
            for k, v in enumerate(self.session.findings)
            if v.finding.severity in ("error", "warning")
        ]
        if serious:
            self.goto_finding(serious[0], remember=False)
            self._first_view = (self.viewport.start, self.viewport.span)
            return True
        durations = self.index.iter_end - self.index.iter_begin
        start = None
        if len(durations) > 1 and durations[0] > 2 * float(np.median(durations[1:])):
            start = float(self.index.iter_begin[1])
            self.viewport.fit(start, float(self.index.t_max), margin=0.01)
        if self.state.lane_ids:
            lane = self.state.lane_ids[0]
            first = (
                -1
                if start is None
                else int(np.searchsorted(self.index.lanes[lane].begin, start)) - 1
            )
            item = self.index.neighbour(lane, first, 1)
            if item is not None:
                self.select(lane, item, reveal=False)
        self._first_view = (self.viewport.start, self.viewport.span)
        return False

    # -- the cursor ------------------------------------------------------------------------

    def select(self, lane_id: int, item: int, *, reveal: bool = True) -> None:
        self.state.cursor = (lane_id, item)
        if reveal:
            lane = self.index.lanes[lane_id]
            end = lane.begin[item] if lane.open[item] else lane.end[item]
            self.viewport.reveal(float(lane.begin[item]), float(end))

    def cursor_time(self) -> float:
        """The middle of the selected step (its begin if it never ended), else of the view."""
        if self.state.cursor is None:
            return self.viewport.start + self.viewport.span / 2
        lane = self.index.lanes[self.state.cursor[0]]
        i = self.state.cursor[1]
        end = lane.begin[i] if lane.open[i] else lane.end[i]
        return float(lane.begin[i] + end) / 2

    def step(self, direction: int) -> str | None:
        if self.state.cursor is None:
            return self.lane(0)
        lane_id, item = self.state.cursor
        nxt = self.index.neighbour(lane_id, item, direction)
        if nxt is None:
            return None
        self.select(lane_id, nxt)
        return None

    def lane(self, direction: int) -> str | None:
        """To the lane above (-1) or below (+1), on the step nearest in time."""
        lanes = self.state.lane_ids
        if not lanes:
            return None
        t = self.cursor_time()
        cursor = self.state.cursor
        position = (
            lanes.index(cursor[0]) + direction if cursor is not None and cursor[0] in lanes else 0
        )
        while 0 <= position < len(lanes):
            item = self.index.nearest(lanes[position], t)
            if item is not None:
                self.select(lanes[position], item)
                return None
            position += direction or 1
        return None

    def edge(self, direction: int) -> str | None:
        """The first (-1) or last (+1) step of the cursor's lane."""
        if self.state.cursor is None:
            return None
        lane_id = self.state.cursor[0]
        start = -1 if direction < 0 else len(self.index.lanes[lane_id])
        item = self.index.neighbour(lane_id, start, -direction)
        if item is not None:
            self.select(lane_id, item)
        return None

    # -- zoom and pan ----------------------------------------------------------------------

    def pan(self, fraction: float) -> None:
        """Pan by a fraction of the view (keys)."""
        self.viewport.pan(fraction * self.viewport.columns)

    def pan_columns(self, columns: float) -> None:
        """Pan by a number of columns (dragging, a horizontal wheel)."""
        self.viewport.pan(columns)

    def resize(self, columns: int) -> None:
        """Keep the time per column (blocks keep their size), except on the first view while
        nothing moved it: it keeps the time it shows. The first view can be laid out before
        the timeline has its width, and kept per column it would span many times its window."""
        vp = self.viewport
        if self._first_view == (vp.start, vp.span):
            vp.columns = max(columns, 1)
            self._first_view = (vp.start, vp.span)
        else:
            vp.resize(columns)

    def zoom(self, factor: float, column: float | None = None) -> None:
        """Zoom around ``column``, by default around the cursor when it is in view."""
        vp = self.viewport
        if column is None:
            anchor = vp.column_of(self.cursor_time())
            column = anchor if 0 <= anchor <= vp.columns else None
        vp.zoom(factor, anchor_column=column)

    def zoom_to_cursor(self) -> None:
        """Fit the selected step (with as much again on each side); a step too short to see,
        or one that never ended, gets a 16x zoom around its begin instead."""
        if self.state.cursor is None:
            return
        lane_id, i = self.state.cursor
        lane = self.index.lanes[lane_id]
        vp = self.viewport
        begin, end = float(lane.begin[i]), float(lane.end[i])
        if lane.open[i] or end - begin < vp.span / 64:
            vp.fit(begin - vp.span / 32, begin + vp.span / 32, margin=0)
        else:
            vp.fit(begin, end, margin=1.0)

    def fit(self) -> None:
        self.viewport.fit_all()

    # -- jumps -----------------------------------------------------------------------------

    def iteration(self, direction: int) -> str | None:
        """The next / previous iteration; from the whole run, the first / last."""
        its = [int(i) for i in self.index.iterations]
        if not its:
            return "this run recorded no iteration"
        vp = self.viewport
        shown = self._shown_iteration
        if shown is not None and shown[1:] == (vp.start, vp.span) and shown[0] in its:
            k = its.index(shown[0]) + direction
        elif vp.span > (self.index.t_max - self.index.t_min) * 0.9:
            k = 0 if direction > 0 else len(its) - 1
        else:
            current = self.index.iteration_at(vp.start + vp.span / 2)
            k = (its.index(current) if current in its else 0) + direction
        return self.goto_iteration(its[max(0, min(k, len(its) - 1))])

    def goto_iteration(self, iteration: int) -> str | None:
        span = self.index.iteration_span(iteration)
        if span is None:
            iterations = _ranges([int(i) for i in self.index.iterations])
            return f"no iteration {iteration}; this run has {iterations}"
        if self.state.cursor is not None:
            self.history.push(self.state.cursor)
        self.viewport.fit(*span)
        self._shown_iteration = (iteration, self.viewport.start, self.viewport.span)
        cursor = self.state.cursor
        lane_id = cursor[0] if cursor else (self.state.lane_ids[0] if self.state.lane_ids else None)
        if lane_id is not None:
            item = self.index.nearest(lane_id, span[0])
            if item is not None:
                self.select(lane_id, item, reveal=False)
        return None

    def peer(self) -> str | None:
        """To the matching op on the other rank (and, from there, back)."""
        if self.state.cursor is None:
            return None
        target = self.index.peer(*self.state.cursor)
        if target is None:
            if self.index.p2p_rows(*self.state.cursor):
                return "this op has no matching op on its peer"
            return "not a P2P op: select a SEND/RECV step or an op on a p2p row"
        if target[0] not in self.state.lane_ids:
            return f"rank {self.index.lanes[target[0]].rank} is hidden by the filter"
        self.history.push(self.state.cursor)
        self.select(*target)
        return None

    def back(self) -> str | None:
        place = self.history.pop()
        while place is not None and place[0] not in self.state.lane_ids:
            place = self.history.pop()
        if place is None:
            return "nothing to go back to"
        self.select(*place)
        return None

    # -- findings --------------------------------------------------------------------------

    def finding(self, direction: int) -> str | None:
        n = len(self.session.findings)
        if not n:
            return "no findings"
        if self.finding_index is None:
            k = 0 if direction > 0 else n - 1
        else:
            k = (self.finding_index + direction) % n
        return self.goto_finding(k)

    def goto_finding(self, k: int, *, remember: bool = True) -> str | None:
        """Show finding k: its time range, every step involved highlighted, the cursor on the
        first."""
        view = self.session.findings[k]
        self.finding_index = k
        state = self.state
        if remember and state.cursor is not None:
            self.history.push(state.cursor)
        state.highlight = frozenset(view.items)
        state.version += 1
        if view.window is not None:
            self.viewport.fit(*view.window, margin=0.05)
        if view.focus is not None and view.focus[0] in state.lane_ids:
            self.select(*view.focus, reveal=False)
        elif state.cursor is None and state.lane_ids:  # a finding of no step (a straggler)
            item = self.index.nearest(state.lane_ids[0], self.viewport.start)
            if item is not None:
                self.select(state.lane_ids[0], item, reveal=False)
        shown = {self.index.lanes[lane].rank for lane in state.lane_ids}
        hidden = sorted({self.index.lanes[lane].rank for lane, _ in view.items} - shown)
        return f"rank(s) {hidden} of this finding are hidden by the filter" if hidden else None

    def clear(self) -> str | None:
        """Drop the highlight, or else the filter."""
        if self.state.highlight:
            self.state.highlight = frozenset()
            self.state.version += 1
            self.finding_index = None
        elif not self.filter.empty:
            return self.set_filter("")
        return None

    # -- lanes: toggles and the filter -----------------------------------------------------

    def toggle_plan(self) -> str | None:
        if self.session.planned is None:
            return f"no planned timeline: {self.session.plan_note}"
        self.state.show_plan = not self.state.show_plan
        self._relayout()
        return None

    def toggle_comm(self) -> None:
        self.state.show_comm = not self.state.show_comm
        self._relayout()

    def set_filter(self, text: str) -> str | None:
        """Apply a filter text (see `filters`); returns what is wrong with it, if anything."""
        try:
            flt = parse_filter(text)
        except FilterError as exc:
            return str(exc)
        world = self.session.run.world_size
        if flt.ranks is not None and not any(0 <= r < world for r in flt.ranks):
            return f"no such rank: the run has ranks 0-{world - 1}"
        self.filter = flt
        self.index.set_filter(flt.matching_codes(self.session.run.catalog))
        self._relayout()
        return None

    def _relayout(self) -> None:
        """Recompute the lanes to draw after a toggle or a rank filter; keep the cursor near."""
        state, index = self.state, self.index
        ranks = set(self.filter.ranks) if self.filter.ranks is not None else None
        state.lane_ids = index.lane_ids(ranks=ranks, comm=state.show_comm, plan=state.show_plan)
        state.version += 1
        if state.cursor is None or state.cursor[0] in state.lane_ids:
            return
        t = self.cursor_time()
        main = index.main_lane(index.lanes[state.cursor[0]].rank)
        lane = main if main in state.lane_ids else (state.lane_ids[0] if state.lane_ids else None)
        item = index.nearest(lane, t) if lane is not None else None
        state.cursor = (lane, item) if lane is not None and item is not None else None


def _ranges(values: list[int]) -> str:
    if not values:
        return "no iterations"
    if values == list(range(values[0], values[-1] + 1)):
        return f"iterations {values[0]}-{values[-1]}"
    return "iterations " + ",".join(map(str, values))
