"""Activation swap in one process: a one-rank plan with every activation swapped (local
hand-offs, I/W, an OVERLAP_F_B composite) gives the single-process gradients, each swap
launch reports its bytes, a backward before its LOAD_WAIT fails naming the group, and the
--swap setting is checked before anything runs; one-rank OVERLAP_B_F plans match too."""

from __future__ import annotations

import pytest
from runtime_helpers import ListRecorder
from test_runtime_units import assert_matches_reference, run_plan

from pipetrace.errors import PipetraceError
from pipetrace.runtime.config import RunConfig
from pipetrace.schedule.builders import build_plan
from pipetrace.schedule.ir import SWAP_ORDER, Plan, Step, parse_step
from pipetrace.schedule.swap import SwapPolicy, add_swap_steps
from pipetrace.settings import SettingsError
from tests.plans import MIXED_ROWS


def swapped_rows(policy: str) -> list[list[Step | None]]:
    plan = Plan(2, (0, 0, 0), MIXED_ROWS)
    return add_swap_steps(plan, SwapPolicy.parse(policy)).ranks


def test_a_swapped_one_rank_plan_matches_the_reference_and_reports_bytes():
    recorder = ListRecorder()
    executor, loss = run_plan(
        swapped_rows("all"), num_stages=3, num_microbatches=2, recorder=recorder
    )
    assert_matches_reference(executor, loss, 3, 2)
    begun = {e["token"]: e["step"] for e in recorder.events if e["event"] == "begin_step"}
    moved: dict[str, int] = {}
    for event in recorder.events:
        if event["event"] == "end_step" and "nbytes" in event:
            moved[begun[event["begin"]]] = event["nbytes"]
    groups = [(s, m) for s in range(3) for m in range(2)]
    assert set(moved) == {f"{s}{k}{m}" for s, m in groups for k in ("OFFLOAD", "LOAD")}
    for s, m in groups:
        # The demo's blocks save their input and their tanh output, the output of one block
        # being the input of the next. What the rank holds anyway stays: the stage's input
        # (the batch on stage 0), its output, the target on the last stage (whose output is
        # the loss). So one float64 (4 x 16) tensor moves per stage, two on the last one.
        expected = (2 if s == 2 else 1) * 4 * 16 * 8
        assert moved[f"{s}OFFLOAD{m}"] == moved[f"{s}LOAD{m}"] == expected, (s, m)


def test_a_backward_before_its_load_wait_fails_naming_the_group():
    rows = swapped_rows("stage=2,microbatches=1")
    row = [step for step in rows[0] if step != parse_step("2LOAD_WAIT1")]
    row.append(parse_step("2LOAD_WAIT1"))
    with pytest.raises(RuntimeError, match="2SWAP_GROUP1 ran before its LOAD_WAIT"):
        run_plan([row], num_stages=3, num_microbatches=2)


def test_swap_groups_never_loaded_back_are_reported_at_the_end_of_the_iteration():
    """A plan that never runs a group's backward (nor loads it) leaves the group open."""
    rows = swapped_rows("stage=0,microbatches=0")
    dropped = {parse_step(text) for text in ("0LOAD0", "0LOAD_WAIT0", "0I0", "0W0")}
    row = [step for step in rows[0] if step not in dropped]
    with pytest.raises(RuntimeError, match=r"swap groups never loaded back: \['0SWAP_GROUP0'\]"):
        run_plan([row], num_stages=3, num_microbatches=2)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"swap": "layer=0"}, "swap is not a swap policy: bad swap policy item 'layer=0'"),
        ({"swap": "all", "backend": "mindspore"}, "swap is not available on the mindspore"),
    ],
)
def test_the_swap_setting_is_checked(fields, message):
    with pytest.raises(SettingsError, match=message):
        RunConfig("1f1b", **fields)


def test_a_swap_policy_that_selects_nothing_is_a_usage_error():
    with pytest.raises(PipetraceError, match="selects no") as info:
        RunConfig("1f1b", ranks=2, microbatches=2, swap="stage=7").plan()
    assert info.value.exit_code == 2


def test_the_plan_of_a_swapped_run_holds_its_swap_steps():
    plan = RunConfig("gpipe", ranks=2, microbatches=2, swap="microbatches=1").plan()
    for rank in range(2):
        swaps = [s.kind for s in plan.ranks[rank] if s is not None and s.is_swap]
        assert swaps == list(SWAP_ORDER)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(("name", "v"), [("1f1b", None), ("interleaved-1f1b", 2)])
def test_one_rank_overlap_bf_plans_match_the_reference(name, v, split):
    """OVERLAP_B_F steps: the backward (or its I then W) on the overlap thread, the forward
    on the main one."""
    kwargs = {"num_ranks": 1, "num_microbatches": 3, "stages_per_rank": v}
    plan = build_plan(name, **kwargs, overlap_bf=True, overlap_bf_split=split)
    recorder = ListRecorder()
    executor, loss = run_plan(plan.ranks, plan.num_stages, 3, recorder=recorder)
    assert_matches_reference(executor, loss, plan.num_stages, 3)
    threads = {
        (e["step"][1], e["thread"])
        for e in recorder.events
        if e["event"] == "begin_step" and not e["step"].startswith("(")
    }
    backward = {("I", "overlap"), ("W", "overlap")} if split else {("B", "overlap")}
    assert backward <= threads and ("F", "main") in threads
    assert ("F", "overlap") not in threads
    on_worker = [
        e["step"]
        for e in recorder.events
        if e["event"] == "begin_step" and e["thread"] == "overlap"
    ]
    if split:  # each pair's I, then its W
        assert on_worker[1::2] == [step.replace("I", "W") for step in on_worker[::2]]
