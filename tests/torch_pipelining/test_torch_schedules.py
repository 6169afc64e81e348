"""Every torch.distributed.pipelining schedule class, recorded on real gloo ranks: the run
analyzes clean, the recorded steps follow the plan torch executes, and the steps of each
iteration fit inside it.

Each launch runs several schedule classes one after the other in one process group (a rank
costs ~2 s to start on these machines).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from tp_runs import analyze_json, errors, events, meta

from pipetrace.torch_pipelining.demo import TorchCase, run_torch_demo

pytestmark = pytest.mark.multiproc

TWO_RANKS = [
    ("ScheduleGPipe", 4),
    ("Schedule1F1B", 4),
    ("ScheduleInterleaved1F1B", 4),
    ("ScheduleLoopedBFS", 4),
    ("ScheduleInterleavedZeroBubble", 4),
    ("ScheduleZBVZeroBubble", 4),
    ("ScheduleDualPipeV", 4),
    ("csv", 4),
]
FOUR_RANKS = [
    ("Schedule1F1B", 4),
    ("ScheduleInterleaved1F1B", 4),
    ("ScheduleDualPipeV", 8),
]


@pytest.mark.parametrize(("ranks", "classes"), [(2, TWO_RANKS), (4, FOUR_RANKS)])
def test_every_schedule_class_records_a_clean_run(ranks, classes, tmp_path):
    cases = [
        TorchCase(schedule=name, run_dir=str(tmp_path / name), microbatches=m, stages_per_rank=2)
        for name, m in classes
    ]
    assert run_torch_demo(cases, ranks, timeout=150) == [0] * ranks
    for case in cases:
        run_dir = Path(case.run_dir)
        code, report = analyze_json(run_dir)
        assert code == 0 and not errors(report), (case.schedule, errors(report))
        plan, placement = meta(run_dir)["plan"], meta(run_dir)["placement"]
        assert len(plan) == ranks
        for rank in range(ranks):
            check_rank(run_dir, rank, [text for text in plan[rank] if text], case)
            losses = [e["loss"] for e in events(run_dir, rank) if e["e"] == "iter_end"]
            if rank == placement[-1]:  # the last stage's rank reports the mean loss
                assert all(isinstance(loss, float) and loss > 0 for loss in losses)
            else:
                assert losses == [None] * case.steps


def check_rank(run_dir: Path, rank: int, plan: list[str], case: TorchCase) -> None:
    """Every iteration runs the plan's steps in the plan's order (a composite's sub-steps
    share its position), every P2P op completes, and the top-level steps' durations add up
    to no more than the iteration."""
    log = events(run_dir, rank)
    assert log[-1]["e"] == "run_end"
    begins = {e["id"]: e for e in log if e["e"] == "step_begin"}
    ends = {e["id"]: e["t"] for e in log if e["e"] == "step_end"}
    assert set(begins) == set(ends), case.schedule
    executed: dict[int, list[tuple[int, str]]] = defaultdict(list)
    busy: dict[int, int] = defaultdict(int)
    for sid, begin in begins.items():
        if executed[begin["it"]] and executed[begin["it"]][-1][0] == begin["pos"]:
            continue  # a sub-step of the composite just recorded
        executed[begin["it"]].append((begin["pos"], begin["step"]))
        busy[begin["it"]] += ends[sid] - begin["t"]
    iterations = {e["it"]: e["t"] for e in log if e["e"] == "iter_begin"}
    finished = {e["it"]: e["t"] for e in log if e["e"] == "iter_end"}
    assert sorted(iterations) == sorted(finished) == list(range(case.steps))
    for it in iterations:
        assert executed[it] == list(enumerate(plan)), (case.schedule, rank, it)
        assert 0 < busy[it] <= finished[it] - iterations[it], (case.schedule, rank, it)
    posted = {e["id"] for e in log if e["e"] == "p2p_post"}
    done = {e["id"] for e in log if e["e"] == "p2p_done"}
    assert posted and posted == done, case.schedule


def test_eval_calls_and_forward_only_schedules_are_not_recorded(tmp_path):
    """``schedule.eval`` after every training step runs unrecorded: the log holds the
    training steps alone, each running its plan (an eval recorded would be an iteration of
    forwards only, and plan divergences). A schedule with no loss function is not recorded
    at all."""
    evaluated = [
        TorchCase(schedule=name, run_dir=str(tmp_path / name), stages_per_rank=2, evaluate=True)
        for name in ("Schedule1F1B", "ScheduleInterleaved1F1B")
    ]
    forward_only = TorchCase(
        schedule="Schedule1F1B", run_dir=str(tmp_path / "forward-only"), forward_only=True
    )
    assert run_torch_demo([*evaluated, forward_only], 2, timeout=120) == [0, 0]
    for case in evaluated:
        run_dir = Path(case.run_dir)
        code, report = analyze_json(run_dir)
        diverged = [f for f in report["findings"] if f["kind"] == "plan_divergence"]
        assert code == 0 and not errors(report) and not diverged, (case.schedule, report)
        plan = meta(run_dir)["plan"]
        for rank in range(2):
            check_rank(run_dir, rank, [text for text in plan[rank] if text], case)
    assert not Path(forward_only.run_dir).exists()
