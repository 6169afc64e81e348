"""The simulator: cost parsing, hand-timed tiny plans, and the textbook bubble formulas."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrace.schedule.builders import OVERLAP_BF_SCHEDULES, SCHEDULE_NAMES, build_plan
from pipetrace.schedule.execution import compile_plan, planned_outcome
from pipetrace.schedule.ir import Plan, ScheduleError, Step, StepKind, infer_placement, parse_step
from pipetrace.schedule.simulate import Costs, simulate


def plan_of(*rows: str, num_microbatches: int) -> Plan:
    ranks = [[None if cell == "." else parse_step(cell) for cell in row.split()] for row in rows]
    return Plan(num_microbatches, infer_placement(ranks), ranks)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)


# ---------------------------------------------------------------------------------------
# Costs
# ---------------------------------------------------------------------------------------


def test_costs_parse_scalars_and_per_stage_overrides() -> None:
    costs = Costs.parse("F=1.5, B=3,I=1,W=0.5,comm=0.25,bandwidth=100,message_bytes=50,2:F=4")
    assert (costs.F, costs.B, costs.I, costs.W, costs.comm) == (1.5, 3.0, 1.0, 0.5, 0.25)
    assert costs.per_stage == {(2, "F"): 4.0}
    assert costs.transfer == 0.25 + 50 / 100
    assert Costs.parse("") == Costs()


@pytest.mark.parametrize(
    "text, match",
    [
        ("X=1", "unknown key 'X'"),
        ("F=fast", "'fast' is not a number"),
        ("F", "expected KEY=VALUE"),
        ("B=-1", "non-negative"),
        ("bandwidth=0", "positive"),
        ("comm=inf", "finite"),
        ("3:SEND_F=1", "unknown key"),
    ],
)
def test_costs_parse_rejects_bad_items_clearly(text: str, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        Costs.parse(text)


def test_cost_of_each_kind() -> None:
    costs = Costs(F=1, B=2, I=1.5, W=0.5, per_stage={(3, "B"): 7})
    assert costs.cost_of(parse_step("0F0")) == 1
    assert costs.cost_of(parse_step("3B0")) == 7  # the per-stage override wins
    assert costs.cost_of(parse_step("(0F7;7B3)OVERLAP_F_B")) == 2  # the longer part
    assert costs.cost_of(parse_step("(0F7;3B3)OVERLAP_F_B")) == 7
    for text in ("0UNSHARD", "0RESHARD", "0REDUCE_GRAD", "0SEND_F1", "1RECV_B0"):
        assert costs.cost_of(parse_step(text)) == 0
    assert Costs(comm=1, message_bytes=8, bandwidth=4).transfer == 3


# ---------------------------------------------------------------------------------------
# Hand-timed plans
# ---------------------------------------------------------------------------------------

TWO_RANKS = (
    "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
    "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
)


def test_eager_timing_by_hand() -> None:
    """F=1, B=2, 0.5 on the wire; a recv ends when its message has arrived.

    rank 0: F0 0-1, F1 1-2, waits for B0's gradient (sent 4.5, here 5), B0 5-7, gradient of
    B1 sent 7.5 arrives 8, B1 8-10. rank 1: input arrives 1.5, F0 1.5-2.5, B0 2.5-4.5,
    F1 4.5-5.5, B1 5.5-7.5."""
    result = simulate(plan_of(*TWO_RANKS, num_microbatches=2), Costs(comm=0.5))
    assert result.makespan == 10
    timeline = {(s.rank, s.step): (s.start, s.end) for s in result.timeline}
    assert timeline[(0, "0RECV_B0")] == (2, 5)
    assert timeline[(1, "1RECV_F1")] == (2.5, 2.5)
    assert timeline[(0, "0B1")] == (8, 10)
    assert [(r.busy, r.idle) for r in result.per_rank] == [(6, 4), (6, 4)]
    assert result.idle_fraction == 8 / 20 and result.bubble_ratio == 8 / 12


@pytest.mark.parametrize("semantics", ["rendezvous", "fifo"])
def test_blocking_timing_by_hand(semantics: str) -> None:
    """Both ends finish together, 0.5 after the later arrival: the sender of F1 waits.

    rank 0: F0 0-1, send F0 done 1.5, F1 1.5-2.5, send F1 done 3 (rank 1 reached its recv at
    2.5), B0's gradient done 5.5, B0 5.5-7.5, B1's gradient done 9, B1 9-11."""
    result = simulate(plan_of(*TWO_RANKS, num_microbatches=2), Costs(comm=0.5), semantics=semantics)
    assert result.makespan == 11
    timeline = {(s.rank, s.step): (s.start, s.end) for s in result.timeline}
    assert timeline[(0, "0SEND_F1")] == (2.5, 3)
    assert timeline[(1, "1RECV_F1")] == (2.5, 3)
    assert timeline[(0, "0B1")] == (9, 11)


def test_a_plan_that_cannot_finish_raises_naming_the_ranks() -> None:
    plan = plan_of(
        "0F0 0F1 0SEND_F0 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
        num_microbatches=2,
    )
    assert simulate(plan).makespan > 0  # eager: buffered sends, no hang
    with pytest.raises(
        ScheduleError,
        match=r"ranks \[0, 1\] are blocked .*rank 0 blocked in "
        r"0SEND_F1 waiting for rank 1",
    ):
        simulate(plan, semantics="rendezvous")


def test_overlap_costs_its_longest_part_and_fsdp_steps_cost_nothing() -> None:
    plan = plan_of("0UNSHARD 0F0 0F1 (0F2;0B0)OVERLAP_F_B 0B1 0B2 0RESHARD", num_microbatches=3)
    result = simulate(plan, Costs(F=1, B=3))
    assert result.makespan == 1 + 1 + 3 + 3 + 3
    assert result.per_rank[0].peak_inflight_activations == 3  # F2 counted before B0 ends


def test_per_stage_costs_from_measurements() -> None:
    plan = build_plan("1f1b", num_ranks=2, num_microbatches=1)
    base = simulate(plan).makespan
    assert simulate(plan, Costs(per_stage={(1, "F"): 5.0})).makespan == base + 4


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(["1f1b", "interleaved-1f1b", "zbv", "dualpipev"]),
    costs=st.dictionaries(
        st.tuples(st.integers(0, 7), st.sampled_from("FBIW")),
        st.integers(1, 9).map(float),
        max_size=12,
    ),
)
def test_each_step_takes_its_stage_cost(name: str, costs: dict[tuple[int, str], float]) -> None:
    """Every compute step lasts `Costs.cost_of` it (the per-stage table, looked up over the
    whole plan at once, agrees with the per-step rule), overlapped pairs included."""
    plan = build_plan(name, num_ranks=4, num_microbatches=8)
    cost = Costs(F=1.0, B=2.0, I=1.5, W=0.5, per_stage=costs)
    for span in simulate(plan, cost).timeline:
        if not span.kind.startswith(("SEND", "RECV")):
            assert span.end - span.start == cost.cost_of(parse_step(span.step)), span


def test_compute_only_plans_are_lowered_and_the_timeline_is_consistent() -> None:
    plan = build_plan("zbv", num_ranks=3, num_microbatches=6)
    result = simulate(plan)
    assert result.plan.has_comms() and not plan.has_comms()
    assert len(result.timeline) == sum(len(r) for r in result.plan.without_bubbles().ranks)
    for rank in range(3):
        spans = [(s.start, s.end) for s in result.timeline if s.rank == rank]
        assert all(a <= b for a, b in spans)
        assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))
        assert result.per_rank[rank].busy == pytest.approx(6 * 2 * (1 + 1 + 1))  # F, I, W


def test_json_shape() -> None:
    result = simulate(build_plan("1f1b", num_ranks=2, num_microbatches=2))
    data = json.loads(json.dumps(result.to_json()))
    assert set(data) == {
        "plan",
        "semantics",
        "costs",
        "makespan",
        "idle_fraction",
        "bubble_ratio",
        "per_rank",
    }
    assert data["costs"]["bandwidth"] is None  # infinity has no JSON form
    assert set(data["per_rank"][0]) == {
        "rank",
        "busy",
        "idle",
        "idle_fraction",
        "bubble_ratio",
        "peak_inflight_activations",
    }
    with_timeline = result.to_json(timeline=True)
    assert with_timeline["timeline"][0] == {
        "rank": 0,
        "position": 0,
        "step": "0F0",
        "kind": "F",
        "start": 0.0,
        "end": 1.0,
    }


def test_a_rank_without_work_has_an_infinite_bubble_ratio() -> None:
    plan = Plan(1, (0,), [[Step(StepKind.F, 0, 0), Step(StepKind.B, 0, 0)], []])
    stats = simulate(plan).per_rank[1]
    assert stats.busy == 0 and stats.bubble_ratio == math.inf
    assert simulate(plan).to_json()["per_rank"][1]["bubble_ratio"] is None


# ---------------------------------------------------------------------------------------
# Textbook formulas (default costs F=1, B=2, I=1, W=1, comm=0)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", range(1, 9))
def test_1f1b_idle_fraction_and_memory(p: int) -> None:
    for m in range(1, 3 * p + 2):
        result = simulate(build_plan("1f1b", num_ranks=p, num_microbatches=m))
        assert close(result.idle_fraction, (p - 1) / (m + p - 1)), m
        assert close(result.bubble_ratio, (p - 1) / m), m
        assert result.per_rank[0].peak_inflight_activations == min(p, m)
        gpipe = simulate(build_plan("gpipe", num_ranks=p, num_microbatches=m))
        assert [r.peak_inflight_activations for r in gpipe.per_rank] == [m] * p


def interleaved_ms(p: int) -> list[int]:
    """Allowed M: torch splits M into max(1, M // P) equal rounds."""
    return [m for m in range(1, 4 * p + 1) if m % max(1, m // p) == 0]


@pytest.mark.parametrize("p", range(2, 7))
@pytest.mark.parametrize("v", [1, 2, 3])
def test_interleaved_bubble_ratio(p: int, v: int) -> None:
    """(p-1)/(v*m) exactly for every allowed m >= p.

    With m < p the first micro-batch comes back to rank 0 for its next chunk only after p
    steps, so each of the v-1 chunk changes adds (p-m) idle slots (forward and backward):
    ((p-1) + (v-1)(p-m)) / (v*m)."""
    for m in interleaved_ms(p):
        result = simulate(
            build_plan("interleaved-1f1b", num_ranks=p, num_microbatches=m, stages_per_rank=v)
        )
        expected = (p - 1) / (v * m) if m >= p else ((p - 1) + (v - 1) * (p - m)) / (v * m)
        assert close(result.bubble_ratio, expected), (m, result.bubble_ratio, expected)


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("v", [1, 2, 3])
def test_zb1p_bubble_ratio(p: int, v: int) -> None:
    """ZB-H1 with F = I = W: (p-1)/(3vm) for every allowed m >= p; what B costs never matters."""
    for m in [m for m in interleaved_ms(p) if p <= m <= 3 * p] if v > 1 else range(p, 3 * p + 1):
        plan = build_plan("zb1p", num_ranks=p, num_microbatches=m, stages_per_rank=v)
        for costs in (Costs(F=1, B=2, I=1, W=1), Costs(F=1, B=7, I=1, W=1)):
            assert close(simulate(plan, costs).bubble_ratio, (p - 1) / (3 * v * m)), m


# ---------------------------------------------------------------------------------------
# Invariants over random built-in plans and costs
# ---------------------------------------------------------------------------------------


@st.composite
def plan_params(draw: st.DrawFn) -> tuple[str, int, int, int]:
    name, v = draw(
        st.sampled_from(
            [
                ("1f1b", 1),
                ("gpipe", 1),
                ("interleaved-1f1b", 2),
                ("zb1p", 1),
                ("zbv", 2),
                ("dualpipev", 2),
            ]
        )
    )
    p = draw(st.integers(1, 5))
    m = draw(st.integers(2 * p if name == "dualpipev" else 1, 3 * p + 2))
    return name, v, p, m


costs = st.builds(
    Costs,
    F=st.integers(1, 4),
    B=st.integers(1, 6),
    I=st.integers(1, 3),
    W=st.integers(0, 3),
    comm=st.sampled_from([0.0, 0.5, 2.0]),
)


@settings(max_examples=40, deadline=None)
@given(plan_params(), costs)
def test_timing_invariants(params: tuple[str, int, int, int], cost: Costs) -> None:
    """Busy time is the sum of step costs; buffered sends never make a plan slower than
    blocking ones; untagged blocking matching times a clean plan like tagged blocking."""
    name, v, p, m = params
    try:
        plan = build_plan(name, num_ranks=p, num_microbatches=m, stages_per_rank=v, comms=True)
    except ScheduleError:  # M not allowed for this schedule
        return
    eager = simulate(plan, cost)
    rendezvous = simulate(plan, cost, semantics="rendezvous")
    fifo = simulate(plan, cost, semantics="fifo")
    for rank, stats in enumerate(eager.per_rank):
        expected = sum(cost.cost_of(s) for s in plan.ranks[rank] if s is not None)
        assert stats.busy == pytest.approx(expected)
        assert stats.busy <= eager.makespan + 1e-9
    by_step = {(s.rank, s.position): s.end for s in eager.timeline}
    for step in rendezvous.timeline:
        assert by_step[(step.rank, step.position)] <= step.end + 1e-9
    assert fifo.makespan == rendezvous.makespan


@pytest.mark.parametrize(
    ("name", "overlap"),
    [(name, False) for name in SCHEDULE_NAMES] + [(name, True) for name in OVERLAP_BF_SCHEDULES],
)
def test_a_built_plan_times_as_a_copy_run_step_by_step(name: str, overlap: bool) -> None:
    """A plan fresh from `lower`, simulated eagerly with the costs the lowering simulated
    with, reads its times from the lowering (`planned_outcome`); a copy of the plan is
    compiled anew and run step by step. Both must say the same, to the timeline."""
    v = 1 if name in ("gpipe", "1f1b") else 2
    for ranks, microbatches in ((1, 2), (2, 4), (3, 6), (4, 8), (4, 13)):
        try:
            plan = build_plan(
                name,
                num_ranks=ranks,
                num_microbatches=microbatches,
                stages_per_rank=v,
                comms=True,
                overlap_bf=overlap,
            )
        except ScheduleError:  # M not allowed for this schedule
            continue
        read = planned_outcome(compile_plan(plan), (1.0, 2.0, 1.0, 1.0)) is not None
        assert read == (not overlap and name != "dualpipev")  # composites are run
        planned = simulate(plan, Costs(F=1, B=2)).to_json(timeline=True)
        rows = [list(row) for row in plan.ranks]
        copy = Plan(plan.num_microbatches, plan.placement, rows, plan.name, plan.params)
        run = simulate(copy, Costs(F=1, B=2)).to_json(timeline=True)
        assert planned["timeline"] and run == planned
