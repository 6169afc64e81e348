"""One rank's iteration of a single-stage schedule (GPipe, 1F1B) replayed against a fake
stage: the calls torch's loop makes into the stage and into ``_batch_p2p``, in the order of
the plan the adapter records, with no model and no process group.

What the adapter's hooks cost per iteration is otherwise hidden in the noise of a real
4-rank run on a shared 2-core machine (bench/bench_torch_pipelining.py measures both); the
tests use the same replay to check what one iteration records without starting ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pipetrace.schedule.ir import Step, StepKind
from pipetrace.torch_pipelining.messages import OP_SOURCES

# step kind -> the stage method torch's loop calls for it
_OPS_METHOD = {kind: name for name, (kind, _channel) in OP_SOURCES.items()}
_NEIGHBOUR = {StepKind.RECV_F: -1, StepKind.SEND_B: -1, StepKind.SEND_F: 1, StepKind.RECV_B: 1}


@dataclass(frozen=True, slots=True)
class FakeOp:
    """What the adapter reads of a ``P2POp``."""

    tensor: Any
    group_peer: int


class FakeWork:
    """A ``Work`` that has completed."""

    __slots__ = ()

    def wait(self, timeout: Any = None) -> bool:
        return True


class FakeStage:
    """A ``PipelineStage`` as a single-stage schedule's loop uses it: one op per message
    (a ``shape`` float tensor to or from the neighbouring stage), compute that does nothing.
    Its group is this process alone (rank = stage index, size 1), so recording it starts
    no clock exchange."""

    def __init__(self, stage_index: int, num_stages: int, shape: tuple[int, ...]) -> None:
        import torch

        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_rank = stage_index
        self.group_size = 1
        self.group = None
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.device = torch.device("cpu")
        self._tensor = torch.zeros(shape)
        self.has_backward = True

    def _ops(self, kind: StepKind) -> list[FakeOp]:
        peer = self.stage_index + _NEIGHBOUR[kind]
        return [FakeOp(self._tensor, peer)] if 0 <= peer < self.num_stages else []

    def get_fwd_recv_ops(self, chunk_id: int) -> list[FakeOp]:
        return self._ops(StepKind.RECV_F)

    def get_bwd_recv_ops(self, chunk_id: int) -> list[FakeOp]:
        return self._ops(StepKind.RECV_B)

    def get_fwd_send_ops(self, chunk_id: int) -> list[FakeOp]:
        return self._ops(StepKind.SEND_F)

    def get_bwd_send_ops(self, chunk_id: int) -> list[FakeOp]:
        return self._ops(StepKind.SEND_B)

    def forward_one_chunk(self, chunk_id: int, *args: Any, **kwargs: Any) -> None:
        return None

    def backward_one_chunk(self, chunk_id: int, *args: Any, **kwargs: Any) -> None:
        return None

    def backward_weight_one_chunk(self, chunk_id: int, *args: Any, **kwargs: Any) -> None:
        return None

    def perform_reduce_grad(self, *args: Any, **kwargs: Any) -> None:
        return None


def fake_schedule(schedule_class: str, stage: FakeStage, microbatches: int) -> Any:
    """A real torch single-stage schedule object over ``stage`` (what the adapter checks and
    reads), whose ``step`` replays its plan (`replay_iteration`) instead of running torch's
    loop, and whose ``eval`` (torch's, calling ``step``) replays it too."""
    from torch.distributed.pipelining import schedules

    from pipetrace.torch_pipelining.plan import plan_of

    schedule = getattr(schedules, schedule_class)(
        stage, n_microbatches=microbatches, loss_fn=_no_loss
    )
    steps = plan_of(schedule).steps(stage.group_rank)
    schedule.step = lambda *args, **kwargs: replay_iteration(stage, steps)
    return schedule


def _no_loss(output: Any, target: Any) -> None:
    """A training schedule's loss function (one built without is forward-only, and is not
    recorded); the replay never calls it."""
    return None


@contextmanager
def fake_p2p() -> Iterator[None]:
    """``_batch_p2p`` answers every op with a completed `FakeWork` while the block runs (the
    adapter, installed inside the block, wraps this one)."""
    from torch.distributed.pipelining import schedules

    real = schedules._batch_p2p
    schedules._batch_p2p = _fake_batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = real


def _fake_batch_p2p(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
    return [FakeWork() for _ in p2p_ops]


def replay_iteration(stage: FakeStage, steps: list[Step]) -> None:
    """The calls of one iteration, as torch's loop makes them: consecutive message steps are
    one ``_batch_p2p`` call (their ops made first, then waited), each compute step one call
    of its stage method; methods and ``_batch_p2p`` are looked up at each call, as torch
    does, so that the adapter's patches are what runs."""
    from torch.distributed.pipelining import schedules

    batch: list[Any] = []
    for step in steps:
        if step.is_comm:
            batch += getattr(stage, _OPS_METHOD[step.kind])(step.microbatch)
            continue
        if batch:
            schedules._wait_batch_p2p(schedules._batch_p2p(batch))
            batch = []
        _COMPUTE_CALLS[step.kind](stage, step.microbatch)
    if batch:
        schedules._wait_batch_p2p(schedules._batch_p2p(batch))


_COMPUTE_CALLS: dict[StepKind, Callable[[FakeStage, int | None], Any]] = {
    StepKind.F: lambda stage, mb: stage.forward_one_chunk(mb, (), {}),
    StepKind.B: lambda stage, mb: stage.backward_one_chunk(mb, loss=None, last_backward=False),
    StepKind.REDUCE_GRAD: lambda stage, mb: stage.perform_reduce_grad(),
}
