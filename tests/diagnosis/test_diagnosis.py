"""Every injected fault, on 1F1B and ZBV, is diagnosed by `pipetrace analyze --json` with
the right kind, ranks, micro-batches and step; every clean run has no error finding; every
run, however it ended, leaves a readable trace."""

from __future__ import annotations

import pytest

from pipetrace.runtime import faults as ft
from pipetrace.runtime.fault_plan import peer_of
from pipetrace.schedule.ir import Plan, format_step

from .conftest import CLEAN, SCHEDULES, Runs, analyze_json, fault_case

pytestmark = pytest.mark.multiproc


def errors(document: dict) -> list[dict]:
    return [f for f in document["findings"] if f["severity"] == "error"]


def one(document: dict, kind: str, **where) -> dict:
    """The finding of ``kind`` whose fields equal ``where`` (there must be exactly one)."""
    found = [
        f
        for f in document["findings"]
        if f["kind"] == kind and all(f[k] == v for k, v in where.items())
    ]
    assert len(found) == 1, (
        kind,
        where,
        [(f["kind"], f["ranks"], f["message"]) for f in document["findings"]],
    )
    return found[0]


def assert_readable(document: dict, world_size: int) -> None:
    """Every rank left a log the analyzer could use (a torn last line at most)."""
    assert [r["rank"] for r in document["ranks"]] == list(range(world_size))
    assert all(r["state"] != "missing" for r in document["ranks"]), document["ranks"]
    assert not [p for p in document["input_problems"] if p["severity"] != "info"], document[
        "input_problems"
    ]


@pytest.mark.parametrize("schedule", list(CLEAN))
def test_clean_runs_have_no_error_finding(runs: Runs, schedule: str):
    name = f"clean-{schedule}"
    assert not runs.result(name).failures
    document = analyze_json(runs.path(name))
    assert errors(document) == []
    assert {r["state"] for r in document["ranks"]} == {"finished"}
    assert_readable(document, runs.cases[name].world_size)


# -- one check per fault kind: what the analyzer must say --------------------------------


def check_crash(document: dict, fault: ft.Crash, plan: Plan) -> None:
    first = document["findings"][0]
    assert (
        first["kind"] == "rank_failed"
        and first["severity"] == "error"
        and first["ranks"] == [fault.rank]
    )
    assert "injected crash" in first["message"]
    assert first["steps"][0]["step"] == format_step(fault.target(plan)) and first["iterations"] == [
        fault.step
    ]


def check_hang(document: dict, fault: ft.Hang, plan: Plan) -> None:
    text = format_step(fault.target(plan))
    stalls = [
        f
        for f in errors(document)
        if f["kind"] == "rank_stalled"
        and f["details"].get("terminal_rank", f["ranks"][0]) == fault.rank
    ]
    assert stalls, [(f["kind"], f["message"]) for f in document["findings"]]
    stall = stalls[0]
    assert stall["details"]["terminal_state"] == "computing" and text in stall["message"]
    assert stall["iterations"] == [fault.step]
    assert document["ranks"][fault.rank]["state"] == "aborted"  # the watchdog ended it


def check_deadlock(document: dict, fault: ft.Deadlock, plan: Plan) -> None:
    deadlock = next(f for f in errors(document) if f["kind"] == "deadlock")
    assert sorted(deadlock["details"]["cycle"]) == sorted([fault.rank, fault.peer])
    assert deadlock["iterations"] == [fault.step]
    send, _ = fault.hold(plan, overlap=False)
    assert send.microbatch in deadlock["microbatches"]
    assert_moved(document, fault.rank, send, fault.step or 0, plan)
    assert not [f for f in document["findings"] if f["kind"].startswith("unmatched")]


def assert_moved(document: dict, rank: int, step, iteration: int, plan: Plan) -> None:
    """The rank is reported to have run something else where its plan has ``step``."""
    moved = one(document, "plan_divergence", ranks=[rank])
    assert moved["severity"] == "warning" and moved["iterations"] == [iteration]
    details = moved["details"]
    assert details["planned"] == format_step(step) and details["position"] == plan.steps(
        rank
    ).index(step)


def check_drop_recv(document: dict, fault: ft.DropRecv, plan: Plan) -> None:
    recv = fault.target(plan)
    sender = peer_of(plan, recv)
    unmatched = one(document, "unmatched_send", ranks=[sender, fault.rank])
    assert unmatched["microbatches"] == [fault.microbatch] and unmatched["iterations"] == [
        fault.step
    ]
    assert f"ran {format_step(recv)} without posting it" in unmatched["cause"]
    # ... then the sender stalls: a hang that involves both ranks
    hangs = [f for f in errors(document) if f["kind"] in ("deadlock", "rank_stalled")]
    assert any({sender, fault.rank} <= set(f["ranks"]) for f in hangs), hangs


def check_drop_send(document: dict, fault: ft.DropSend, plan: Plan) -> None:
    send = fault.target(plan)
    receiver = peer_of(plan, send)
    unmatched = one(document, "unmatched_recv", ranks=[receiver, fault.rank])
    assert unmatched["microbatches"] == [fault.microbatch] and unmatched["iterations"] == [
        fault.step
    ]
    assert f"ran {format_step(send)} without posting it" in unmatched["cause"]
    hangs = [f for f in errors(document) if f["kind"] in ("deadlock", "rank_stalled")]
    assert any({receiver, fault.rank} <= set(f["ranks"]) for f in hangs), hangs


def check_extra_send(document: dict, fault: ft.ExtraSend, plan: Plan) -> None:
    peer = peer_of(plan, fault.target(plan))
    unmatched = one(document, "unmatched_send", ranks=[fault.rank, peer])
    assert unmatched["microbatches"] == [fault.microbatch] and unmatched["iterations"] == [
        fault.step
    ]
    assert unmatched["cause"] == f"micro-batch {fault.microbatch} was sent more than once"
    assert [f["kind"] for f in errors(document)] == ["unmatched_send"]


def check_shape_mismatch(document: dict, fault: ft.ShapeMismatch, plan: Plan) -> None:
    peer = peer_of(plan, fault.target(plan))
    mismatch = one(document, "message_mismatch", ranks=[fault.rank, peer])
    assert mismatch["microbatches"] == [fault.microbatch] and mismatch["iterations"] == [fault.step]
    assert mismatch["details"]["send"]["shape"] == list(fault.shape or ())
    assert mismatch["details"]["recv"]["shape"] == [32, 128]
    assert set(mismatch["details"]["differs"]) == {"bytes", "shape"}
    assert [f["kind"] for f in errors(document)] == ["message_mismatch"]


def check_swap_order(document: dict, fault: ft.SwapOrder, plan: Plan) -> None:
    first, second = fault.pair(plan, overlap=False)
    crossing = one(document, "order_crossing", ranks=[fault.rank, peer_of(plan, first)])
    assert crossing["microbatches"] == sorted({first.microbatch, second.microbatch})
    assert crossing["iterations"] == [fault.step]
    assert crossing["details"]["send_order"][:2] == [format_step(second), format_step(first)]
    assert [f["kind"] for f in errors(document)] == ["order_crossing"]
    assert_moved(document, fault.rank, first, fault.step or 0, plan)


def check_straggler(document: dict, fault: ft.Straggler, plan: Plan) -> None:
    mine = [
        f for f in document["findings"] if f["kind"] == "straggler" and f["ranks"] == [fault.rank]
    ]
    assert mine, [(f["kind"], f["message"]) for f in document["findings"]]
    assert all(f["details"]["kinds"]["F"]["factor"] >= 2 for f in mine)
    assert {f["details"]["stage"] for f in mine} <= set(plan.stages_of(fault.rank))
    assert errors(document) == []


def check_slow_link(document: dict, fault: ft.SlowLink, plan: Plan) -> None:
    exposed = one(document, "exposed_comm")
    assert fault.rank in exposed["ranks"]
    if plan.num_ranks > 2:  # it sends to both neighbours, each of them receives from it only
        assert exposed["ranks"][0] == fault.rank
    assert errors(document) == []


CHECKS = {
    "crash": check_crash,
    "hang": check_hang,
    "deadlock": check_deadlock,
    "drop-recv": check_drop_recv,
    "drop-send": check_drop_send,
    "extra-send": check_extra_send,
    "shape-mismatch": check_shape_mismatch,
    "swap-order": check_swap_order,
    "straggler": check_straggler,
    "slow-link": check_slow_link,
}


def test_every_fault_kind_has_a_check():
    assert set(CHECKS) == set(ft.FAULT_KINDS)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("kind", list(ft.FAULT_KINDS))
def test_fault_is_diagnosed(runs: Runs, kind: str, schedule: str):
    name = fault_case(kind, schedule)
    case = runs.cases[name]
    (fault,) = case.faults
    result = runs.result(name)
    assert bool(result.failures) == fault.ENDS_RUN, result.failures
    document = analyze_json(runs.path(name))
    assert_readable(document, case.world_size)
    CHECKS[kind](document, fault, case.plan())  # type: ignore[arg-type]
