"""The timeline widget: one line per lane, time running right, drawn only where visible.

It owns no state: the app binds a `Session` and a `ViewState` and refreshes it after any
change. Mouse gestures are posted as messages (the app applies them, like the keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.events import (
    Click,
    MouseDown,
    MouseMove,
    MouseScrollDown,
    MouseScrollLeft,
    MouseScrollRight,
    MouseScrollUp,
    MouseUp,
    Resize,
)
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from pipetrace.analyze.model import RankState
from pipetrace.tui.lanes import BUBBLE, CATEGORIES, MAIN, NONE, P2P, Cells, Lane
from pipetrace.tui.levels import level_segments
from pipetrace.tui.palette import BLANK_STYLE, BUBBLE_STYLE, CATEGORY_COLORS, category_style
from pipetrace.tui.session import Session
from pipetrace.tui.viewport import ViewState

_STATE_STYLE = {
    RankState.FINISHED: Style(bold=True),
    RankState.FAILED: Style(color="#ff5f5f", bold=True),
    RankState.SIGNALED: Style(color="#ff5f5f", bold=True),
    RankState.ABORTED: Style(color="#ffaf00", bold=True),
    RankState.STALLED: Style(color="#ffaf00", bold=True),
    RankState.ENDED: Style(color="#ffaf00", bold=True),
    RankState.MISSING: Style(color="#6a6a6a"),
    RankState.NOT_LOADED: Style(color="#6a6a6a"),
}
_GUTTER = Style(color="#9a9a9a")
_GUTTER_CURSOR = Style(color="#000000", bgcolor="#d0d0d0", bold=True)
_WHEEL_ZOOM = 1.25


class TimelineView(ScrollView, can_focus=True):
    DEFAULT_CSS = """
    TimelineView {
        height: 1fr;
        min-height: 3;
        overflow-x: hidden;
        overflow-y: auto;
        scrollbar-size-vertical: 1;
        background: $surface;
    }
    TimelineView:focus {
        background-tint: $foreground 3%;
    }
    """

    BINDINGS = [
        Binding("left,h", "app.step(-1)", "prev step", show=False),
        Binding("right,l", "app.step(1)", "next step", show=False),
        Binding("up,k", "app.lane(-1)", "lane up", show=False),
        Binding("down,j", "app.lane(1)", "lane down", show=False),
        Binding("shift+left,comma", "app.pan(-0.25)", "pan left", show=False),
        Binding("shift+right,full_stop", "app.pan(0.25)", "pan right", show=False),
        Binding("plus,equals_sign", "app.zoom(2)", "zoom in", show=False),
        Binding("minus,underscore", "app.zoom(0.5)", "zoom out", show=False),
        Binding("enter", "app.zoom_to_cursor", "zoom to step", show=False),
        Binding("home", "app.edge(-1)", "first step", show=False),
        Binding("end", "app.edge(1)", "last step", show=False),
        Binding("pageup", "app.page(-1)", "page up", show=False),
        Binding("pagedown", "app.page(1)", "page down", show=False),
    ]

    class Clicked(Message):
        def __init__(self, lane_id: int, item: int | None) -> None:
            super().__init__()
            self.lane_id, self.item = lane_id, item

    class Zoom(Message):
        def __init__(self, factor: float, column: float) -> None:
            super().__init__()
            self.factor, self.column = factor, column

    class Pan(Message):
        def __init__(self, columns: float) -> None:
            super().__init__()
            self.columns = columns

    class Resized(Message):
        def __init__(self, columns: int) -> None:
            super().__init__()
            self.columns = columns

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.session: Session | None = None
        self.state: ViewState | None = None
        self._cache: dict[tuple, Strip] = {}
        self._labels: dict[tuple[int, int], tuple[str, str]] = {}
        self._parities: dict[int, np.ndarray] = {}
        self._drag_x: float | None = None
        self._dragged = False

    # -- binding ---------------------------------------------------------------------------

    def bind(self, session: Session, state: ViewState) -> None:
        self.session, self.state = session, state
        self.sync()

    def sync(self) -> None:
        """Call after the lane list changed (toggles, rank filter)."""
        if self.state is not None:
            self.virtual_size = Size(self.size.width, len(self.state.lane_ids))
        self._cache.clear()
        self.refresh()

    @property
    def gutter_width(self) -> int:
        if self.session is None:
            return 9
        return len(str(self.session.run.world_size - 1)) + 7

    @property
    def time_columns(self) -> int:
        return max(self.scrollable_content_region.width - self.gutter_width, 1)

    def on_resize(self, event: Resize) -> None:
        self._cache.clear()
        if self.state is not None:
            self.virtual_size = Size(event.size.width, len(self.state.lane_ids))
        self.post_message(self.Resized(self.time_columns))

    def scroll_to_lane(self, position: int) -> None:
        """Scroll vertically so that the lane at this position in the lane list is visible."""
        top = int(self.scroll_offset.y)
        height = self.scrollable_content_region.height
        if position < top:
            self.scroll_to(y=position, animate=False)
        elif position >= top + height:
            self.scroll_to(y=position - height + 1, animate=False)

    # -- drawing ---------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        state, session = self.state, self.session
        position = y + int(self.scroll_offset.y)
        if state is None or session is None or position >= len(state.lane_ids):
            return Strip.blank(width)
        lane_id = state.lane_ids[position]
        vp = state.viewport
        cursor = state.cursor if state.cursor is not None and state.cursor[0] == lane_id else None
        key = (lane_id, vp.start, vp.span, width, state.version, cursor)
        strip = self._cache.get(key)
        if strip is None:
            if len(self._cache) > 4 * max(len(state.lane_ids), 16):
                self._cache.clear()
            strip = self._cache[key] = self._draw(lane_id, width, cursor is not None)
        return strip

    def _draw(self, lane_id: int, width: int, has_cursor: bool) -> Strip:
        session, state = self.session, self.state
        assert session is not None and state is not None
        lane = session.index.lanes[lane_id]
        gutter = self._gutter(lane, has_cursor)
        columns = max(width - self.gutter_width, 0)
        vp = state.viewport
        dt = vp.span / max(vp.columns, 1)
        if columns <= 0:
            return Strip(gutter)
        if not len(lane.cat):  # a rank whose log holds no step or op: nothing to look up
            return Strip([*gutter, Segment(" " * columns, BLANK_STYLE)])
        if lane.levels is not None:
            cursor = state.cursor[1] if has_cursor and state.cursor is not None else None
            return Strip([*gutter, *level_segments(lane, vp.start, dt, columns, cursor)], width)
        paint = _Paint.of(lane, lane.columns(vp.start, dt, columns), self._parity(lane))
        # items drawn whatever the zoom: open spans, the finding's steps, the cursor
        specials: list[tuple[int, int]] = [(int(i), _OPEN) for i in np.flatnonzero(lane.open)]
        specials += [(i, _HIGHLIGHT) for i in state.highlighted_in(lane_id)]
        if has_cursor and state.cursor is not None:
            specials.append((state.cursor[1], _CURSOR))
        for i, flag in specials:
            span = lane.columns_of(i, vp.start, dt, columns)
            if span is not None:
                paint.take(i, flag, *span)
        self._put_labels(lane_id, lane, paint)
        return Strip([*gutter, *paint.segments()], width)

    def _put_labels(self, lane_id: int, lane: Lane, paint: _Paint) -> None:
        """A label at the start of each run of columns showing one item, where that item is
        what the column shows most of, if the label fits."""
        owner, columns = paint.owner, len(paint.owner)
        text = paint.chars.tolist()
        shows_owner = (
            (paint.mode <= _HALF) & (owner >= 0) & (paint.a == lane.cat[np.maximum(owner, 0)])
        )
        cuts = np.flatnonzero(owner[1:] != owner[:-1]) + 1
        starts, ends = np.r_[0, cuts], np.r_[cuts, columns]
        shown_at = np.flatnonzero(shows_owner)
        k = np.searchsorted(shown_at, starts)
        firsts = (
            np.where(k < len(shown_at), shown_at[np.minimum(k, max(len(shown_at) - 1, 0))], columns)
            if len(shown_at)
            else np.full(len(starts), columns)
        )
        room = ends - firsts
        for i, first, r in zip(
            owner[starts][room >= 2].tolist(), firsts[room >= 2].tolist(), room[room >= 2].tolist()
        ):
            self._put_label(lane_id, lane, i, first, r, text)
        paint.relabel(np.array(text, dtype="<U1"))

    def _parity(self, lane: Lane) -> np.ndarray:
        """Per item, its micro-batch's parity: every other micro-batch is drawn a shade darker."""
        parity = self._parities.get(id(lane))
        if parity is None or len(parity) != len(lane):
            mb = self.session.run.catalog.microbatch  # type: ignore[union-attr]
            parity = np.where(lane.code >= 0, mb[np.maximum(lane.code, 0)], 0) & 1
            self._parities[id(lane)] = parity
        return parity

    def _gutter(self, lane: Lane, has_cursor: bool) -> list[Segment]:
        session = self.session
        assert session is not None
        width = self.gutter_width
        digits = len(str(session.run.world_size - 1))
        name = lane.name[:4]
        if lane.role == MAIN:
            rank_text = f"r{lane.rank:<{digits}}"
            state = session.run.ranks[lane.rank].status.state
            rank_style = _STATE_STYLE.get(state, Style())
        else:
            rank_text, rank_style = " " * (digits + 1), _GUTTER
        rest = f" {name}".ljust(width - len(rank_text) - 1) + " "
        if has_cursor:
            return [Segment(rank_text + rest, _GUTTER_CURSOR)]
        return [Segment(rank_text, rank_style), Segment(rest, _GUTTER)]

    def _put_label(
        self, lane_id: int, lane: Lane, i: int, c0: int, room: int, chars: list[str]
    ) -> None:
        if room <= 0 or c0 >= len(chars):
            return
        full, short = self._label(lane_id, lane, i)
        # leave a column of the block after the label, so neighbours' labels never run together
        text = full if len(full) < room else short if len(short) < room else ""
        for k, ch in enumerate(text):
            if c0 + k < len(chars):
                chars[c0 + k] = ch

    def _label(self, lane_id: int, lane: Lane, i: int) -> tuple[str, str]:
        key = (lane_id, i)
        found = self._labels.get(key)
        if found is None:
            found = self._labels[key] = item_label(self.session, lane, i)  # type: ignore[arg-type]
            if len(self._labels) > 100_000:
                self._labels.clear()
        return found

    # -- mouse -----------------------------------------------------------------------------

    def _lane_and_column(self, x: float, y: float) -> tuple[int | None, float]:
        state = self.state
        if state is None:
            return None, 0.0
        position = int(y) + int(self.scroll_offset.y)
        lane_id = state.lane_ids[position] if 0 <= position < len(state.lane_ids) else None
        return lane_id, x - self.gutter_width

    def on_click(self, event: Click) -> None:
        if self._dragged or self.state is None or self.session is None:
            return
        lane_id, column = self._lane_and_column(event.x, event.y)
        if lane_id is None:
            return
        vp = self.state.viewport
        t = vp.time_at(max(column, 0) + 0.5)
        item = self.session.index.lanes[lane_id].item_at(t, tolerance=vp.ns_per_column)
        self.post_message(self.Clicked(lane_id, item))

    def on_mouse_down(self, event: MouseDown) -> None:
        if event.x >= self.gutter_width:
            self._drag_x, self._dragged = event.x, False
            self.capture_mouse()

    def on_mouse_move(self, event: MouseMove) -> None:
        if self._drag_x is not None and event.button:
            dx = event.x - self._drag_x
            if abs(dx) >= 1:
                self._dragged = True
                self._drag_x = event.x
                self.post_message(self.Pan(-dx))

    def on_mouse_up(self, event: MouseUp) -> None:
        self._drag_x = None
        self.release_mouse()

    def _on_mouse_scroll_up(self, event: MouseScrollUp) -> None:
        self._wheel(event, up=True)

    def _on_mouse_scroll_down(self, event: MouseScrollDown) -> None:
        self._wheel(event, up=False)

    def _wheel(self, event, *, up: bool) -> None:
        event.stop()
        event.prevent_default()
        if event.shift or event.ctrl:
            self.scroll_relative(y=-3 if up else 3, animate=False)
            return
        self.post_message(
            self.Zoom(_WHEEL_ZOOM if up else 1 / _WHEEL_ZOOM, max(event.x - self.gutter_width, 0))
        )

    def _on_mouse_scroll_left(self, event: MouseScrollLeft) -> None:
        event.stop()
        event.prevent_default()
        self.post_message(self.Pan(-4))

    def _on_mouse_scroll_right(self, event: MouseScrollRight) -> None:
        event.stop()
        event.prevent_default()
        self.post_message(self.Pan(4))


_CAT, _HALF, _BUBBLE, _BLANK = 0, 1, 2, 3  # column modes, in this order (>= _BUBBLE: empty)
_IDLE = 99  # a half block's second colour when it is idle time
_HIGHLIGHT, _OPEN, _CURSOR = 1, 2, 4  # flag bits
_STYLES: dict[int, Style] = {}


def _style_of(code: int) -> Style:
    """The rich Style of a column style code (see `TimelineView._draw`), cached."""
    style = _STYLES.get(code)
    if style is None:
        flags, rest = code % 8, code // 8
        mode, a, b = rest // 10_000, (rest // 100) % 100, rest % 100
        cursor = bool(flags & _CURSOR)
        if mode == _HALF:
            fg = CATEGORY_COLORS[CATEGORIES[a]][0]
            bg = CATEGORY_COLORS[CATEGORIES[b]][0] if b != _IDLE else None
            style = Style(color=fg, bgcolor=bg, reverse=cursor)
        elif mode == _BUBBLE:
            style = BUBBLE_STYLE + Style(reverse=True) if cursor else BUBBLE_STYLE
        elif mode == _BLANK:
            style = Style(reverse=True) if cursor else BLANK_STYLE
        else:
            style = category_style(
                a,
                b,
                highlight=bool(flags & _HIGHLIGHT),
                cursor=cursor,
                open_span=bool(flags & _OPEN),
            )
        _STYLES[code] = style
    return style


def item_label(session: Session, lane: Lane, i: int) -> tuple[str, str]:
    """(label, short label) of an item: ``F3`` / ``3``, ``sF3``, ``F7+B3``; P2P ops: ``F3→2``.
    On a rank that holds several stages (interleaved, V schedules) compute steps keep their
    stage: ``3F0``."""
    code = int(lane.code[i])
    catalog = session.run.catalog
    step = catalog.step(code) if code >= 0 else None
    if step is None:
        return ("?", "")
    stage = (
        f"{step.stage}"
        if step.stage is not None and len(session.run.ranks[lane.rank].stages) > 1
        else ""
    )
    if step.sub_steps:
        parts = [f"{s.kind.value}{s.microbatch}" for s in step.sub_steps]
        if len(session.run.ranks[lane.rank].stages) > 1:
            parts = [f"{s.stage}{p}" for s, p in zip(step.sub_steps, parts)]
        return ("+".join(parts), parts[0])
    kind = step.kind.value
    mb = "" if step.microbatch is None else str(step.microbatch)
    if lane.source == P2P:
        p2p = session.run.ranks[lane.rank].p2p
        row = int(lane.rows[i])
        arrow = "→" if p2p.op[row] == 0 else "←"
        return (f"{kind[-1]}{mb}{arrow}{int(p2p.peer[row])}", mb)
    if kind.startswith(("SEND", "RECV")):
        return (f"{kind[0].lower()}{kind[-1]}{mb}", mb)
    if step.microbatch is None:
        return (kind[:5].lower(), "")
    return (f"{stage}{kind}{mb}", mb)


@dataclass
class _Paint:
    """Every column of one lane's line: a style code (mode: category, half block, bubble,
    blank; two numbers: category and shade, or the half block's two colours; flag bits), its
    character, and the item it shows (-1: none, or zoomed out)."""

    mode: np.ndarray
    a: np.ndarray
    b: np.ndarray
    chars: np.ndarray
    owner: np.ndarray
    flags: np.ndarray
    item_cat: np.ndarray  # per item of the lane: its category
    mb_parity: np.ndarray  # per item of the lane: its micro-batch's parity (the shade)

    @classmethod
    def of(cls, lane: Lane, cells: Cells, mb_parity: np.ndarray) -> _Paint:
        cat, second = cells.cat.astype(np.int64), cells.second.astype(np.int64)
        owner = cells.item.copy()
        columns = len(cat)
        mode = np.full(columns, _BLANK, np.int64)
        a = np.where(cat >= 0, cat, 0)
        b = np.where(
            (owner >= 0) & (lane.cat[np.maximum(owner, 0)] == cat),
            mb_parity[np.maximum(owner, 0)],
            0,
        )
        mode[cat >= 0] = _CAT
        mode[cat == BUBBLE] = _BUBBLE
        mixed = (second != NONE) & ((cat >= 0) | (second >= 0))
        mode[mixed] = _HALF
        a = np.where(mixed, np.where(cat >= 0, cat, second), a)
        b = np.where(mixed, np.where((cat >= 0) & (second >= 0), second, _IDLE), b)
        chars = np.full(columns, " ", dtype="<U1")
        chars[mode == _BUBBLE] = "·"
        chars[mixed & (cat >= 0)] = "▌"
        chars[mixed & (cat < 0)] = "▐"
        flags = np.zeros(columns, np.int64)
        return cls(mode, a, b, chars, owner, flags, lane.cat, mb_parity)

    def take(self, i: int, flag: int, c0: int, c1: int) -> None:
        """Item ``i`` (columns ``c0:c1`` at this zoom) is drawn whatever the zoom, with ``flag``."""
        mode, owner = self.mode, self.owner
        own = np.flatnonzero((owner[c0:c1] == i) | (mode[c0:c1] >= _BUBBLE)) + c0
        if not len(own):
            own = np.array([c0])
        retake = own[(owner[own] != i) | (mode[own] == _HALF)]
        mode[retake], self.a[retake], self.b[retake], self.chars[retake] = (
            _CAT,
            int(self.item_cat[i]),
            int(self.mb_parity[i]),
            " ",
        )
        owner[own] = i
        self.flags[own] |= flag

    def relabel(self, chars: np.ndarray) -> None:
        """The characters after the labels were written: a half block a label took is drawn
        as its item's category."""
        chars[((self.flags & _OPEN) > 0) & (chars == " ")] = "╌"
        relabelled = (self.mode == _HALF) & (chars != "▌") & (chars != "▐")
        self.mode[relabelled] = _CAT
        owner = self.owner[relabelled]
        self.b[relabelled] = np.where(owner >= 0, self.mb_parity[np.maximum(owner, 0)], 0)
        self.chars = chars

    def segments(self) -> list[Segment]:
        code = ((self.mode * 100 + self.a) * 100 + self.b) * 8 + self.flags
        cuts = np.flatnonzero(code[1:] != code[:-1]) + 1
        return [
            Segment("".join(self.chars[start:end].tolist()), _style_of(int(code[start])))
            for start, end in zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(code)].tolist())
        ]
