"""A plan as a step x rank grid: one column per rank, one row per position.

Row ``i`` shows ``plan.ranks[r][i]`` for every rank ``r``, bubbles (``None``) as ``.`` and
nothing past the end of a rank's list. Marks are keyed by ``(rank, position)`` with the same
convention (an index into ``plan.ranks[rank]`` as stored, bubbles included), which is what
the verifier's ``StepRef.position`` and ``VerifyReport.marks()`` use. A marked cell is
bracketed and its row ends with ``<-- rank R: LABEL``, so a hang is visible at a glance
(torch only draws ``<-- ERROR HERE`` for Python exceptions, never for a hang).
"""

from __future__ import annotations

from .ir import COLLECTIVE_KINDS, SWAP_KINDS, Plan, Step, StepKind, format_step

__all__ = ["render_grid"]

BUBBLE = "."
_RESET = "\x1b[0m"
_MARKED = "\x1b[1;31m"
_COLORS = {
    StepKind.F: "\x1b[32m",
    StepKind.B: "\x1b[36m",
    StepKind.I: "\x1b[34m",
    StepKind.W: "\x1b[35m",
    StepKind.SEND_F: "\x1b[33m",
    StepKind.SEND_B: "\x1b[33m",
    StepKind.RECV_F: "\x1b[2;33m",
    StepKind.RECV_B: "\x1b[2;33m",
    StepKind.OVERLAP_F_B: "\x1b[1m",
    StepKind.OVERLAP_B_F: "\x1b[1m",
    **{kind: "\x1b[2m" for kind in COLLECTIVE_KINDS},
    **{kind: "\x1b[2;36m" for kind in SWAP_KINDS},
}


def render_grid(
    plan: Plan,
    *,
    marks: dict[tuple[int, int], str] | None = None,
    color: bool = False,
    max_columns: int | None = None,
    context: int | None = None,
) -> str:
    """Render the plan as text; ANSI colours by step kind only when ``color``.

    ``max_columns`` caps the rank columns: marked ranks are always shown, the rest are
    filled from rank 0 up, and a footer names how many were left out. ``context`` keeps
    only the rows within that many positions of a marked row (``...`` marks a gap).
    """
    marks = marks or {}
    ranks = _shown_ranks(plan.num_ranks, marks, max_columns)
    rows = _shown_rows(max((len(r) for r in plan.ranks), default=0), marks, context)
    cells = {
        (rank, pos): _cell_text(plan.ranks[rank], pos, (rank, pos) in marks)
        for rank in ranks
        for pos in rows
        if pos is not None
    }
    label_width = max(len("step"), len(str(max((r for r in rows if r is not None), default=0))))
    widths = {
        rank: max([len(f"rank {rank}")] + [len(cells[(rank, p)]) for p in rows if p is not None])
        for rank in ranks
    }
    lines = [
        "  ".join(
            ["step".rjust(label_width)] + [f"rank {r}".ljust(widths[r]) for r in ranks]
        ).rstrip()
    ]
    for pos in rows:
        if pos is None:
            lines.append("...".rjust(label_width))
            continue
        parts = [str(pos).rjust(label_width)]
        for rank in ranks:
            text = cells[(rank, pos)].ljust(widths[rank])
            parts.append(
                _paint(text, plan.ranks[rank], pos, (rank, pos) in marks) if color else text
            )
        line = "  ".join(parts)
        notes = [f"rank {rank}: {marks[(rank, pos)]}" for rank in ranks if (rank, pos) in marks]
        if notes:  # arrows start past the last column, so they line up
            arrow = "  <-- " + "; ".join(notes)
            line += f"{_MARKED}{arrow}{_RESET}" if color else arrow
        lines.append(line if notes else line.rstrip())
    hidden = plan.num_ranks - len(ranks)
    if hidden:
        lines.append(f"({hidden} more rank{'s' if hidden != 1 else ''} not shown)")
    return "\n".join(lines) + "\n"


def _shown_ranks(
    num_ranks: int, marks: dict[tuple[int, int], str], max_columns: int | None
) -> list[int]:
    if max_columns is None or max_columns >= num_ranks:
        return list(range(num_ranks))
    chosen = sorted({rank for rank, _ in marks if 0 <= rank < num_ranks})[: max(max_columns, 1)]
    for rank in range(num_ranks):
        if len(chosen) >= max(max_columns, 1):
            break
        if rank not in chosen:
            chosen.append(rank)
    return sorted(chosen)


def _shown_rows(
    num_rows: int, marks: dict[tuple[int, int], str], context: int | None
) -> list[int | None]:
    """Row positions to draw, with None where rows were skipped."""
    if context is None or not marks:
        return list(range(num_rows))
    keep = sorted(
        {
            p
            for _, marked in marks
            for p in range(marked - context, marked + context + 1)
            if 0 <= p < num_rows
        }
    )
    rows: list[int | None] = []
    for pos in keep:
        if (rows and rows[-1] is not None and pos != rows[-1] + 1) or (not rows and pos > 0):
            rows.append(None)
        rows.append(pos)
    if keep and keep[-1] < num_rows - 1:
        rows.append(None)
    return rows


def _cell_text(row: list[Step | None], pos: int, marked: bool) -> str:
    if pos >= len(row):
        return ""
    text = BUBBLE if row[pos] is None else format_step(row[pos])
    return f"[{text}]" if marked else text


def _paint(text: str, row: list[Step | None], pos: int, marked: bool) -> str:
    """Colour a padded cell; padding stays outside the escape codes' visible effect."""
    if marked:
        code = _MARKED
    elif pos >= len(row):
        return text
    elif row[pos] is None:
        code = "\x1b[2m"
    else:
        code = _COLORS.get(row[pos].kind, "")
    stripped = text.rstrip()
    return f"{code}{stripped}{_RESET}{text[len(stripped) :]}" if code else text
