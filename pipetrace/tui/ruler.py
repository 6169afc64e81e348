"""The time ruler above the timeline: round ticks for the visible window."""

from __future__ import annotations

import math

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

from pipetrace import units
from pipetrace.tui.viewport import ViewState

_TICK = Style(color="#b0b0b0")
_SCALE = Style(color="#7a7a7a")


class TimeRuler(Widget):
    DEFAULT_CSS = """
    TimeRuler {
        height: 1;
        background: $panel;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.state: ViewState | None = None
        self.gutter_columns = 9

    def bind(self, state: ViewState, gutter: int) -> None:
        self.state, self.gutter_columns = state, gutter
        self.refresh()

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if self.state is None or y > 0:
            return Strip.blank(width)
        vp = self.state.viewport
        columns = max(width - self.gutter_columns, 0)
        scale = units.duration(vp.ns_per_column, 2).replace(" ", "") + "/c"
        head = scale[: self.gutter_columns - 1].ljust(self.gutter_columns)
        chars = [" "] * columns
        step = units.tick_step(vp.span, max(columns // 11, 1))
        first = math.ceil(vp.start / step) * step
        largest = max(abs(vp.start), abs(vp.end))
        t = first
        while t <= vp.end:
            c = int(round(vp.column_of(t)))
            label = "|" + units.tick_label(t, step, largest)
            if 0 <= c < columns and all(ch == " " for ch in chars[c : c + len(label) + 1]):
                for k, ch in enumerate(label):
                    if c + k < columns:
                        chars[c + k] = ch
            t += step
        return Strip([Segment(head, _SCALE), Segment("".join(chars), _TICK)], width)
