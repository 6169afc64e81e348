"""Colours of the timeline (shared by the timeline, the ruler legend and the help screen)."""

from __future__ import annotations

from rich.style import Style

from pipetrace.tui.lanes import CATEGORIES

# background per category; the second shade marks every other micro-batch when zoomed in
CATEGORY_COLORS = {
    "F": ("#2f6fdd", "#2459b5"),
    "B": ("#2e9e4f", "#237a3d"),
    "I": ("#1f9d8f", "#177a70"),
    "W": ("#b08a16", "#8c6d10"),
    "send": ("#b23ab8", "#8e2e93"),
    "recv": ("#d2424f", "#a8343f"),
    "overlapped": ("#7b5ce0", "#6249b8"),
    "fsdp": ("#5f6f85", "#4c596b"),
    "other": ("#6b6b6b", "#555555"),
    "dimmed": ("#2b2b2b", "#262626"),
}
LEGEND = (
    ("F", "forward"),
    ("B", "backward"),
    ("I", "dx"),
    ("W", "dw"),
    ("send", "send wait"),
    ("recv", "recv wait"),
    ("overlapped", "F+B overlap"),
    ("fsdp", "FSDP"),
)

LABEL_FG = "#f0f0f0"
DIM_FG = "#6a6a6a"
BUBBLE_STYLE = Style(color="#5a5a5a")
BLANK_STYLE = Style()
HIGHLIGHT_BG = "#ffd43b"
OPEN_FG = "#ffffff"


def category_style(
    cat: int,
    shade: int = 0,
    *,
    highlight: bool = False,
    cursor: bool = False,
    open_span: bool = False,
) -> Style:
    name = CATEGORIES[cat]
    bg = HIGHLIGHT_BG if highlight else CATEGORY_COLORS[name][shade]
    fg = (
        "#000000"
        if highlight
        else (DIM_FG if name == "dimmed" else (OPEN_FG if open_span else LABEL_FG))
    )
    style = Style(color=fg, bgcolor=bg, bold=cursor or open_span)
    if cursor:
        style += Style(reverse=True)
    return style
