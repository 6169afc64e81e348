"""OVERLAP_B_F: a backward paired with the next forward, as an option of 1F1B and interleaved
1F1B, with the backward whole or split into I then W; its text form, the verifier and the
simulator on it, and the commands that take it."""

from __future__ import annotations

import pytest

from pipetrace.cli import main
from pipetrace.errors import PipetraceError
from pipetrace.runtime.config import RunConfig
from pipetrace.schedule.builders import OVERLAP_BF_SCHEDULES, SCHEDULE_NAMES, build_plan
from pipetrace.schedule.ir import B, Plan, ScheduleError, Step, StepKind, format_step, parse_step
from pipetrace.schedule.simulate import Costs, simulate
from pipetrace.schedule.verify import SEMANTICS, verify

V = {"interleaved-1f1b": 2}


def test_the_action_string_round_trips_and_is_checked() -> None:
    step = parse_step("(0B3;0F7)OVERLAP_B_F")
    assert step.kind is StepKind.OVERLAP_B_F
    assert [format_step(s) for s in step.sub_steps] == ["0B3", "0F7"]
    assert format_step(step) == "(0B3;0F7)OVERLAP_B_F"
    split = parse_step("(0I3;0W3;0F7)OVERLAP_B_F")
    assert [s.kind for s in split.sub_steps] == [StepKind.I, StepKind.W, StepKind.F]
    assert format_step(split) == "(0I3;0W3;0F7)OVERLAP_B_F"
    for bad in (
        "(0F7;0B3)OVERLAP_B_F",
        "(0I3;0F7)OVERLAP_B_F",
        "(0B3;0F7;0F8)OVERLAP_B_F",
        "(0W3;0I3;0F7)OVERLAP_B_F",  # W before its I
        "(0I3;0W2;0F7)OVERLAP_B_F",  # I and W of different micro-batches
        "(0I3;0W3)OVERLAP_B_F",
    ):
        with pytest.raises(ScheduleError, match="OVERLAP_B_F holds"):
            parse_step(bad)


def leaves(plan: Plan, rank: int, split: bool = False) -> list[str]:
    """A rank's compute leaves in order; with ``split``, a paired backward reads as I, W."""
    return [
        format_step(leaf)
        for s in plan.ranks[rank]
        if s is not None
        for leaf in (_whole(s.sub_steps) if split and s.sub_steps else s.leaves())
    ]


def _whole(parts: tuple[Step, ...]) -> list[Step]:
    """A split pair's leaves with its I and W as the one B they replace."""
    return [B(parts[0].stage, parts[0].microbatch), parts[-1]]  # type: ignore[arg-type]


SPLIT = {"overlap_bf": {"overlap_bf": True}, "split": {"overlap_bf_split": True}}


@pytest.mark.parametrize("option", SPLIT)
@pytest.mark.parametrize("name", OVERLAP_BF_SCHEDULES)
@pytest.mark.parametrize(("ranks", "mbs"), [(1, 3), (2, 2), (2, 6), (4, 4), (4, 8), (3, 9)])
def test_paired_plans_keep_the_order_and_verify_clean(
    name: str, ranks: int, mbs: int, option: str
) -> None:
    kwargs = {"num_ranks": ranks, "num_microbatches": mbs, "stages_per_rank": V.get(name)}
    paired = build_plan(name, **kwargs, **SPLIT[option])  # type: ignore[arg-type]
    plain = build_plan(name, **kwargs)  # type: ignore[arg-type]
    composites = [s for row in paired.ranks for s in row if s is not None and s.sub_steps]
    assert composites and all(s.kind is StepKind.OVERLAP_B_F for s in composites)
    parts = [StepKind.I, StepKind.W, StepKind.F] if option == "split" else [StepKind.B, StepKind.F]
    assert all([sub.kind for sub in s.sub_steps] == parts for s in composites)
    for rank in range(ranks):  # regrouped (and split), not reordered
        assert leaves(paired, rank, option == "split") == leaves(plain, rank)
    lowered = build_plan(name, **kwargs, comms=True, **SPLIT[option])  # type: ignore[arg-type]
    assert paired.params["overlap_bf"] is True
    assert paired.params.get("overlap_bf_split", False) is (option == "split")
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


def test_a_split_pair_adds_up_its_backward_thread_in_the_simulator() -> None:
    """I and W share the pair's worker thread: the pair lasts max(F, I + W)."""
    paired = build_plan("1f1b", num_ranks=1, num_microbatches=4, overlap_bf_split=True)
    assert format_step(paired.ranks[0][1]) == "(0I0;0W0;0F1)OVERLAP_B_F"
    assert simulate(paired, Costs(F=1, B=2, I=1, W=2)).makespan == 1 + 3 * 3 + 2
    assert simulate(paired, Costs(F=4, B=2, I=1, W=2)).makespan == 4 + 3 * 4 + 2
    assert simulate(paired, Costs(F=1, I=1, W=2)).per_rank[0].peak_inflight_activations == 2


def rank_of(*actions: str) -> Plan:
    """A one-rank, one-stage plan of these actions."""
    steps = [parse_step(a) for a in actions]
    return Plan(2, (0,), [steps])  # type: ignore[list-item]


def test_the_verifier_orders_i_then_w_only_on_one_thread() -> None:
    inside = rank_of("0F0", "(0I0;0W0;0F1)OVERLAP_B_F", "0B1")
    assert verify(inside).findings == []
    concurrent = rank_of("0F0", "0F1", "(0I0;0W0)OVERLAP_F_B", "0B1")  # I and W at once
    across = rank_of("0F0", "0W0", "(0I0;0F1)OVERLAP_F_B", "0B1")
    for plan in (concurrent, across):
        kinds = [f.kind for f in verify(plan).findings]
        assert "weight_before_input" in kinds, format_step(plan.ranks[0][2])


@pytest.mark.parametrize("name", sorted(set(SCHEDULE_NAMES) - set(OVERLAP_BF_SCHEDULES)))
def test_other_schedules_refuse_the_option(name: str) -> None:
    with pytest.raises(ScheduleError, match="option of 1f1b and interleaved-1f1b"):
        build_plan(name, num_ranks=2, num_microbatches=4, overlap_bf=True)
    with pytest.raises(
        ScheduleError, match=r"^overlap_bf_split \(OVERLAP_B_F steps\) is an option"
    ):
        build_plan(name, num_ranks=2, num_microbatches=4, overlap_bf_split=True)


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


def test_the_commands_take_the_split(capsys) -> None:
    assert main(["schedule", "show", "1f1b", "-p", "2", "-m", "4", "--overlap-bf-split"]) == 0
    assert "(1I0;1W0;1F1)OVERLAP_B_F" in capsys.readouterr().out
    assert main(["schedule", "verify", "1f1b", "-p", "2", "-m", "4", "--overlap-bf-split"]) == 0
    capsys.readouterr()
    args = ["schedule", "verify", "--csv", "x.csv", "--overlap-bf-split"]
    assert main(args) == 2
    assert "--overlap-bf-split builds a schedule" in capsys.readouterr().err
    plan = RunConfig("1f1b", ranks=2, microbatches=4, overlap_bf_split=True).plan()
    pairs = [s for row in plan.ranks for s in row if s is not None and s.sub_steps]
    assert pairs and all(s.sub_steps[0].kind is StepKind.I for s in pairs)
