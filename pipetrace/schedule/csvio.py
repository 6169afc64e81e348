"""torch.distributed.pipelining's CSV schedule files: one row per rank, one action per cell.

An empty cell is a bubble. Both compute-only and compute+comms files use the same form.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from pipetrace.limits import check_plan_size

from .ir import Plan, ScheduleError, Step, format_step, infer_placement, parse_step

_MAX_CELL = 10_000
"""Characters in a cell: an action is a few dozen (a composite of three parts included)."""


def parse_csv_text(text: str, *, source: str = "<csv>") -> list[list[Step | None]]:
    """Parse CSV text into per-rank rows; errors name the row, column and cell text."""
    rows: list[list[Step | None]] = []
    reader = csv.reader(io.StringIO(text))
    try:
        for row_index, cells in enumerate(reader):
            rows.append(_parse_row(cells, row_index, source))
    except csv.Error as exc:  # e.g. a cell longer than the csv module's field limit
        raise ScheduleError(f"{source}: row {reader.line_num}: not CSV ({exc})") from None
    while rows and not rows[-1]:
        rows.pop()
    if not rows:
        raise ScheduleError(f"{source}: no schedule rows found")
    return rows


def _parse_row(cells: list[str], row_index: int, source: str) -> list[Step | None]:
    row: list[Step | None] = []
    for col_index, cell in enumerate(cells):
        try:
            if len(cell) > _MAX_CELL:  # refused here, whatever limit the csv module has now
                raise ScheduleError(f"a cell of {len(cell):,} characters is no action")
            row.append(parse_step(cell))
        except ScheduleError as exc:
            raise ScheduleError(
                f"{source}: row {row_index + 1} (rank {row_index}), column {col_index + 1}: {exc}"
            ) from None
    while row and row[-1] is None:  # trailing empty cells are padding, not bubbles
        row.pop()
    return row


def load_csv(path: str | Path, *, num_microbatches: int | None = None) -> Plan:
    """Load a schedule file; placement and micro-batch count are inferred when not given."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScheduleError(f"{path}: no such schedule file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScheduleError(f"{path}: cannot read schedule file ({exc})") from None
    rows = parse_csv_text(text, source=str(path))
    try:
        placement = infer_placement(rows)
    except ScheduleError as exc:
        raise ScheduleError(f"{path}: {exc}") from None
    if num_microbatches is None:
        mbs = [
            leaf.microbatch
            for row in rows
            for step in row
            if step is not None
            for leaf in step.leaves()
            if leaf.microbatch is not None
        ]
        num_microbatches = max(mbs) + 1 if mbs else 0
    check_plan_size(len(rows), num_microbatches, -(-len(placement) // len(rows)))
    plan = Plan(num_microbatches, placement, rows, name=path.name, params={"csv": str(path)})
    # A rank that holds no stage (an all-empty trailing row was dropped) still exists
    # when the placement names it.
    while plan.num_ranks <= max(placement):
        plan.ranks.append([])
    return plan


def plan_to_csv(plan: Plan) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in plan.ranks:
        writer.writerow([format_step(step) for step in row])
    return out.getvalue()
