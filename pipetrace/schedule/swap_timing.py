"""The simulator's model of activation swap copies: each rank has one side resource (a copy
engine, or the runtime's side thread) that runs its copies one at a time, in launch order.

A launch (``OFFLOAD``, ``LOAD``) takes no time on the rank; its copy starts when the side
resource is free and lasts ``Costs.swap_transfer``. A wait (``OFFLOAD_WAIT``, ``LOAD_WAIT``)
ends when its copy has ended: its duration is the copy time the compute in between did not
hide, which is idle time for the rank. Waits change when later steps start, which changes
the messages other ranks wait for, so the executor runs again with the waits' durations
until nothing changes: as the copies of a rank only depend on its earlier steps, each run
settles at least the earliest wait still wrong, and it ends.
"""

from __future__ import annotations

from collections.abc import Callable

from .execution import Outcome, Program
from .ir import SWAP_MOVES, StepKind
from .swap import has_swap_steps

_LAUNCH_OF = {StepKind.OFFLOAD_WAIT: StepKind.OFFLOAD, StepKind.LOAD_WAIT: StepKind.LOAD}


def has_swap_waits(program: Program) -> bool:
    return has_swap_steps(program, _LAUNCH_OF)


def settle_swap_waits(
    program: Program,
    durations: list[list[float]],
    copy_time: float,
    run: Callable[[list[list[float]]], Outcome],
) -> Outcome:
    """Run the executor (``run(durations)``) until every swap wait lasts until its copy ends;
    the last outcome. ``durations`` stay as they are (compute time: the waits are idle)."""
    waits = [[0.0] * len(row) for row in durations]
    limit = 2 + sum(step.kind in _LAUNCH_OF for steps in program.steps for step in steps)
    for _ in range(limit):
        timed = [[d + w for d, w in zip(row, wait)] for row, wait in zip(durations, waits)]
        outcome = run(timed)
        if outcome.blocked() or not _update_waits(program, outcome, copy_time, waits):
            return outcome
    raise AssertionError("swap waits did not settle")  # unreachable: see the module docstring


def _update_waits(
    program: Program, outcome: Outcome, copy_time: float, waits: list[list[float]]
) -> bool:
    """Each wait's duration from this outcome's launch times; whether any changed."""
    changed = False
    for rank, steps in enumerate(program.steps):
        starts = outcome.start[rank]
        side_free = 0.0
        copy_end: dict[tuple[StepKind, int | None, int | None], float] = {}
        for i, step in enumerate(steps):
            if step.kind in SWAP_MOVES:
                side_free = max(side_free, starts[i]) + copy_time
                copy_end[(step.kind, step.stage, step.microbatch)] = side_free
            elif step.kind in _LAUNCH_OF:
                end = copy_end.get((_LAUNCH_OF[step.kind], step.stage, step.microbatch))
                wait = 0.0 if end is None else max(0.0, end - starts[i])
                if wait != waits[rank][i]:
                    waits[rank][i] = wait
                    changed = True
    return changed
