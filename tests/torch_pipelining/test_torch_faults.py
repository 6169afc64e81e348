"""Faults in torch's own runtime, recorded and named right by ``pipetrace analyze``: a forward
that never returns, a backward that raises, a send never posted, a CSV plan with two actions
swapped on one rank. One 2-rank launch each (the faulty ones end their process group)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tp_runs import analyze_json, errors

from pipetrace.torch_pipelining.demo import TorchCase, TorchFault, run_torch_demo

pytestmark = pytest.mark.multiproc


def run_faulty(tmp_path: Path, **case: object) -> tuple[list[int], list[dict]]:
    run_dir = tmp_path / "run"
    codes = run_torch_demo(
        [
            TorchCase(
                run_dir=str(run_dir),
                microbatches=4,
                stages_per_rank=2,
                stall_timeout=2,
                abort_timeout=2,
                **case,  # type: ignore[arg-type]
            )
        ],
        2,
        timeout=90,
    )
    code, report = analyze_json(run_dir)
    assert code == 1
    return codes, errors(report)


def test_a_forward_that_never_returns_is_a_stalled_rank(tmp_path):
    codes, found = run_faulty(
        tmp_path, schedule="Schedule1F1B", fault=TorchFault("hang_forward", rank=1, microbatch=1)
    )
    assert codes == [3, 3]  # both watchdogs ended their rank
    stalled = [f for f in found if f["kind"] == "rank_stalled"]
    assert len(stalled) == 1, found
    assert stalled[0]["details"]["terminal_rank"] == 1
    assert stalled[0]["details"]["terminal_state"] == "computing"
    assert "1F1" in stalled[0]["message"]


def test_an_exception_in_a_backward_is_the_root_cause(tmp_path):
    codes, found = run_faulty(
        tmp_path, schedule="Schedule1F1B", fault=TorchFault("fail_backward", rank=1, microbatch=1)
    )
    assert codes[1] != 0
    assert found[0]["kind"] == "rank_failed" and found[0]["ranks"] == [1], found
    assert "injected failure" in found[0]["message"] and "1B1" in found[0]["message"]
    assert [f["ranks"] for f in found if f["kind"] == "rank_failed"] == [[1]]


def test_a_recv_whose_send_never_comes_is_unmatched(tmp_path):
    codes, found = run_faulty(
        tmp_path,
        schedule="ScheduleInterleaved1F1B",
        fault=TorchFault("drop_send", rank=0, microbatch=1),
    )
    assert codes == [3, 3]
    unmatched = [f for f in found if f["kind"] == "unmatched_recv"]
    assert unmatched and unmatched[0]["details"]["counterpart"] == "0SEND_F1", found
    assert any(f["kind"] in ("rank_stalled", "deadlock") for f in found), found


def test_a_csv_plan_with_two_recvs_swapped_is_an_order_crossing(tmp_path):
    # Rank 1 of interleaved 1F1B on 2 ranks posts 1RECV_F2 at 13 and 1RECV_F3 at 18; gloo
    # matches untagged messages in order, so swapped they take each other's data.
    codes, found = run_faulty(tmp_path, schedule="csv", swap=(1, 13, 18))
    assert codes == [0, 0]  # nothing hangs: the data is silently wrong
    assert [f["kind"] for f in found] == ["order_crossing"], found
    assert found[0]["details"]["recv_order"] == ["1RECV_F3", "1RECV_F2"]
