"""Faults in torch's own runtime, recorded and named right by ``pipetrace analyze``: a forward
that never returns, a backward that raises, a send never posted (each injected through
``pipetrace run --runtime torch --inject``), and a CSV plan with two actions swapped on one
rank. One 2-rank launch each (the faulty ones end their process group)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tp_runs import analyze_json, errors, pipetrace

from pipetrace.torch_pipelining.demo import TorchCase, run_torch_demo

pytestmark = pytest.mark.multiproc


def run_faulty(tmp_path: Path, *args: str) -> tuple[str, list[dict]]:
    """A 2-rank, 4-micro-batch torch run with ``args``; (its stderr, the error findings)."""
    run_dir = tmp_path / "run"
    done = pipetrace(
        "run", "--runtime", "torch", "-p", "2", "-m", "4", "-n", "2", "--out", str(run_dir), *args
    )
    assert done.returncode == 1, done.stderr
    code, report = analyze_json(run_dir)
    assert code == 1
    return done.stderr, errors(report)


def test_a_forward_that_never_returns_is_a_stalled_rank(tmp_path):
    stderr, found = run_faulty(tmp_path, "-s", "1f1b", "--inject", "hang:rank=1,microbatch=1")
    assert "rank 1: no progress for" in stderr  # its watchdog's line
    assert "in step 1F1" in stderr
    stalled = [f for f in found if f["kind"] == "rank_stalled"]
    assert len(stalled) == 1, found
    assert stalled[0]["details"]["terminal_rank"] == 1
    assert stalled[0]["details"]["terminal_state"] == "computing"
    assert "1F1" in stalled[0]["message"] and stalled[0]["iterations"] == [1]


def test_an_exception_in_a_backward_is_the_root_cause(tmp_path):
    stderr, found = run_faulty(
        tmp_path, "-s", "1f1b", "--inject", "crash:rank=1,microbatch=1,phase=B"
    )
    assert "rank 1 failed: RuntimeError: injected crash" in stderr
    assert found[0]["kind"] == "rank_failed" and found[0]["ranks"] == [1], found
    assert "injected crash" in found[0]["message"] and "1B1" in found[0]["message"]
    assert found[0]["iterations"] == [1]
    assert [f["ranks"] for f in found if f["kind"] == "rank_failed"] == [[1]]


def test_a_recv_whose_send_never_comes_is_unmatched(tmp_path):
    _, found = run_faulty(
        tmp_path, "-s", "interleaved-1f1b", "-v", "2", "--inject", "drop-send:rank=0,microbatch=1"
    )
    unmatched = [f for f in found if f["kind"] == "unmatched_recv"]
    assert unmatched and unmatched[0]["details"]["counterpart"] == "0SEND_F1", found
    assert any(f["kind"] in ("rank_stalled", "deadlock") for f in found), found


def test_a_csv_plan_with_two_recvs_swapped_is_an_order_crossing(tmp_path):
    # Rank 1 of interleaved 1F1B on 2 ranks posts 1RECV_F2 at 13 and 1RECV_F3 at 18; gloo
    # matches untagged messages in order, so swapped they take each other's data.
    run_dir = tmp_path / "run"
    case = TorchCase("csv", str(run_dir), stages_per_rank=2, swap=(1, 13, 18))
    assert run_torch_demo([case], 2, timeout=90) == [0, 0]  # nothing hangs: the data is wrong
    code, report = analyze_json(run_dir)
    assert code == 1
    found = errors(report)
    assert [f["kind"] for f in found] == ["order_crossing"], found
    assert found[0]["details"]["recv_order"] == ["1RECV_F3", "1RECV_F2"]


def test_the_critical_path_follows_messages_waited_for_between_steps(tmp_path):
    """torch's 1F1B waits a recv between its RECV step and the compute, outside every step:
    the path must still follow that message to its sender, here through the straggler's
    every forward, not stay on rank 0 as idle time; and rank 0's wait is P2P wait."""
    run_dir = tmp_path / "run"
    done = pipetrace(
        "run", "--runtime", "torch", "-s", "1f1b", "-p", "2", "-m", "4", "-n", "2",
        "--out", str(run_dir), "--inject", "straggler:rank=1,factor=20",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    _, report = analyze_json(run_dir)
    path = report["metrics"]["critical_path"]
    on_path = {s["step"] for s in path["segments"] if s["what"] == "compute"}
    assert {"1F0", "1F1", "1F2", "1F3"} <= on_path, path["segments"]
    assert path["rank_hops"] > 0
    assert path["by_what_ns"]["idle"] < path["by_what_ns"]["compute"]
    waiting = report["metrics"]["ranks"][0]
    assert waiting["p2p_wait_ns"] > waiting["busy_ns"]
