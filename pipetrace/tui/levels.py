"""Drawing a memory lane: each column shows, as a block character from ▁ to █, the bytes the
rank held at the middle of the column (the sample in effect then), scaled to the rank's own
peak, so a schedule's ramp (GPipe's climb to M micro-batches, 1F1B's plateau at P) reads at
a glance. The peak sample's columns are marked; the cursor's sample is drawn reversed."""

from __future__ import annotations

import numpy as np
from rich.segment import Segment
from rich.style import Style

from pipetrace.tui.lanes import Lane

BLOCKS = np.array(list(" ▁▂▃▄▅▆▇█"))
LEVEL_STYLE = Style(color="#c678dd")
PEAK_STYLE = Style(color="#ff79c6", bold=True)
CURSOR_STYLE = Style(color="#000000", bgcolor="#c678dd")


def level_segments(
    lane: Lane, t0: float, dt: float, columns: int, cursor: int | None
) -> list[Segment]:
    """``columns`` cells of the lane from time ``t0``, ``dt`` ns each."""
    levels = lane.levels if lane.levels is not None else np.zeros(len(lane), np.int64)
    middle = t0 + (np.arange(columns) + 0.5) * dt
    item = np.searchsorted(lane.begin, middle, side="right") - 1
    valid = (item >= 0) & (middle < lane.end[np.maximum(item, 0)])
    item = np.where(valid, item, -1)
    peak = int(levels.max()) if len(levels) else 0
    value = np.where(valid, levels[np.maximum(item, 0)], 0)
    index = np.where(value > 0, np.ceil(value * 8 / max(peak, 1)), 0).astype(np.int64)
    chars = BLOCKS[np.clip(index, 0, 8)]
    style = np.zeros(columns, np.int8)  # 0 level, 1 peak, 2 cursor
    style[valid & (value == peak) & (peak > 0)] = 1
    if cursor is not None:
        style[item == cursor] = 2
    styles = (LEVEL_STYLE, PEAK_STYLE, CURSOR_STYLE)
    cuts = np.flatnonzero(style[1:] != style[:-1]) + 1
    return [
        Segment("".join(chars[a:b].tolist()), styles[int(style[a])])
        for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, columns].tolist())
    ]
