"""The plan torch will execute, as pipetrace's `Plan` (so meta.json carries it and plan
divergence and the ideal timeline work on torch runs).

Two sources:

- `_PipelineScheduleRuntime` and its subclasses (Interleaved1F1B, LoopedBFS,
  InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, a CSV-loaded runtime) execute
  ``pipeline_order_with_comms[rank]`` action by action: that list, each action's text parsed
  by the step IR, is the plan.
- `ScheduleGPipe` and `Schedule1F1B` run their own loops in ``_step_microbatches``; their
  ``pipeline_order`` has no messages and not the order the loops post them in. The orders
  below follow those loops (torch 2.13) step for step, including which sends and recvs one
  ``_batch_p2p`` call carries together (consecutive SEND/RECV steps).
"""

from __future__ import annotations

from typing import Any

from pipetrace.schedule.ir import Plan, ScheduleError, Step, StepKind, parse_step


class UnsupportedSchedule(ScheduleError):
    """A schedule object whose execution order the adapter does not know."""


def _step(kind: StepKind, stage: int, mb: int | None = None) -> Step:
    return Step(kind, stage, mb)


# Message kinds -> the end of the pipeline that has no such message (the first stage
# receives no activations and sends no input gradient; the last the reverse).
_NO_PEER_AT = {
    StepKind.RECV_F: "first",
    StepKind.SEND_B: "first",
    StepKind.SEND_F: "last",
    StepKind.RECV_B: "last",
}


class _Order:
    """Appends a single-stage rank's steps; messages to or from a missing neighbour are left
    out, as torch's ``get_*_ops`` return no ops for them."""

    def __init__(self, stage: int, num_stages: int) -> None:
        self.stage = stage
        self.ends = {"first": stage == 0, "last": stage == num_stages - 1}
        self.steps: list[Step] = []

    def message(self, kind: StepKind, mb: int) -> None:
        if not self.ends[_NO_PEER_AT[kind]]:
            self.steps.append(_step(kind, self.stage, mb))

    def compute(self, kind: StepKind, mb: int | None = None) -> None:
        self.steps.append(_step(kind, self.stage, mb))


def gpipe_order(stage: int, num_stages: int, num_microbatches: int) -> list[Step]:
    """`ScheduleGPipe._step_microbatches`: all forwards, then all backwards."""
    order = _Order(stage, num_stages)
    for mb in range(num_microbatches):
        order.message(StepKind.RECV_F, mb)
        order.compute(StepKind.F, mb)
        order.message(StepKind.SEND_F, mb)
    for mb in range(num_microbatches):
        order.message(StepKind.RECV_B, mb)
        order.compute(StepKind.B, mb)
        order.message(StepKind.SEND_B, mb)
    order.compute(StepKind.REDUCE_GRAD)
    return order.steps


def one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> list[Step]:
    """`Schedule1F1B._step_microbatches`: warm-up forwards (the last one's send held back),
    then backward/forward pairs whose sends ride in one batch with the next recv, then the
    cool-down backwards."""
    order = _Order(stage, num_stages)
    warmup = min(num_microbatches, num_stages - stage)
    fwd = bwd = 0
    for k in range(warmup):
        order.message(StepKind.RECV_F, fwd)
        order.compute(StepKind.F, fwd)
        if k != warmup - 1:
            order.message(StepKind.SEND_F, fwd)
        fwd += 1
    while True:
        order.message(StepKind.SEND_F, fwd - 1)  # batched with the next recv_b
        order.message(StepKind.RECV_B, bwd)
        order.compute(StepKind.B, bwd)
        bwd += 1
        if fwd == num_microbatches:
            break
        order.message(StepKind.SEND_B, bwd - 1)  # batched with the next recv_f
        order.message(StepKind.RECV_F, fwd)
        order.compute(StepKind.F, fwd)
        fwd += 1
    order.message(StepKind.SEND_B, bwd - 1)
    while bwd < num_microbatches:
        order.message(StepKind.RECV_B, bwd)
        order.compute(StepKind.B, bwd)
        order.message(StepKind.SEND_B, bwd)
        bwd += 1
    order.compute(StepKind.REDUCE_GRAD)
    return order.steps


def plan_of(schedule: Any) -> Plan:
    """The whole plan (every rank) of a torch schedule object."""
    from torch.distributed.pipelining import schedules

    if isinstance(schedule, schedules._PipelineScheduleRuntime):
        return _runtime_plan(schedule)
    for cls, order in (
        (schedules.ScheduleGPipe, gpipe_order),
        (schedules.Schedule1F1B, one_f_one_b_order),
    ):
        if isinstance(schedule, cls):
            num_stages = schedule._num_stages
            microbatches = schedule._n_microbatches
            return Plan(
                microbatches,
                tuple(range(num_stages)),
                [order(stage, num_stages, microbatches) for stage in range(num_stages)],
                name=type(schedule).__name__,
                params=_params(schedule, num_stages, 1),
            )
    raise UnsupportedSchedule(
        f"{type(schedule).__name__}: pipetrace records ScheduleGPipe, Schedule1F1B and "
        "_PipelineScheduleRuntime schedules (Interleaved1F1B, LoopedBFS, "
        "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, CSV-loaded)"
    )


def _runtime_plan(schedule: Any) -> Plan:
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if not order:
        raise UnsupportedSchedule(
            f"{type(schedule).__name__} has no plan with messages yet: load its CSV "
            "(or build it) before recording"
        )
    num_ranks = schedule.pp_group_size
    mapping = schedule.stage_index_to_group_rank
    placement = tuple(mapping[stage] for stage in range(len(mapping)))
    ranks: list[list[Step | None]] = [
        [parse_step(str(action)) for action in order.get(rank, [])] for rank in range(num_ranks)
    ]
    return Plan(
        schedule._n_microbatches,
        placement,
        ranks,
        name=type(schedule).__name__,
        params=_params(schedule, len(placement), len(placement) // max(num_ranks, 1)),
    )


def _params(schedule: Any, num_stages: int, stages_per_rank: int) -> dict[str, object]:
    return {
        "runtime": "torch.distributed.pipelining",
        "n_microbatches": schedule._n_microbatches,
        "num_stages": num_stages,
        "stages_per_rank": stages_per_rank,
    }
