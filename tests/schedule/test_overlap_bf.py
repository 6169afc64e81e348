"""OVERLAP_B_F: a backward paired with the next forward, as an option of 1F1B and interleaved
1F1B; its text form, the verifier and the simulator on it, and the commands that take it."""

from __future__ import annotations

import pytest

from pipetrace.cli import main
from pipetrace.errors import PipetraceError
from pipetrace.runtime.config import RunConfig
from pipetrace.schedule.builders import OVERLAP_BF_SCHEDULES, SCHEDULE_NAMES, build_plan
from pipetrace.schedule.ir import Plan, ScheduleError, StepKind, format_step, parse_step
from pipetrace.schedule.simulate import Costs, simulate
from pipetrace.schedule.verify import SEMANTICS, verify

V = {"interleaved-1f1b": 2}


def test_the_action_string_round_trips_and_is_checked() -> None:
    step = parse_step("(0B3;0F7)OVERLAP_B_F")
    assert step.kind is StepKind.OVERLAP_B_F
    assert [format_step(s) for s in step.sub_steps] == ["0B3", "0F7"]
    assert format_step(step) == "(0B3;0F7)OVERLAP_B_F"
    for bad in ("(0F7;0B3)OVERLAP_B_F", "(0I3;0F7)OVERLAP_B_F", "(0B3;0F7;0F8)OVERLAP_B_F"):
        with pytest.raises(ScheduleError, match="OVERLAP_B_F holds"):
            parse_step(bad)


def leaves(plan: Plan, rank: int) -> list[str]:
    return [format_step(leaf) for s in plan.ranks[rank] if s is not None for leaf in s.leaves()]


@pytest.mark.parametrize("name", OVERLAP_BF_SCHEDULES)
@pytest.mark.parametrize(("ranks", "mbs"), [(1, 3), (2, 2), (2, 6), (4, 4), (4, 8), (3, 9)])
def test_paired_plans_keep_the_order_and_verify_clean(name: str, ranks: int, mbs: int) -> None:
    kwargs = {"num_ranks": ranks, "num_microbatches": mbs, "stages_per_rank": V.get(name)}
    paired = build_plan(name, **kwargs, overlap_bf=True)  # type: ignore[arg-type]
    plain = build_plan(name, **kwargs)  # type: ignore[arg-type]
    composites = [s for row in paired.ranks for s in row if s is not None and s.sub_steps]
    assert composites and all(s.kind is StepKind.OVERLAP_B_F for s in composites)
    assert all([sub.kind for sub in s.sub_steps] == [StepKind.B, StepKind.F] for s in composites)
    for rank in range(ranks):
        assert leaves(paired, rank) == leaves(plain, rank)  # regrouped, not reordered
    lowered = build_plan(name, **kwargs, comms=True, overlap_bf=True)  # type: ignore[arg-type]
    assert paired.params["overlap_bf"] is True
    for semantics in SEMANTICS:
        assert verify(paired, semantics=semantics).findings == []
        assert verify(lowered, semantics=semantics).findings == []


def test_a_pair_takes_the_longer_of_its_parts_in_the_simulator() -> None:
    paired = build_plan("1f1b", num_ranks=1, num_microbatches=4, overlap_bf=True)
    assert [format_step(s) for s in paired.ranks[0]] == [
        "0F0",
        "(0B0;0F1)OVERLAP_B_F",
        "(0B1;0F2)OVERLAP_B_F",
        "(0B2;0F3)OVERLAP_B_F",
        "0B3",
    ]
    result = simulate(paired, Costs(F=1, B=2))
    assert result.makespan == 1 + 3 * 2 + 2
    assert result.per_rank[0].peak_inflight_activations == 2  # a pair's forward counts first


@pytest.mark.parametrize("name", sorted(set(SCHEDULE_NAMES) - set(OVERLAP_BF_SCHEDULES)))
def test_other_schedules_refuse_the_option(name: str) -> None:
    with pytest.raises(ScheduleError, match="option of 1f1b and interleaved-1f1b"):
        build_plan(name, num_ranks=2, num_microbatches=4, overlap_bf=True)


def test_the_commands_take_the_option(capsys) -> None:
    assert main(["schedule", "show", "1f1b", "-p", "2", "-m", "4", "--overlap-bf"]) == 0
    assert "(1B0;1F1)OVERLAP_B_F" in capsys.readouterr().out
    assert main(["schedule", "verify", "gpipe", "-p", "2", "-m", "4", "--overlap-bf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipetrace: error: overlap_bf") and err.count("\n") == 1
    with pytest.raises(PipetraceError, match="not of zbv"):
        RunConfig("zbv", overlap_bf=True).plan()
    plan = RunConfig("interleaved-1f1b", ranks=2, microbatches=4, overlap_bf=True).plan()
    assert any(s.kind is StepKind.OVERLAP_B_F for row in plan.ranks for s in row)
