"""The simulator's swap copies: free by default, hidden behind compute when short enough,
queued one at a time on each rank's side resource, and exposed as wait (idle) time; and
`pipetrace schedule ... --swap` as a user runs it."""

from __future__ import annotations

import json

import pytest

from pipetrace.cli import main
from pipetrace.schedule.builders import SCHEDULE_NAMES, build_plan
from pipetrace.schedule.ir import Plan, ScheduleError, infer_placement, parse_step
from pipetrace.schedule.simulate import Costs, simulate
from pipetrace.schedule.swap import SwapPolicy, add_swap_steps
from pipetrace.schedule.verify import verify

V = {"interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2}


def with_swap(name: str, policy: str, ranks: int = 4, mbs: int = 8) -> tuple[Plan, Plan]:
    plan = build_plan(
        name, num_ranks=ranks, num_microbatches=mbs, stages_per_rank=V.get(name), comms=True
    )
    return plan, add_swap_steps(plan, SwapPolicy.parse(policy))


def wait_time(result) -> list[float]:
    waits = [0.0] * len(result.per_rank)
    for step in result.timeline:
        if step.kind in ("OFFLOAD_WAIT", "LOAD_WAIT"):
            waits[step.rank] += step.end - step.start
    return waits


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_free_copies_change_nothing(name: str) -> None:
    plain, swapped = with_swap(name, "all")
    assert simulate(swapped).to_json()["per_rank"] == simulate(plain).to_json()["per_rank"]
    assert simulate(swapped).makespan == simulate(plain).makespan


def test_copies_as_long_as_a_forward_are_hidden_on_stage_0_of_1f1b() -> None:
    plain, swapped = with_swap("1f1b", "stage=0")
    hidden = simulate(swapped, Costs(swap_bytes=1.0, swap_bandwidth=1.0))
    assert hidden.makespan == simulate(plain).makespan == 33
    assert wait_time(hidden) == [0.0] * 4
    exposed = simulate(swapped, Costs(swap_bytes=2.0, swap_bandwidth=1.0))
    assert exposed.makespan > hidden.makespan
    assert wait_time(exposed)[0] > 0 and wait_time(exposed)[1:] == [0.0] * 3
    assert [r.busy for r in exposed.per_rank] == [r.busy for r in hidden.per_rank]  # idle


def test_copies_queue_on_one_side_resource_per_rank() -> None:
    row = (
        "0SWAP_GROUP0 0F0 0OFFLOAD0 0SWAP_GROUP1 0F1 0OFFLOAD1 0OFFLOAD_WAIT0 0OFFLOAD_WAIT1 "
        "0LOAD1 0LOAD0 0LOAD_WAIT1 0B1 0LOAD_WAIT0 0B0"
    )
    steps = [parse_step(text) for text in row.split()]
    plan = Plan(2, infer_placement([steps]), [steps])
    assert verify(plan).ok
    result = simulate(plan, Costs(F=1, B=2, swap_bytes=6, swap_bandwidth=2))  # copies of 3
    spans = {s.step: (s.start, s.end) for s in result.timeline}
    assert spans["0OFFLOAD_WAIT0"] == (2, 4)  # copy 0: launched at 1, ends at 4
    assert spans["0OFFLOAD_WAIT1"] == (4, 7)  # copy 1: launched at 2, queued until 4
    assert spans["0LOAD_WAIT1"] == (7, 10) and spans["0B1"] == (10, 12)
    assert spans["0LOAD_WAIT0"] == (12, 13)  # its load queued behind 0LOAD1: 10 to 13
    assert result.makespan == 15 and result.per_rank[0].busy == 6  # waits are idle


def test_swap_costs_are_checked() -> None:
    assert Costs.parse("swap_bytes=4,swap_bandwidth=2").swap_transfer == 2
    with pytest.raises(ScheduleError, match="bandwidth must be positive"):
        Costs.parse("swap_bandwidth=0")
    with pytest.raises(ScheduleError, match="finite non-negative"):
        Costs.parse("swap_bytes=-1")


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_schedule_commands_take_a_swap_policy(capsys) -> None:
    code, out, _ = run(capsys, "schedule", "show", "1f1b", "-p", "2", "-m", "2", "--swap", "all")
    assert code == 0 and "0OFFLOAD_WAIT1" in out and "1LOAD_WAIT0" in out
    code, out, _ = run(capsys, "schedule", "verify", "zbv", "-p", "2", "-m", "4", "--swap", "all")
    assert code == 0 and "OK" in out
    args = ["schedule", "simulate", "1f1b", "-p", "4", "-m", "8", "--swap", "stage=0"]
    code, out, _ = run(capsys, *args, "--costs", "swap_bytes=2,swap_bandwidth=1")
    assert code == 0 and "swap copies not hidden by compute" in out and "rank 0 " in out
    code, out, _ = run(capsys, *args, "--json", "--costs", "swap_bytes=1,swap_bandwidth=4")
    assert code == 0 and json.loads(out)["costs"]["swap_bytes"] == 1.0
    code, out, _ = run(capsys, *args, "--json")  # free copies: the JSON of a plain run
    assert code == 0 and "swap_bytes" not in json.loads(out)["costs"]


@pytest.mark.parametrize(
    ("policy", "message"),
    [("bogus", "bad swap policy item 'bogus'"), ("stage=9", "selects no (stage, micro-batch)")],
)
def test_a_bad_swap_policy_is_a_one_line_usage_error(capsys, policy, message) -> None:
    code, out, err = run(capsys, "schedule", "show", "1f1b", "-p", "2", "-m", "2", "--swap", policy)
    assert code == 2 and out == ""
    assert err.startswith("pipetrace: error: ") and message in err and err.count("\n") == 1
