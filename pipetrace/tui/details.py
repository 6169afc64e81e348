"""The details panel: everything about the selected step or P2P op (from `describe`)."""

from __future__ import annotations

import textwrap

from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from pipetrace.tui.describe import Description

_HINT = "Select a step: arrows or click. m jumps to the matching op on the peer rank, b jumps back."
_LABEL = "#9a9a9a"


class DetailsPanel(VerticalScroll, can_focus=False):
    DEFAULT_CSS = """
    DetailsPanel {
        height: 1fr;
        padding: 0 1;
        scrollbar-size-vertical: 1;
    }
    DetailsPanel > Static {
        width: 1fr;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._shown: Description | None = None

    def compose(self):
        yield Static(Text(_HINT, style="dim"), id="details-body")

    def on_resize(self) -> None:
        # the layout depends on the width, and the panel may have been filled while hidden
        self.show(self._shown)

    def show(self, description: Description | None) -> None:
        self._shown = description
        body = self.query_one("#details-body", Static)
        if description is None:
            body.update(Text(_HINT, style="dim"))
            return
        # laid out by hand (label/value pairs in columns, values wrapped): a rich Table costs
        # ~10x more to measure and draw, and this is redrawn on every cursor move
        width = max((self.size.width or self.app.size.width) - 3, 40)
        text = Text()
        text.append(description.title[:width], style="bold")
        text.append("\n")
        text.append_text(layout_pairs(description.rows, width))
        for note in description.notes:
            if note:
                style = "bold #ffaf00" if note.startswith(("error", "warning")) else "dim"
                text.append("\n")
                text.append(note, style=style)
        body.update(text)


def layout_pairs(rows: list[tuple[str, str]], width: int) -> Text:
    """(label, value) rows in as many columns as fit (up to 3), values wrapped in their column."""
    label_width = max((len(label) for label, _ in rows), default=0) + 1
    pairs = 3 if width >= 120 else 2 if width >= 70 else 1
    column = width // pairs
    value_width = max(column - label_width - 1, 10)
    out = Text(no_wrap=True, overflow="crop")
    for k in range(0, len(rows), pairs):
        cells = [
            (label, textwrap.wrap(value, value_width) or [""])
            for label, value in rows[k : k + pairs]
        ]
        height = max(len(lines) for _, lines in cells)
        for line in range(height):
            if k or line:
                out.append("\n")
            for n, (label, lines) in enumerate(cells):
                out.append((label if line == 0 else "").ljust(label_width), style=_LABEL)
                value = lines[line] if line < len(lines) else ""
                out.append(value.ljust(value_width + 1) if n < len(cells) - 1 else value)
    return out
