"""The step x rank grid: layout, the position convention of marks, colour, and cropping."""

from __future__ import annotations

import re

from pipetrace.schedule.grid import render_grid
from pipetrace.schedule.ir import Plan, infer_placement, parse_step
from pipetrace.schedule.verify import verify


def plan_of(*rows: str, num_microbatches: int) -> Plan:
    ranks = [[None if cell == "." else parse_step(cell) for cell in row.split()] for row in rows]
    return Plan(num_microbatches, infer_placement(ranks), ranks)


def test_columns_are_ranks_rows_are_positions_and_bubbles_are_dots() -> None:
    grid = render_grid(plan_of("0F0 0F1 . 0B0 0B1", ". 1F0 1B0 1F1 1B1", num_microbatches=2))
    assert grid == (
        "step  rank 0  rank 1\n"
        "   0  0F0     .\n"
        "   1  0F1     1F0\n"
        "   2  .       1B0\n"
        "   3  0B0     1F1\n"
        "   4  0B1     1B1\n"
    )


def test_a_shorter_rank_leaves_its_cells_empty() -> None:
    grid = render_grid(plan_of("0F0 0B0", "1F0 1B0 1F1 1B1", num_microbatches=2))
    assert grid.splitlines()[3] == "   2          1F1"


def test_marks_count_bubbles_in_the_position() -> None:
    plan = plan_of(". . 0F0 0B0", num_microbatches=1)
    lines = render_grid(plan, marks={(0, 2): "BLOCKED"}).splitlines()
    assert lines[3] == "   2  [0F0]   <-- rank 0: BLOCKED"
    assert "<--" not in "".join(lines[:3] + lines[4:])


def test_verify_marks_land_on_the_blocked_steps() -> None:
    plan = plan_of(
        "0F0 0F1 0SEND_F0 . 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
        num_microbatches=2,
    )
    report = verify(plan, semantics="rendezvous")
    lines = render_grid(report.executed, marks=report.marks()).splitlines()
    assert lines[4].split() == [
        "3",
        ".",
        "[1SEND_B0]",
        "<--",
        "rank",
        "1:",
        "BLOCKED",
        "waiting",
        "for",
        "rank",
        "0",
    ]
    assert lines[5].startswith("   4  [0SEND_F1]")
    assert lines[5].endswith("<-- rank 0: BLOCKED waiting for rank 1")


def test_colour_only_when_asked_and_the_text_is_unchanged() -> None:
    plan = plan_of("0F0 0SEND_F0 0RECV_B0 0B0", ". 1RECV_F0 1F0 1B0 1SEND_B0", num_microbatches=1)
    marks = {(1, 2): "HERE"}
    plain = render_grid(plan, marks=marks)
    painted = render_grid(plan, marks=marks, color=True)
    assert "\x1b[" not in plain and "\x1b[" in painted
    assert re.sub(r"\x1b\[[0-9;]*m", "", painted) == plain


def test_max_columns_keeps_marked_ranks_and_says_what_it_left_out() -> None:
    plan = plan_of("0F0 0B0", "1F0 1B0", "2F0 2B0", "3F0 3B0", num_microbatches=1)
    grid = render_grid(plan, marks={(3, 1): "X"}, max_columns=2)
    assert grid.splitlines()[0].split() == ["step", "rank", "0", "rank", "3"]
    assert grid.endswith("(2 more ranks not shown)\n")


def test_context_crops_rows_around_marks() -> None:
    plan = plan_of(
        " ".join(f"0F{m}" for m in range(10)) + " " + " ".join(f"0B{m}" for m in range(10)),
        num_microbatches=10,
    )
    lines = render_grid(plan, marks={(0, 10): "X"}, context=1).splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["...", "9", "10", "11", "..."]
