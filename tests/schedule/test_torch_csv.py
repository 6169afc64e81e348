"""torch.distributed.pipelining's own multi-stage plans, through its CSV files, verify clean.

torch builds a schedule's ``pipeline_order`` (compute only) in the constructor and lowers it
with ``_add_send_recv`` (plus FSDP steps) into ``pipeline_order_with_comms``; both need only
the stages' sizes and ranks, so stub stage objects stand in for real ones (no process group).
``_dump_csv(path, format=...)`` writes either form.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from pipetrace.schedule.csvio import load_csv
from pipetrace.schedule.verify import verify

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

CLASS_NAMES = (
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
    "ScheduleLoopedBFS",
)
CLASSES = [getattr(schedules, name) for name in CLASS_NAMES if hasattr(schedules, name)]
SIZES = [(2, 4), (3, 6), (4, 8), (4, 12)]  # (P, M); DualPipeV needs M >= 2P stages


def torch_schedule(cls: type, num_ranks: int, num_microbatches: int) -> object:
    """A schedule object as rank 0 would build it, with two stub stages per rank."""
    stages = [
        SimpleNamespace(
            num_stages=2 * num_ranks,
            group_size=num_ranks,
            group_rank=0,
            stage_index=index,
            submod=None,
        )
        for index in range(2)
    ]
    return cls(stages, num_microbatches)


def test_torch_has_the_schedules_we_compare_with() -> None:
    assert len(CLASSES) >= 4, "torch lost its multi-stage schedules"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"P{s[0]}-M{s[1]}")
@pytest.mark.parametrize("form", ["compute_only", "compute_comms"])
def test_torch_plans_verify_clean_under_eager(
    cls: type, size: tuple[int, int], form: str, tmp_path: Path
) -> None:
    num_ranks, num_microbatches = size
    path = tmp_path / f"{cls.__name__}-{form}.csv"
    torch_schedule(cls, num_ranks, num_microbatches)._dump_csv(str(path), format=form)

    plan = load_csv(path, num_microbatches=num_microbatches)
    assert plan.num_ranks == num_ranks and plan.num_stages == 2 * num_ranks
    assert plan.has_comms() == (form == "compute_comms")
    report = verify(plan, semantics="eager")
    assert report.findings == [], [f.message for f in report.findings]
    assert report.blocked == {}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_torch_plan_with_one_receive_cut_is_caught(cls: type, tmp_path: Path) -> None:
    """The check above can fail: drop rank 1's first RECV cell from torch's own file."""
    path = tmp_path / "schedule.csv"
    torch_schedule(cls, 2, 4)._dump_csv(str(path), format="compute_comms")
    rows = path.read_text().splitlines()
    cells = rows[1].split(",")
    cells.remove(next(c for c in cells if "RECV" in c))
    rows[1] = ",".join(cells)
    path.write_text("\n".join(rows) + "\n")
    kinds = {f.kind for f in verify(load_csv(path, num_microbatches=4)).findings}
    assert "missing_recv" in kinds
