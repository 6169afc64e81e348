"""Real ranks with activation swap and OVERLAP_B_F: every built-in schedule on 2 and 4 ranks
gives the single-process gradients with every activation offloaded and loaded back, each swap
launch is recorded with the bytes it copies, and 1F1B and interleaved 1F1B with each
steady-state backward (whole, or split into I then W) overlapped with the next forward give
them too. One launch per rank count runs every case."""

from __future__ import annotations

from collections import defaultdict

import pytest
from runtime_helpers import RecorderFiles, read_events
from test_runtime_ranks import SCHEDULES, check_recording

from pipetrace.runtime.config import RunConfig
from pipetrace.runtime.launch import launch
from pipetrace.schedule.ir import SWAP_MOVES, StepKind, parse_step
from pipetrace.schedule.swap import SwapPolicy
from pipetrace.testing.cases import parity_case

pytestmark = pytest.mark.multiproc


def swapped_cases(ranks: int) -> list[RunConfig]:
    """Every schedule with every activation swapped; P2P plain and overlapped by turns."""
    return [
        parity_case(name, ranks, v, steps=1, overlap_p2p=index % 2 == 1, swap="all")
        for index, (name, v) in enumerate(SCHEDULES)
    ]


def overlap_bf_cases(ranks: int) -> list[RunConfig]:
    """1F1B and interleaved 1F1B with OVERLAP_B_F steps, the pair's backward whole and split
    into I then W (the interleaved ones also swap)."""
    return [
        parity_case(
            name, ranks, v, steps=1, overlap_bf=not split, overlap_bf_split=split, swap=swap
        )
        for split in (False, True)
        for name, v, swap in (("1f1b", None, None), ("interleaved-1f1b", 2, "stage=0"))
    ]


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_schedule_with_swap_or_overlap_bf_matches_single_process(ranks, tmp_path):
    cases = swapped_cases(ranks) + overlap_bf_cases(ranks)
    result = launch(cases, make_recorder=RecorderFiles(tmp_path))
    assert result.ok, [(f.rank, f.error, f.traceback) for f in result.failures]
    for index, case in enumerate(cases):
        reports = [result.results[rank][index].parity for rank in range(ranks)]
        assert all(r is not None and r.ok for r in reports), (case.schedule, reports)
        assert sum(r.compared for r in reports) == 1 + 2 * 2 * case.plan().num_stages
        check_recording(tmp_path, index, case)
        if case.swap is not None:
            check_swap_bytes(tmp_path, index, case)
    for case in cases:
        kinds = {s.kind for row in case.plan().ranks for s in row if s is not None}
        paired = case.overlap_bf or case.overlap_bf_split
        assert (StepKind.OVERLAP_B_F in kinds) == paired, case.schedule


def check_swap_bytes(directory, index: int, case: RunConfig) -> None:
    """Every OFFLOAD and LOAD ends with its bytes, and a group loads back what it offloaded;
    no other step carries bytes."""
    plan = case.plan()
    swapped = 0
    for rank in range(case.ranks):
        events = read_events(directory / f"rank{rank}-case{index}.jsonl")
        begun = {e["token"]: e for e in events if e["event"] == "begin_step"}
        moved: dict[tuple[int, int, int], dict[StepKind, int]] = defaultdict(dict)
        iteration = -1
        for event in events:
            if event["event"] == "begin_iteration":
                iteration = event["iteration"]
            if event["event"] != "end_step":
                continue
            step = parse_step(begun[event["begin"]]["step"])
            assert ("nbytes" in event) == (step.kind in SWAP_MOVES), step
            if "nbytes" in event:
                moved[(iteration, step.stage, step.microbatch)][step.kind] = event["nbytes"]
        groups = {(s.stage, s.microbatch) for s in plan.steps(rank) if s.is_swap}
        assert {key[1:] for key in moved} == groups
        for key, sizes in moved.items():
            assert sizes[StepKind.OFFLOAD] == sizes[StepKind.LOAD] > 0, key
        swapped += len(groups)
    policy = SwapPolicy.parse(case.swap)  # type: ignore[arg-type]
    expected = [(s, m) for s in range(plan.num_stages) for m in range(plan.num_microbatches)]
    assert swapped == sum(policy.selects(s, m) for s, m in expected)
