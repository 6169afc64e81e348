"""Peak memory per rank and stage, from the recorded `memory` samples.

A stage's peak is its largest ``saved + inflight`` over the run, with the step after which
it was reached. Read next to the plan: one micro-batch's activations are the smallest rise
of ``saved`` in one sample, so the peak in micro-batches can be set against the schedule's
expected in-flight count (`pipetrace.schedule.simulate.peak_inflight_by_stage`: 1F1B's stage
0 holds P micro-batches, GPipe's M), which is where a schedule's memory cost shows. What
swap would save is an upper bound: every micro-batch held at the peak except one (the one
whose backward runs next needs its activations on the device) offloaded.

Runs recorded without samples (older runs, synthetic ones, torch.distributed.pipelining)
have no memory report. Computed once in `pipetrace.analyze.analysis.analyze`; the report,
the JSON and the views read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetrace.analyze.findings import StepRef
from pipetrace.analyze.model import RankTimeline, Run
from pipetrace.records import JsonRecord, record_json
from pipetrace.schedule.simulate import peak_inflight_by_stage


@dataclass
class StageMemory(JsonRecord):
    """One stage's peak; bytes are ints, ``peak_step`` the step after which it was reached."""

    rank: int
    stage: int
    peak_bytes: int
    saved_bytes: int  # kept for backward on the device, at the peak
    inflight_bytes: int  # received and not yet consumed, at the peak
    swapped_bytes: int  # offloaded to the host by activation swap, at the peak
    peak_step: StepRef | None
    microbatch_bytes: int | None  # what one forward keeps; None if no forward was seen
    peak_microbatches: float | None  # saved_bytes / microbatch_bytes
    expected_microbatches: int | None  # the plan's peak in-flight count (None: no plan)
    swap_would_save_bytes: int  # saved_bytes beyond one micro-batch's

    def to_json(self) -> dict[str, object]:
        step = self.peak_step
        return record_json(self, peak_step=None if step is None else step.to_json())


@dataclass
class RankMemory(JsonRecord):
    """One rank's total over its stages at its own peak sample, and the device allocator's
    peaks (CUDA; None on CPU)."""

    rank: int
    peak_bytes: int
    peak_step: StepRef | None
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None

    def to_json(self) -> dict[str, object]:
        step = self.peak_step
        return record_json(self, peak_step=None if step is None else step.to_json())


@dataclass
class MemoryReport:
    """``metrics.memory`` in `pipetrace analyze --json` (docs/analyze.md)."""

    ranks: list[RankMemory]
    stages: list[StageMemory]

    def to_json(self) -> dict[str, object]:
        return {
            "ranks": [r.to_json() for r in self.ranks],
            "stages": [s.to_json() for s in self.stages],
        }


def memory_report(run: Run) -> MemoryReport | None:
    """Peaks of every rank and stage with samples; None when no rank recorded any."""
    sampled = [r for r in run.present_ranks if len(r.memory) and r.stages]
    if not sampled:
        return None
    expected = peak_inflight_by_stage(run.plan) if run.plan is not None else {}
    stages = [
        _stage_peak(run, rank, slot, expected.get(stage))
        for rank in sampled
        for slot, stage in enumerate(rank.stages)
    ]
    return MemoryReport([_rank_peak(run, rank) for rank in sampled], stages)


def _stage_peak(run: Run, rank: RankTimeline, slot: int, expected: int | None) -> StageMemory:
    memory = rank.memory
    saved, inflight = memory.saved[:, slot], memory.inflight[:, slot]
    total = saved + inflight
    at = int(np.argmax(total))
    rises = np.diff(saved, prepend=0)
    rises = rises[rises > 0]
    one = int(rises.min()) if len(rises) else None
    peak_saved = int(saved[at])
    return StageMemory(
        rank.rank,
        rank.stages[slot],
        int(total[at]),
        peak_saved,
        int(inflight[at]),
        int(memory.swapped[at, slot]),
        _step_ref(run, rank, int(memory.step[at])),
        one,
        round(peak_saved / one, 2) if one else None,
        expected,
        max(peak_saved - (one or 0), 0),
    )


def _rank_peak(run: Run, rank: RankTimeline) -> RankMemory:
    memory = rank.memory
    total = memory.saved.sum(axis=1) + memory.inflight.sum(axis=1)
    at = int(np.argmax(total))
    return RankMemory(
        rank.rank,
        int(total[at]),
        _step_ref(run, rank, int(memory.step[at])),
        _peak_of(memory.allocated),
        _peak_of(memory.reserved),
    )


def _peak_of(column: np.ndarray) -> int | None:
    """The largest recorded value; None when none was recorded (-1 everywhere)."""
    peak = int(column.max()) if len(column) else -1
    return peak if peak >= 0 else None


def _step_ref(run: Run, rank: RankTimeline, row: int) -> StepRef | None:
    """The step of row ``row`` of the rank's step table (None for -1)."""
    if row < 0:
        return None
    steps = rank.steps
    return StepRef(
        rank.rank,
        run.catalog.texts[int(steps.code[row])],
        int(steps.it[row]),
        int(steps.pos[row]),
        int(steps.begin[row]),
    )
