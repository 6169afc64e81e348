"""The help screen: every key, the mouse, the colours and the filter syntax."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from pipetrace.tui.palette import CATEGORY_COLORS, LEGEND

KEYS: list[tuple[str, str]] = [
    ("← → / h l", "previous / next step on the lane"),
    ("↑ ↓ / k j", "lane above / below (the step nearest in time)"),
    ("+ / -", "zoom in / out around the cursor"),
    ("shift+← →  or  , .", "pan left / right by a quarter screen"),
    ("enter", "zoom to the selected step"),
    ("z", "zoom to fit the whole run"),
    ("[ / ]", "previous / next iteration"),
    ("g", "go to an iteration by number"),
    ("home / end", "first / last step on the lane"),
    ("pgup / pgdn", "scroll the lanes by a page"),
    ("m", "jump to the matching op on the peer rank (P2P ops and SEND/RECV steps)"),
    ("b / backspace", "jump back to where the last jump started"),
    ("n / N", "next / previous finding (moves the timeline, highlights its steps)"),
    ("d  f  s", "bottom panel: details / findings / stats"),
    ("tab", "move the focus between the timeline and the panel"),
    ("p", "plan vs actual: show the simulated plan under each rank"),
    ("c", "show / hide the P2P sub-rows"),
    ("/", "filter by rank, stage, micro-batch and kind"),
    ("escape", "clear the highlight, then the filter"),
    ("ctrl+p", "command palette"),
    ("?", "this help"),
    ("q", "quit"),
]
MOUSE: list[tuple[str, str]] = [
    ("click", "select the step under the pointer"),
    ("wheel", "zoom in / out at the pointer"),
    ("drag", "pan"),
    ("shift+wheel", "scroll the lanes up / down"),
]
FILTER_HELP = (
    "rank=0,2  stage=1-3  mb=0  kind=F,B,I,W,send,recv,comm,compute  "
    "(a rank filter hides ranks; the others dim the steps they do not match)"
)


class HelpScreen(ModalScreen[None]):
    AUTO_FOCUS = "VerticalScroll"
    DEFAULT_CSS = """
    HelpScreen {
        align: center middle;
    }
    HelpScreen > VerticalScroll {
        width: 90%;
        max-width: 100;
        height: 90%;
        border: round $accent;
        background: $surface;
        padding: 0 1;
        scrollbar-size-vertical: 1;
    }
    """
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]

    def compose(self):
        keys = Table.grid(padding=(0, 2))
        keys.add_column(style="bold", no_wrap=True)
        keys.add_column()
        for key, what in KEYS:
            keys.add_row(key, what)
        keys.add_row("", "")
        for key, what in MOUSE:
            keys.add_row(key, what)
        legend = Text()
        for name, word in LEGEND:
            legend.append("  ", style=f"on {CATEGORY_COLORS[name][0]}")
            legend.append(f" {word}   ")
        legend.append("·", style="#5a5a5a")
        legend.append(" bubble (idle in an iteration)   ")
        legend.append("╌╌", style=f"bold #ffffff on {CATEGORY_COLORS['recv'][0]}")
        legend.append(" never ended   ")
        legend.append("  ", style="on #ffd43b")
        legend.append(" finding's steps")
        with VerticalScroll():
            yield Static(Text("pipetrace tui: keys", style="bold"))
            yield Static(keys)
            yield Static(Text("\nColours", style="bold"))
            yield Static(legend)
            yield Static(
                Text(
                    "\nLanes: main (the rank's plan steps), "
                    "a thread's lane (e.g. the overlap thread), "
                    "plan (simulated, with p), "
                    "p2p (ops in flight: →peer for a send, ←peer for a recv). "
                    "Zoomed out, a cell shows the kind covering most of its time.\n"
                )
            )
            yield Static(Text.assemble(("Filter: ", "bold"), FILTER_HELP))
            yield Static(Text("\nescape, q or ? closes this screen", style="dim"))
