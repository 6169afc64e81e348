"""Activation swap in the schedule layer: the step kinds' text forms, the --swap policy, the
plan transform on every built-in schedule, the verifier's swap checks and lowering."""

from __future__ import annotations

import pytest

from pipetrace.schedule.builders import SCHEDULE_NAMES, build_compute_plan, build_plan
from pipetrace.schedule.csvio import parse_csv_text, plan_to_csv
from pipetrace.schedule.ir import (
    BACKWARD_KINDS,
    SWAP_ORDER,
    Plan,
    ScheduleError,
    StepKind,
    format_step,
    infer_placement,
    parse_step,
)
from pipetrace.schedule.lowering import lower
from pipetrace.schedule.swap import SwapPolicy, add_swap_steps
from pipetrace.schedule.verify import FINDING_KINDS, SEMANTICS, verify

V = {"interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2}


def built(name: str, ranks: int, *, comms: bool) -> Plan:
    make = build_plan if comms else build_compute_plan
    kwargs = {"comms": True} if comms else {}
    return make(
        name,
        num_ranks=ranks,
        num_microbatches=2 * ranks,
        stages_per_rank=V.get(name),
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("kind", SWAP_ORDER)
def test_swap_action_strings_round_trip(kind: StepKind) -> None:
    text = f"3{kind.value}12"
    step = parse_step(text)
    assert (step.kind, step.stage, step.microbatch) == (kind, 3, 12) and step.is_swap
    assert format_step(step) == text
    with pytest.raises(ScheduleError, match="needs a micro-batch"):
        parse_step(f"3{kind.value}")


@pytest.mark.parametrize(
    ("text", "stages", "microbatches"),
    [
        ("all", None, None),
        ("stage=0", (0, 0), None),
        ("stages=1-2", (1, 2), None),
        ("microbatches=0-3", None, (0, 3)),
        ("stage=0, mb=2", (0, 0), (2, 2)),
    ],
)
def test_policy_texts(text, stages, microbatches) -> None:
    assert SwapPolicy.parse(text) == SwapPolicy(stages, microbatches)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stage", "expected stage=A"),
        ("layer=0", "expected stage=A"),
        ("stage=3-1", "empty range"),
        ("stage=0,stage=1", "given twice"),
        ("microbatches=a", "expected stage=A"),
    ],
)
def test_bad_policy_texts_name_the_item(text, message) -> None:
    with pytest.raises(ScheduleError, match=message):
        SwapPolicy.parse(text)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("comms", [False, True])
def test_every_schedule_with_swap_verifies_clean(name: str, ranks: int, comms: bool) -> None:
    plan = built(name, ranks, comms=comms)
    swapped = add_swap_steps(plan, SwapPolicy.parse("all"))
    for semantics in SEMANTICS:
        report = verify(swapped, semantics=semantics)
        assert report.ok and report.findings == [], report.findings
    for rank in range(ranks):
        rest = [s for s in swapped.ranks[rank] if s is None or not s.is_swap]
        assert rest == plan.ranks[rank]  # nothing else moved
        swaps = [s for s in swapped.ranks[rank] if s is not None and s.is_swap]
        assert len(swaps) == 5 * len(plan.stages_of(rank)) * plan.num_microbatches
    assert swapped.params["swap"] == "all"


def test_swap_steps_sit_next_to_their_compute_steps() -> None:
    """SWAP_GROUP right before its forward, OFFLOAD right after it, LOAD_WAIT right before
    the first backward, and the load launched one compute step before that."""
    plan = add_swap_steps(built("1f1b", 4, comms=False), SwapPolicy.parse("stage=0"))
    row = [s for s in plan.ranks[0] if s is not None]
    texts = [format_step(s) for s in row]
    computes = [i for i, s in enumerate(row) if s.is_compute]
    for mb in range(8):
        f, b = texts.index(f"0F{mb}"), texts.index(f"0B{mb}")
        assert texts[f - 1] == f"0SWAP_GROUP{mb}" and texts[f + 1] == f"0OFFLOAD{mb}"
        assert texts[b - 1] == f"0LOAD_WAIT{mb}"
        before_b = [i for i in computes if i < b]
        load = texts.index(f"0LOAD{mb}")
        if len([i for i in before_b if i > f]) >= 2:  # room to overlap the load
            assert before_b[-2] < load < before_b[-1]
    assert all(s is None or not s.is_swap for s in plan.ranks[1])


def test_a_policy_that_selects_nothing_is_an_error() -> None:
    with pytest.raises(ScheduleError, match="selects no"):
        add_swap_steps(built("1f1b", 2, comms=False), SwapPolicy.parse("stage=5"))


def test_swap_plans_round_trip_through_csv_and_json() -> None:
    plan = add_swap_steps(built("zbv", 2, comms=True), SwapPolicy.parse("microbatches=1-2"))
    assert parse_csv_text(plan_to_csv(plan)) == [
        [s for s in row] for row in plan.ranks
    ]  # no bubbles in a lowered plan
    assert Plan.from_json(plan.to_json()).ranks == plan.ranks


def test_lowering_keeps_swap_steps_beside_their_compute_steps() -> None:
    compute = add_swap_steps(built("gpipe", 2, comms=False), SwapPolicy.parse("all"))
    lowered = lower(compute)
    assert verify(lowered, semantics="fifo").ok
    for rank in range(2):
        row = lowered.ranks[rank]
        for index, step in enumerate(row):
            if step.kind in (StepKind.SWAP_GROUP, StepKind.LOAD_WAIT):
                after = row[index + 1]
                assert after.is_swap or after.is_compute, (rank, index, step)
            elif step.kind is StepKind.OFFLOAD:
                assert row[index - 1].kind is StepKind.F
        assert [s for s in row if s.is_swap] == [s for s in compute.ranks[rank] if s and s.is_swap]


def plan_of(*rows: str, num_microbatches: int) -> Plan:
    ranks = [[parse_step(cell) for cell in row.split()] for row in rows]
    return Plan(num_microbatches, infer_placement(ranks), ranks)


# One rank, stage 0, micro-batch 0 swapped correctly; the tests break copies of it.
GOOD = "0SWAP_GROUP0 0F0 0OFFLOAD0 0F1 0OFFLOAD_WAIT0 0LOAD0 0B1 0LOAD_WAIT0 0B0"


def swap_findings(row: str) -> list:
    report = verify(plan_of(row, num_microbatches=2))
    found = [f for f in report.findings if f.kind.startswith(("swap", "offload", "load"))]
    assert {f.kind for f in found} <= set(FINDING_KINDS)
    return found


def test_the_good_swap_row_is_clean() -> None:
    assert verify(plan_of(GOOD, num_microbatches=2)).findings == []


@pytest.mark.parametrize(
    ("row", "kind", "named"),
    [
        (GOOD.replace("0LOAD_WAIT0 0B0", "0B0 0LOAD_WAIT0"), "load_late", ["0B0", "0LOAD_WAIT0"]),
        (
            GOOD.replace("0OFFLOAD_WAIT0 0LOAD0", "0LOAD0 0OFFLOAD_WAIT0"),
            "offload_not_waited",
            ["0LOAD0", "0OFFLOAD_WAIT0"],
        ),
        (GOOD.replace("0SWAP_GROUP0 0F0", "0F0 0SWAP_GROUP0"), "swap_without_activations", None),
        (GOOD.replace(" 0OFFLOAD_WAIT0", ""), "swap_incomplete", None),
        (GOOD + " 0LOAD1", "swap_incomplete", ["0LOAD1"]),
        (GOOD.replace("0LOAD0 0B1 0LOAD_WAIT0", "0LOAD_WAIT0 0B1 0LOAD0"), "swap_order", None),
    ],
)
def test_broken_swap_groups_are_named(row: str, kind: str, named: list[str] | None) -> None:
    found = swap_findings(row)
    assert [f.kind for f in found] == [kind], found
    assert found[0].severity == "error" and found[0].ranks == (0,)
    if named is not None:
        assert [s.text for s in found[0].steps] == named
    for ref in found[0].steps:
        assert format_step(plan_of(row, num_microbatches=2).ranks[0][ref.position]) == ref.text


def test_a_swap_of_a_microbatch_without_activations_is_an_error() -> None:
    row = GOOD.replace("0SWAP_GROUP0 0F0 0OFFLOAD0", "0OFFLOAD0 0SWAP_GROUP0 0F0")
    assert [f.kind for f in swap_findings(row)] == ["swap_without_activations"]
    found = swap_findings(GOOD + " 0OFFLOAD3")  # micro-batch 3 has no forward at all
    assert [f.kind for f in found] == ["swap_without_activations"]
    assert [s.text for s in found[0].steps] == ["0OFFLOAD3"] and "0F3" in found[0].message


def test_backward_kinds_need_the_load() -> None:
    """The first backward step is what needs the activations back, B or I."""
    assert {StepKind.B, StepKind.I} == BACKWARD_KINDS
    split = GOOD.replace("0B1", "0I1 0W1").replace("0LOAD_WAIT0 0B0", "0I0 0LOAD_WAIT0 0W0")
    assert [f.kind for f in swap_findings(split)] == ["load_late"]
