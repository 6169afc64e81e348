"""What every backend's `PipelineRunner` shares, framework-neutral (no torch, no MindSpore).

A runner builds its stages, P2P and executor in its own backend module; this base runs
iterations through the executor, reports a failure to the recorder exactly once, and ends
the recording cleanly only when nothing failed. `split_batch` splits a batch into
micro-batches given the backend's tensor type and split function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pipetrace.recorder.hooks import RecorderHooks
from pipetrace.runtime.executor import CustomFunction, Executor
from pipetrace.schedule.builders import build_plan, resolve_schedule_name
from pipetrace.schedule.ir import Plan, StepKind
from pipetrace.schedule.lowering import lower

Batch = Any  # one tensor to split along dim 0, a sequence of M tensors, or None


class RunnerBase:
    plan: Plan
    rank: int
    stages: dict[int, Any]
    executor: Executor
    recorder: RecorderHooks
    _failure: BaseException | None = None
    _closed: bool = False

    def _split(self, batch: Batch, num: int, what: str) -> Sequence[Any] | None:
        """Split ``batch`` into ``num`` micro-batches (the backend knows its tensors)."""
        raise NotImplementedError

    def register_custom_function(self, kind: StepKind | str, fn: CustomFunction) -> None:
        """Replace the handler of a step kind with ``fn(step, context)`` (see `StepContext`)."""
        self.executor.register_custom_function(kind, fn)

    def step(self, inputs: Batch = None, targets: Batch = None) -> float | None:
        """Forward and backward of one batch, split into the plan's micro-batches along
        dim 0 (or given already split, as a sequence of M tensors). Only the rank holding
        stage 0 needs ``inputs`` and only the one holding the last stage needs ``targets``.
        Returns the mean micro-batch loss on the last stage's rank, None on the others.
        Gradients accumulate: zero them between steps."""
        try:
            num = self.plan.num_microbatches
            if inputs is None and 0 in self.stages:
                raise ValueError(f"rank {self.rank} holds stage 0: step() needs the inputs")
            return self.executor.run_iteration(
                self._split(inputs, num, "inputs") or (), self._split(targets, num, "targets")
            )
        except BaseException as exc:
            self._failure = exc
            self.recorder.exception(exc)
            raise

    def close(self) -> None:
        """Stop the overlap thread and close the recording (cleanly, if nothing failed)."""
        if self._closed:
            return
        self._closed = True
        self.executor.close()
        if self._failure is None:
            self.recorder.end_run()

    def __enter__(self) -> RunnerBase:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and self._failure is None:
            self._failure = exc
            self.recorder.exception(exc)
        self.close()


def resolve_plan(
    schedule: str | Plan, num_ranks: int, num_microbatches: int | None, stages_per_rank: int | None
) -> Plan:
    """A plan with its messages: a given plan (lowered if it has none) or a built-in one."""
    if isinstance(schedule, Plan):
        if schedule.num_ranks != num_ranks:
            raise ValueError(
                f"the plan is for {schedule.num_ranks} ranks but the group has {num_ranks}"
            )
        return schedule if schedule.has_comms() or num_ranks == 1 else lower(schedule)
    if num_microbatches is None:
        raise ValueError("give num_microbatches with a schedule name")
    return build_plan(
        resolve_schedule_name(schedule),
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        stages_per_rank=stages_per_rank,
        comms=True,
    )


def split_batch(
    batch: Batch,
    num: int,
    what: str,
    *,
    tensor_type: type,
    split: Callable[[Any, int], Sequence[Any]],
) -> Sequence[Any] | None:
    """``num`` equal micro-batches of ``batch`` (a ``tensor_type``), or ``batch`` itself when it
    is None or already a sequence of ``num`` micro-batches."""
    if batch is None or not isinstance(batch, tensor_type):
        if batch is not None and len(batch) != num:
            raise ValueError(f"{what}: expected {num} micro-batches, got {len(batch)}")
        return batch
    size, rest = divmod(batch.shape[0], num)
    if rest or not size:
        raise ValueError(
            f"{what}: a batch of {batch.shape[0]} samples does not split into {num} equal "
            "micro-batches; make the batch size a multiple of the micro-batch count"
        )
    return split(batch, size)
