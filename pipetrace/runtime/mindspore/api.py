"""The public API for MindSpore scripts: run your own cells with a pipeline schedule.

The MindSpore twin of `pipetrace.runtime.api` (same plans, executor, recorder hooks and
custom step functions). Each process runs the same script, as a MindSpore worker (started by
``pipetrace run --backend mindspore``, by ``msrun``, or with MindSpore's MS_* variables)::

    import mindspore as ms
    from pipetrace.runtime.mindspore.api import PipelineRunner

    model = build_model()                        # nn.SequentialCell, same init on every rank
    with PipelineRunner(model, schedule="1f1b", num_microbatches=8, loss_fn=my_loss) as runner:
        for inputs, targets in data:
            loss = runner.step(inputs, targets)  # float on the last stage's rank, else None
            optimizer(runner.gradients())        # any optimizer over runner.parameters()
            runner.zero_grad()

MindSpore parameters carry no ``.grad``: the runner accumulates gradients per parameter
(`gradients`, aligned with `parameters`) until `zero_grad`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pipetrace.recorder.hooks import RecorderHooks
from pipetrace.recorder.setup import RecordSettings, mindspore_recorder
from pipetrace.runtime import fsdp
from pipetrace.runtime.executor import Executor, StepContext
from pipetrace.runtime.mindspore.p2p import MindSporeP2P, PendingRecv, TensorMeta, fix_default_group
from pipetrace.runtime.mindspore.stage import LossFn, MindSporeStage, enable_grad_on_this_thread
from pipetrace.runtime.runner import RunnerBase, resolve_plan, split_batch
from pipetrace.schedule.ir import Plan

if TYPE_CHECKING:
    from mindspore import Parameter, Tensor, nn

__all__ = ["MindSporeOps", "PipelineRunner", "StepContext", "TensorMeta", "init_cluster"]

Batch = Any  # a Tensor, a sequence of M Tensors, or None

TIMEOUT_ENV = "MS_CPU_COMM_OP_TIMEOUT"


class MindSporeOps:
    """`pipetrace.runtime.executor.FrameworkOps` for MindSpore."""

    pending_type = PendingRecv

    def mean_loss(self, losses: Iterable[Tensor]) -> float:
        return float(np.mean([float(loss.asnumpy()) for loss in losses]))

    def thread_initializer(self) -> Callable[[], None]:
        return enable_grad_on_this_thread

    def fsdp_steps(self, stages: dict[int, Any]) -> fsdp.FsdpSteps:
        return fsdp.FsdpSteps({})  # FSDP is torch's: the FSDP steps are no-ops here


def init_cluster(*, timeout: float = 60.0) -> tuple[int, int]:
    """Join the MindSpore cluster (``mindspore.communication.init()``, mccl on CPU) unless
    the script did, make P2P usable on CPU (`fix_default_group`), and return (rank, world
    size). ``timeout`` bounds a P2P wait on a peer (seconds; MS_CPU_COMM_OP_TIMEOUT, read by
    MindSpore when the group is made, so it only applies if this call makes it)."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank, init

    if not GlobalComm.INITED:
        os.environ.setdefault(TIMEOUT_ENV, str(max(1, round(timeout))))
        init()
    fix_default_group()
    return get_rank(), get_group_size()


class PipelineRunner(RunnerBase):
    """This rank's part of a pipeline on MindSpore: its stages, its plan, its messages.

    ``model`` is the whole model as an ``nn.SequentialCell`` (split into the plan's stages,
    cells keeping their names), a sequence with one cell per stage, or a mapping
    ``{stage: cell}`` of only this rank's stages. ``schedule`` is a built-in name (with
    ``num_microbatches``) or a `Plan`. The pipeline is the whole MindSpore world: plan ranks
    are MindSpore ranks. ``tensor_meta`` gives message shapes up front (same on every rank).

    The last stage backpropagates ``loss_fn(output, target) / M`` for each micro-batch, so
    after `step` the gradients are those of the mean loss over the whole batch.
    """

    def __init__(
        self,
        model: nn.SequentialCell | Sequence[nn.Cell] | Mapping[int, nn.Cell],
        *,
        schedule: str | Plan,
        loss_fn: LossFn,
        num_microbatches: int | None = None,
        stages_per_rank: int | None = None,
        overlap_p2p: bool = False,
        recorder: RecorderHooks | None = None,
        tensor_meta: dict[tuple[str, int], TensorMeta] | None = None,
        timeout: float = 60.0,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        import mindspore as ms

        self.rank, world_size = init_cluster(timeout=timeout)
        self.plan = resolve_plan(schedule, world_size, num_microbatches, stages_per_rank)
        cells = _stage_cells(model, self.plan, self.rank)
        num_stages = self.plan.num_stages
        self.stages = {
            index: MindSporeStage(
                cell,
                stage_index=index,
                num_stages=num_stages,
                loss_fn=loss_fn if index == num_stages - 1 else None,
            )
            for index, cell in cells.items()
        }
        if recorder is None:  # PIPETRACE_DIR=run/ turns recording on in a user's script
            recorder = mindspore_recorder(RecordSettings.from_env())
        self.recorder: RecorderHooks = recorder
        p2p = None
        if any(step.is_comm for step in self.plan.steps(self.rank)):
            p2p = MindSporeP2P(
                num_stages=num_stages, recorder=recorder, overlap=overlap_p2p, known=tensor_meta
            )
        self.executor = Executor(
            plan=self.plan,
            rank=self.rank,
            stages=self.stages,
            p2p=p2p,
            recorder=recorder,
            ops=MindSporeOps(),
        )
        self._failure: BaseException | None = None
        self._closed = False
        config = {
            "overlap_p2p": overlap_p2p,
            "device": ms.get_context("device_target"),
            **(run_config or {}),
        }
        recorder.begin_run(rank=self.rank, world_size=world_size, plan=self.plan, config=config)

    @property
    def stage_modules(self) -> dict[int, nn.Cell]:
        """The cells of the stages this rank holds, by stage index."""
        return {index: stage.module for index, stage in self.stages.items()}

    def parameters(self) -> Iterator[Parameter]:
        """This rank's trainable parameters (give them to the optimizer)."""
        for stage in self.stages.values():
            yield from stage.params

    def gradients(self) -> tuple[Tensor, ...]:
        """The accumulated gradients, aligned with `parameters` (zeros where none yet)."""
        from mindspore import ops

        return tuple(
            ops.zeros_like(param) if grad is None else grad
            for stage in self.stages.values()
            for param, grad in zip(stage.params, stage.grads)
        )

    def named_gradients(self) -> dict[int, list[tuple[Parameter, Tensor | None]]]:
        """Stage -> (parameter, accumulated gradient or None) pairs."""
        return {index: list(zip(stage.params, stage.grads)) for index, stage in self.stages.items()}

    def zero_grad(self) -> None:
        for stage in self.stages.values():
            stage.zero_grad()

    def _split(self, batch: Batch, num: int, what: str) -> Sequence[Tensor] | None:
        from mindspore import Tensor, ops

        return split_batch(batch, num, what, tensor_type=Tensor, split=ops.split)


def _stage_cells(model: Any, plan: Plan, rank: int) -> dict[int, nn.Cell]:
    from mindspore import nn

    from pipetrace.runtime.mindspore.split import split_sequential, stages_of_rank

    if isinstance(model, nn.SequentialCell):
        return stages_of_rank(split_sequential(model, plan.num_stages), plan, rank)
    if isinstance(model, Mapping):
        expected = plan.stages_of(rank)
        if sorted(model) != expected:
            raise ValueError(f"rank {rank} holds stages {expected}; got cells for {sorted(model)}")
        return dict(model)
    if isinstance(model, nn.Cell):
        raise TypeError("give a whole model as nn.SequentialCell, or one cell per stage")
    return stages_of_rank(list(model), plan, rank)
