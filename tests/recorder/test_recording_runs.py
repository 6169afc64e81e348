"""Recordings of real multi-rank runs: complete when clean, intact when a rank is killed,
explained when a rank hangs."""

from __future__ import annotations

import dataclasses

import pytest
from recorder_faults import (
    hang_rank2_in_iteration1,
    sigkill_rank1_after_a_flush,
    sigkill_rank1_in_iteration1,
)

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.load import load_run
from pipetrace.analyze.reader import read_log, read_meta, read_run_id
from pipetrace.recorder import format as fmt
from pipetrace.runtime.config import RunConfig
from pipetrace.runtime.launch import launch
from pipetrace.schedule.ir import StepKind, format_step

pytestmark = pytest.mark.multiproc


def events_of(run_dir, rank):
    header, events, problems = read_log(fmt.rank_log_path(run_dir, rank))
    return header, list(events), problems


def main_thread_steps(events, iteration):
    """The plan steps begun on the main thread, in order, for one iteration (a composite's
    sub-steps share its position and are left out)."""
    steps, positions = [], set()
    for e in events:
        if e["e"] == fmt.STEP_BEGIN and e["it"] == iteration and e["pos"] not in positions:
            positions.add(e["pos"])
            steps.append(e["step"])
    return steps


def test_clean_runs_record_exactly_the_plan_in_order(tmp_path):
    base = RunConfig(schedule="1f1b", ranks=4, microbatches=4, steps=2, timeout=60)
    cases = [
        dataclasses.replace(base, out=str(tmp_path / "1f1b")),
        dataclasses.replace(base, schedule="zbv", out=str(tmp_path / "zbv")),
        dataclasses.replace(
            base,
            schedule="dualpipev",
            microbatches=8,
            overlap_p2p=True,
            out=str(tmp_path / "dualpipev"),
            record="full",
        ),
    ]
    result = launch(cases)
    assert not result.failures, result.failures
    for case in cases:
        meta = read_meta(case.out)
        plan = case.plan()
        assert meta["world_size"] == 4 and meta["schedule"]["name"] == plan.name
        for rank in range(4):
            header, events, problems = events_of(case.out, rank)
            assert (
                header["rank"] == rank
                and header["run_id"] == read_run_id(case.out)  # what the directory was claimed with
                and not problems.torn_last_line
                and problems.corrupt_lines == 0
            )
            planned = [format_step(s) for s in plan.steps(rank)]
            assert next(e for e in events if e["e"] == fmt.RUN_START)["plan"] == planned
            for iteration in range(case.steps):
                assert main_thread_steps(events, iteration) == planned
            kinds = [e["e"] for e in events]
            assert kinds[-1] == fmt.RUN_END and kinds.count(fmt.CLOCK) == 2
            begun = {e["id"] for e in events if e["e"] in (fmt.STEP_BEGIN, fmt.P2P_POST)}
            ended = {e["id"] for e in events if e["e"] in (fmt.STEP_END, fmt.P2P_DONE)}
            assert begun == ended
            comm_steps = sum(1 for s in plan.steps(rank) if s.is_comm)
            assert kinds.count(fmt.P2P_POST) == comm_steps * case.steps
            if case.record == "full":
                assert all("stack" in e for e in events if e["e"] == fmt.P2P_POST)
            if case.overlap_p2p:  # both halves of OVERLAP_F_B, on their threads
                assert any(e["e"] == fmt.STEP_BEGIN and e["th"] == "overlap" for e in events)


@pytest.mark.parametrize("stops_inside_a_step", [False, True], ids=["idle-log", "open-step"])
def test_sigkill_leaves_every_log_readable(tmp_path, monkeypatch, stops_inside_a_step):
    out = tmp_path / "killed"
    case = RunConfig(schedule="1f1b", ranks=4, microbatches=4, steps=3, timeout=20, out=str(out))
    if stops_inside_a_step:
        kill = sigkill_rank1_after_a_flush
    else:  # only the iteration-end flush runs: iteration 1's open step never reaches the file
        monkeypatch.setenv("PIPETRACE_FLUSH_INTERVAL", "60")
        kill = sigkill_rank1_in_iteration1
    result = launch([case], custom_functions=[(StepKind.F, kill)], kill_grace=10)
    assert result.failures[0].rank == 1 and "SIGKILL" in result.failures[0].error
    _, events, problems = events_of(out, 1)
    assert problems.corrupt_lines == 0  # at most a torn last line
    kinds = [e["e"] for e in events]
    # flushed at the end of iteration 0, so everything up to there survived the kill
    assert {"it": 0} in [{"it": e["it"]} for e in events if e["e"] == fmt.ITER_END]
    assert fmt.RUN_END not in kinds
    stopped_inside = [e["step"] for e in events if e["e"] == fmt.STEP_BEGIN][-1] == "1F2"
    assert stopped_inside == stops_inside_a_step
    for rank in (0, 2, 3):
        _, events, problems = events_of(out, rank)
        assert problems.corrupt_lines == 0 and not problems.torn_last_line
        kinds = [e["e"] for e in events]
        assert kinds.count(fmt.ITER_END) >= 1
        # each survivor explains its own end: an exception (lost peer) or the launcher's SIGTERM
        assert kinds[-1] in (fmt.EXCEPTION, fmt.SIGNAL, fmt.STALL, fmt.ABORT), kinds[-3:]
    # and the analysis names the killed rank as the root cause, its peers' errors as consequences
    errors = [
        f
        for f in analyze(load_run(out)).findings
        if f.severity == "error" and f.kind == "rank_failed"
    ]
    assert [f.ranks for f in errors] == [[1]], [(f.ranks, f.message, f.cause) for f in errors]
    assert ("inside 1F2" in errors[0].message) == stops_inside_a_step


def test_a_hung_rank_ends_by_the_watchdog_with_stacks_everywhere(tmp_path):
    out = tmp_path / "hung"
    case = RunConfig(
        schedule="1f1b",
        ranks=4,
        microbatches=4,
        steps=3,
        timeout=120,
        stall_timeout=2,
        abort_timeout=2,
        out=str(out),
    )
    result = launch(
        [case], custom_functions=[(StepKind.F, hang_rank2_in_iteration1)], kill_grace=10
    )
    assert result.failures
    for rank in range(4):
        _, events, _ = events_of(out, rank)
        stalls = [e for e in events if e["e"] == fmt.STALL]
        assert stalls, f"rank {rank} recorded no stall"
        assert stalls[0]["stacks"] and stalls[0]["open_steps"]
    _, events, _ = events_of(out, 2)
    stall = next(e for e in events if e["e"] == fmt.STALL)
    frames = [frame for stack in stall["stacks"].values() for frame in stack]
    assert any("hang_rank2_in_iteration1" in frame for frame in frames)
    assert stall["open_steps"][0]["step"].startswith("2F")
    assert any(e["e"] == fmt.ABORT for e in events)
