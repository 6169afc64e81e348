"""Injected faults (`pipetrace.runtime.faults`) on torch's own runtime.

The kinds whose ``RUNTIMES`` include "torch" (crash, hang, straggler, drop-send) strike a
compute call or the ops one message is made of; they are armed by wrapping the rank's stage
methods (instance attributes) before recording starts, so the recording sees what torch then
does. The others need pipetrace's executor (deadlock, swap-order reorder its steps) or its
wire (drop-recv, extra-send, shape-mismatch, slow-link), which torch's runtime does not have:
`pipetrace.runtime.fault_spec.resolve_faults` refuses them before any rank starts.

A resolved fault names a rank, a training step and a step of the plan; its target is found
again here in the plan torch executes (`pipetrace.torch_pipelining.plan.plan_of`), whose
stages and micro-batches are numbered as pipetrace's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pipetrace.runtime.faults import Crash, DropSend, Fault, Hang, Straggler
from pipetrace.runtime.inject import injected_hang
from pipetrace.schedule.ir import Plan, StepKind
from pipetrace.torch_pipelining.instrument import stages_of

# The stage method a compute step of each kind is performed by.
_COMPUTE = {
    StepKind.F: "forward_one_chunk",
    StepKind.B: "backward_one_chunk",
    StepKind.I: "backward_one_chunk",
    StepKind.W: "backward_weight_one_chunk",
}
_SENDS = {StepKind.SEND_F: "get_fwd_send_ops", StepKind.SEND_B: "get_bwd_send_ops"}

# (chunk_id, the wrapped call) -> what the method returns
Hook = Callable[[int, Callable[[], Any]], Any]


class Iterations:
    """Counts ``schedule.step`` calls (from 0, as the trace's ``it``)."""

    def __init__(self, schedule: Any) -> None:
        self.current = -1
        step = schedule.step

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.current += 1
            return step(*args, **kwargs)

        schedule.step = counted


def arm_faults(faults: tuple[Fault, ...], schedule: Any, plan: Plan, rank: int) -> None:
    """Arm this rank's faults on ``schedule``'s stages (call before `record`)."""
    mine = [fault for fault in faults if fault.rank == rank]
    if not mine:
        return
    iterations = Iterations(schedule)
    stages = {stage.stage_index: stage for stage in stages_of(schedule)}
    for fault in mine:
        if isinstance(fault, Crash | Hang):
            target = fault.target(plan)
            strike = _strike(fault, iterations)
            _wrap(stages[target.stage], _COMPUTE[target.kind], strike)
        elif isinstance(fault, Straggler):
            slow = _slow(fault, iterations)
            for name in sorted({_COMPUTE[kind] for kind in fault.kinds}):
                for stage in stages.values():
                    _wrap(stage, name, slow)
        elif isinstance(fault, DropSend):
            target = fault.target(plan)
            _wrap(stages[target.stage], _SENDS[target.kind], _drop(fault, iterations))
        else:  # resolve_faults refuses every other kind on this runtime
            raise AssertionError(f"--inject {fault.KIND} cannot be armed on torch's runtime")


def _wrap(stage: Any, name: str, hook: Hook) -> None:
    method = getattr(stage, name)

    def wrapped(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        return hook(chunk_id, lambda: method(chunk_id, *args, **kwargs))

    setattr(stage, name, wrapped)


def _strike(fault: Crash | Hang, iterations: Iterations) -> Hook:
    """crash / hang: raise, or never return, at the start of the target's call."""

    def hook(chunk_id: int, call: Callable[[], Any]) -> Any:
        if iterations.current == fault.step and chunk_id == fault.microbatch:
            if isinstance(fault, Hang):
                injected_hang()
            raise RuntimeError(f"injected crash (--inject {fault.spec})")
        return call()

    return hook


def _slow(fault: Straggler, iterations: Iterations) -> Hook:
    """straggler: after each call, sleep (factor - 1) times its duration."""
    extra = (fault.factor or 1.0) - 1.0

    def hook(chunk_id: int, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = call()
        if iterations.current >= (fault.step or 0):
            time.sleep((time.perf_counter() - start) * extra)
        return result

    return hook


def _drop(fault: DropSend, iterations: Iterations) -> Hook:
    """drop-send: the message's ops are made but never handed to torch (nothing posted)."""

    def hook(chunk_id: int, call: Callable[[], Any]) -> Any:
        ops = call()
        if iterations.current == fault.step and chunk_id == fault.microbatch:
            return []
        return ops

    return hook
