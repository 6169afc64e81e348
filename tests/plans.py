"""Plans that the unit tests of both runtimes (torch and MindSpore) execute."""

from __future__ import annotations

from pipetrace.schedule.ir import B, F, I, Step, StepKind, W, overlap

# A one-rank plan over 3 local stages with every compute kind, a composite and FSDP steps
# (no-ops on unsharded stages).
MIXED_ROWS: list[list[Step | None]] = [
    [
        Step(StepKind.UNSHARD, 0),
        F(0, 0),
        F(1, 0),
        F(2, 0),
        F(0, 1),
        F(1, 1),
        overlap(F(2, 1), I(2, 0)),
        W(2, 0),
        B(1, 0),
        I(0, 0),
        W(0, 0),
        B(2, 1),
        I(1, 1),
        W(1, 1),
        B(0, 1),
        Step(StepKind.REDUCE_GRAD, 0),
        Step(StepKind.RESHARD, 0),
    ]
]
