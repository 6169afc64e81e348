"""The stats panel: per-rank and per-stage metrics, bubble ratio against the ideal."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table as RichTable
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from pipetrace.tui.stats_data import Table


class StatsPanel(VerticalScroll):
    DEFAULT_CSS = """
    StatsPanel {
        height: 1fr;
        padding: 0 1;
        scrollbar-size-vertical: 1;
    }
    """

    def compose(self):
        yield Static("", id="stats-body")

    def show(self, tables: list[Table]) -> None:
        parts = []
        for table in tables:
            t = RichTable(
                title=table.title,
                title_justify="left",
                title_style="bold",
                box=None,
                padding=(0, 1),
                header_style="#9a9a9a",
            )
            for k, header in enumerate(table.headers):
                t.add_column(header, justify="left" if k == 0 else "right", no_wrap=True)
            for row in table.rows:
                t.add_row(*row)
            parts.append(t)
            parts.extend(Text(n, style="dim") for n in table.notes)
        self.query_one("#stats-body", Static).update(Group(*parts))
