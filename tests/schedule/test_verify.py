"""The verifier: hand-built broken plans caught with the right kind, and every built-in clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from schedule_cases import V_CHOICES

from pipetrace.schedule.builders import SCHEDULE_NAMES, build_plan
from pipetrace.schedule.ir import Plan, ScheduleError, infer_placement, parse_step
from pipetrace.schedule.verify import FINDING_KINDS, SEMANTICS, Finding, VerifyReport, verify


def plan_of(*rows: str, num_microbatches: int, placement: tuple[int, ...] | None = None) -> Plan:
    """One string per rank, steps separated by spaces, '.' for a bubble."""
    ranks = [[None if cell == "." else parse_step(cell) for cell in row.split()] for row in rows]
    return Plan(num_microbatches, placement or infer_placement(ranks), ranks)


def kinds(report: VerifyReport) -> set[str]:
    found = {f.kind for f in report.findings}
    assert found <= set(FINDING_KINDS), found - set(FINDING_KINDS)
    return found


def only(report: VerifyReport, kind: str) -> Finding:
    assert kind in kinds(report), report.findings
    found = [f for f in report.findings if f.kind == kind]
    assert len(found) == 1, report.findings
    return found[0]


# A correct two-stage, two-micro-batch plan with its messages; the tests break copies of it.
GOOD = (
    "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
    "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
)


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_the_reference_plan_is_clean(semantics: str) -> None:
    report = verify(plan_of(*GOOD, num_microbatches=2), semantics=semantics)
    assert report.findings == []
    assert report.ok and report.blocked == {} and report.cycle is None and report.lowered is None


def test_a_missing_recv_is_named_with_its_send() -> None:
    plan = plan_of(GOOD[0], GOOD[1].replace("1RECV_F1 ", ""), num_microbatches=2)
    report = verify(plan)
    finding = only(report, "missing_recv")
    assert [(s.rank, s.position, s.text) for s in finding.steps] == [(0, 3, "0SEND_F1")]
    assert "1RECV_F1 on rank 1" in finding.message
    assert "forward_before_input" in kinds(report)  # 1F1 now has no input
    assert not report.ok


def test_a_missing_send_leaves_the_receiver_stuck() -> None:
    plan = plan_of(GOOD[0], GOOD[1].replace(" 1SEND_B1", ""), num_microbatches=2)
    report = verify(plan)
    assert only(report, "missing_send").steps[0].text == "0RECV_B1"
    assert only(report, "stuck").message == (
        "rank 0 can never finish under eager: rank 0 blocked in 0RECV_B1 waiting for rank 1, "
        "which finished its plan without reaching 1SEND_B1"
    )
    assert report.blocked[0].peer_state == "finished" and report.cycle is None


def test_a_missing_send_inside_a_plan_becomes_a_cycle() -> None:
    plan = plan_of(GOOD[0].replace(" 0SEND_F1", ""), GOOD[1], num_microbatches=2)
    report = verify(plan)
    assert "missing_send" in kinds(report)
    assert only(report, "deadlock").message == (
        "deadlock under eager: rank 0 blocked in 0RECV_B0 waiting for rank 1, "
        "which is blocked in 1RECV_F1 waiting for rank 0"
    )


def test_a_duplicated_forward_is_counted_not_collapsed() -> None:
    plan = plan_of("0F0 0F1 0F0 0B0 0B1", num_microbatches=2)
    finding = only(verify(plan), "duplicate_step")
    assert [(s.position, s.text) for s in finding.steps] == [(0, "0F0"), (2, "0F0")]
    assert "appears 2 times" in finding.message


def test_weight_before_input_gradient() -> None:
    report = verify(plan_of("0F0 0W0 0I0", num_microbatches=1))
    finding = only(report, "weight_before_input")
    assert finding.steps[0].text == "0W0" and finding.steps[0].position == 1


def test_backward_before_forward_and_missing_backward() -> None:
    report = verify(plan_of("0B0 0F0 0F1", num_microbatches=2))
    assert only(report, "backward_before_forward").steps[0].text == "0B0"
    assert "no backward" in only(report, "missing_step").message


def test_split_and_full_backward_together_conflict() -> None:
    report = verify(plan_of("0F0 0B0 0I0 0W0", num_microbatches=1))
    assert kinds(report) >= {"conflicting_backward"}


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_send_send_deadlock_under_blocking_sends_only(semantics: str) -> None:
    """Each rank sends to the other before receiving: fine if sends are buffered."""
    plan = plan_of(
        "0F0 0F1 0SEND_F0 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
        num_microbatches=2,
    )
    report = verify(plan, semantics=semantics)
    if semantics == "eager":
        assert report.findings == [] and report.blocked == {}
        return
    finding = only(report, "deadlock")
    assert finding.message == (
        f"deadlock under {semantics}: rank 0 blocked in 0SEND_F1 waiting for rank 1, "
        "which is blocked in 1SEND_B0 waiting for rank 0"
    )
    assert report.cycle == [0, 1]
    assert {
        r: (b.position, b.step, b.waits_for, b.peer_state) for r, b in report.blocked.items()
    } == {0: (3, "0SEND_F1", 1, "blocked"), 1: (3, "1SEND_B0", 0, "blocked")}
    assert [(s.rank, s.position) for s in finding.steps] == [(0, 3), (1, 3)]


def test_a_channel_order_crossing_is_a_warning_with_tags_and_an_error_without() -> None:
    plan = plan_of(
        "0F0 0F1 0SEND_F0 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
        num_microbatches=2,
    )
    eager = verify(plan)
    assert eager.ok and kinds(eager) == {"channel_order"}
    crossing = only(eager, "channel_order")
    assert crossing.severity == "warning"
    assert [s.text for s in crossing.steps] == ["0SEND_F0", "0SEND_F1", "1RECV_F1", "1RECV_F0"]

    rendezvous = verify(plan, semantics="rendezvous")
    assert only(rendezvous, "channel_order").severity == "error"
    assert rendezvous.cycle == [0, 1]

    fifo = verify(plan, semantics="fifo")
    mixups = [f for f in fifo.findings if f.kind == "fifo_mismatch"]
    assert [[s.text for s in f.steps] for f in mixups] == [
        ["0SEND_F0", "1RECV_F1"],
        ["0SEND_F1", "1RECV_F0"],
    ]
    assert "deadlock" not in kinds(fifo)  # untagged matching pairs them, wrongly


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_a_recv_recv_cycle_deadlocks_under_every_semantics(semantics: str) -> None:
    plan = plan_of("0F0 0RECV_B0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0", num_microbatches=1)
    report = verify(plan, semantics=semantics)
    assert kinds(report) == {"deadlock"}
    assert report.cycle == [0, 1]
    assert report.marks() == {
        (0, 1): "BLOCKED waiting for rank 1",
        (1, 0): "BLOCKED waiting for rank 0",
    }


def test_a_chain_behind_a_finished_rank_is_reported_whole() -> None:
    plan = plan_of("0F0", "1RECV_F0 1F0 1SEND_F0", "2RECV_F0 2F0", num_microbatches=1)
    report = verify(plan)
    assert only(report, "stuck").message == (
        "rank 2 can never finish under eager: rank 2 blocked in 2RECV_F0 waiting for rank 1, "
        "which is blocked in 1RECV_F0 waiting for rank 0, which finished its plan without "
        "reaching 0SEND_F0"
    )
    assert [b.peer_state for b in report.blocked.values()] == ["finished", "blocked"]


def test_ranks_queued_behind_a_cycle_are_named() -> None:
    plan = plan_of(
        "0F0 0RECV_B0 0SEND_F0 0B0",
        "1RECV_F0 1F0 1B0 1SEND_B0 1SEND_F0",
        "2RECV_F0 2F0 2B0",
        num_microbatches=1,
    )
    finding = only(verify(plan), "deadlock")
    assert finding.ranks == (0, 1, 2)
    assert finding.message.endswith("also stuck behind it: rank 2 in 2RECV_F0 waiting for rank 1")


def test_indices_out_of_range() -> None:
    report = verify(plan_of("0F0 0B0 0F3 1F0", num_microbatches=1, placement=(0,)))
    bad = [f for f in report.findings if f.kind == "index_out_of_range"]
    assert [f.steps[0].text for f in bad] == ["0F3", "1F0"]


def test_a_stage_on_two_ranks_is_a_finding_not_a_crash() -> None:
    plan = plan_of("0F0 1F0 1B0 0B0", "1F0 1B0", num_microbatches=1, placement=(0, 1))
    report = verify(plan)
    finding = only(report, "stage_on_two_ranks")
    assert finding.ranks == (0, 1)
    assert [(s.rank, s.text) for s in finding.steps] == [(0, "1F0"), (1, "1F0")]
    assert "duplicate_step" in kinds(report)


def test_a_placement_that_disagrees_with_the_steps() -> None:
    plan = plan_of("0F0 0B0", "1F0 1B0", num_microbatches=1, placement=(0, 0))
    assert "stage 1 on rank 0" in only(verify(plan), "placement_mismatch").message


def test_a_message_to_a_stage_that_does_not_exist() -> None:
    report = verify(plan_of("0RECV_F0 0F0 0B0", num_microbatches=1))
    assert "-1SEND_F0" in only(report, "unknown_peer").message
    assert report.blocked[0].peer_state == "missing"


def test_a_send_before_its_compute() -> None:
    plan = plan_of("0SEND_F0 0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0", num_microbatches=1)
    assert only(verify(plan), "send_before_compute").steps[0].position == 0


def test_removing_any_compute_step_of_a_built_plan_is_caught() -> None:
    plan = build_plan("zb1p", num_ranks=3, num_microbatches=4)
    for rank, row in enumerate(plan.ranks):
        for position, step in enumerate(row):
            if step is None:
                continue
            broken = Plan(
                plan.num_microbatches,
                plan.placement,
                [
                    r[:position] + r[position + 1 :] if i == rank else r
                    for i, r in enumerate(plan.ranks)
                ],
            )
            report = verify(broken)
            assert "missing_step" in kinds(report), (rank, position, step)


def test_tied_reductions_are_found_wherever_they_are() -> None:
    plan = build_plan("1f1b", num_ranks=3, num_microbatches=4, comms=True, tie_weights=True)
    assert verify(plan).findings == []
    last_rank = plan.placement[-1]
    moved = [list(row) for row in plan.ranks]
    moved[last_rank].insert(0, moved[last_rank].pop())  # the last stage's TIED_REDUCE, first
    finding = only(verify(Plan(plan.num_microbatches, plan.placement, moved)), "tied_reduce")
    assert "comes before stage 2's last step" in finding.message
    assert [(s.rank, s.text) for s in finding.steps] == [(last_rank, "2TIED_REDUCE")]
    dropped = [row[:-1] if rank == 0 else row for rank, row in enumerate(plan.ranks)]
    finding = only(verify(Plan(plan.num_microbatches, plan.placement, dropped)), "tied_reduce")
    assert finding.message == "stage 0 needs one 0TIED_REDUCE on rank 0" and finding.steps == ()


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_a_tied_reduction_before_a_message_of_its_rank_is_refused(semantics: str) -> None:
    """The reduction is an exchange between the two ranks: rank 1 reducing before it sends
    1SEND_B0 waits for rank 0, which waits in 0RECV_B0 for that send (it hung when run)."""
    stuck = plan_of(
        "0F0 0SEND_F0 0RECV_B0 0B0 0TIED_REDUCE",
        "1RECV_F0 1F0 1B0 1TIED_REDUCE 1SEND_B0",
        num_microbatches=1,
    )
    finding = only(verify(stuck, semantics=semantics), "tied_reduce")
    assert "1TIED_REDUCE comes before a message of rank 1" in finding.message
    assert [(s.rank, s.text) for s in finding.steps] == [(1, "1TIED_REDUCE")]
    fine = plan_of(
        "0F0 0SEND_F0 0RECV_B0 0B0 0TIED_REDUCE",
        "1RECV_F0 1F0 1B0 1SEND_B0 1TIED_REDUCE",
        num_microbatches=1,
    )
    assert verify(fine, semantics=semantics).findings == []


def test_removing_any_comm_step_of_a_built_plan_is_caught() -> None:
    plan = build_plan("interleaved-1f1b", num_ranks=2, num_microbatches=2, comms=True)
    for rank, row in enumerate(plan.ranks):
        for position, step in enumerate(row):
            if step is None or not step.is_comm:
                continue
            broken = Plan(
                plan.num_microbatches,
                plan.placement,
                [
                    r[:position] + r[position + 1 :] if i == rank else r
                    for i, r in enumerate(plan.ranks)
                ],
            )
            assert kinds(verify(broken)) & {"missing_send", "missing_recv"}, (rank, step)


def test_compute_only_plans_are_lowered_for_the_deadlock_check() -> None:
    report = verify(build_plan("1f1b", num_ranks=3, num_microbatches=4))
    assert report.ok and report.lowered is not None and report.lowered.has_comms()
    assert report.executed is report.lowered


def test_unknown_semantics_is_refused() -> None:
    with pytest.raises(ScheduleError, match="semantics"):
        verify(plan_of(*GOOD, num_microbatches=2), semantics="lazy")


def test_json_shape() -> None:
    plan = plan_of("0F0 0RECV_B0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0", num_microbatches=1)
    data = json.loads(json.dumps(verify(plan, semantics="rendezvous").to_json()))
    assert set(data) == {
        "plan",
        "semantics",
        "ok",
        "lowered",
        "counts",
        "findings",
        "blocked",
        "cycle",
    }
    assert data["ok"] is False and data["counts"] == {"error": 1, "warning": 0}
    assert data["cycle"] == [0, 1]
    assert data["blocked"][0] == {
        "rank": 0,
        "position": 1,
        "step": "0RECV_B0",
        "waits_for": 1,
        "peer_state": "blocked",
    }
    assert set(data["findings"][0]) == {"kind", "severity", "message", "ranks", "steps"}
    assert data["findings"][0]["steps"][0] == {"rank": 0, "position": 1, "text": "0RECV_B0"}


def microbatch_choices(name: str, p: int) -> list[int]:
    """M around P, all allowed (interleaved rounds: M // P must divide M; dualpipev M >= 2P)."""
    if name == "dualpipev":
        return [2 * p, 2 * p + 1, 3 * p]
    return sorted({max(1, p - 1), p, p + 1, 2 * p})


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_built_in_schedule_is_clean_under_every_semantics(name: str) -> None:
    for p in range(1, 9):
        for v in V_CHOICES[name]:
            for m in microbatch_choices(name, p):
                for comms in (False, True):
                    plan = build_plan(
                        name, num_ranks=p, num_microbatches=m, stages_per_rank=v, comms=comms
                    )
                    for semantics in SEMANTICS:
                        report = verify(plan, semantics=semantics)
                        assert report.findings == [], (name, p, v, m, comms, semantics)
                        assert report.blocked == {}


def test_a_duplicated_message_is_reported_without_crashing_the_order_check() -> None:
    plan = plan_of(GOOD[0].replace("0SEND_F1", "0SEND_F1 0SEND_F1"), GOOD[1], num_microbatches=2)
    for semantics in SEMANTICS:
        report = verify(plan, semantics=semantics)
        finding = only(report, "duplicate_step")
        assert [s.position for s in finding.steps] == [3, 4]
        assert "missing_recv" in kinds(report)


def test_every_finding_kind_is_documented() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "schedules.md").read_text()
    assert [k for k in FINDING_KINDS if f"| `{k}` |" not in docs] == []


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_a_compute_order_whose_ranks_wait_on_each_other_is_a_deadlock(semantics: str) -> None:
    """Rank 0 wants 1B0 before 0F1, rank 1 wants 0F1 before 1B0: no message order can run
    it, so it is an error under every semantics, not a check skipped."""
    plan = plan_of("0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1", num_microbatches=2)
    report = verify(plan, semantics=semantics)
    finding = only(report, "deadlock")
    assert finding.severity == "error" and finding.ranks == (0, 1)
    assert "0B0" in finding.message and "1F1" in finding.message
    assert not report.ok


def test_a_broken_plan_that_cannot_be_lowered_keeps_the_check_skipped() -> None:
    """With a step missing the lowering's failure may be the missing step's doing."""
    plan = plan_of("0F0 0B0 0F1 0B1", "1F0 1F1 1B0", num_microbatches=2)
    report = verify(plan)
    assert kinds(report) == {"missing_step", "deadlock_unchecked"}
