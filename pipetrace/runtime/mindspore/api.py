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

from typing import TYPE_CHECKING, Any

from pipetrace.runtime import runner
from pipetrace.runtime.executor import StepContext
from pipetrace.runtime.mindspore.backend import (
    MindSporeBackend,
    accumulated_gradients,
    init_cluster,
)
from pipetrace.runtime.mindspore.p2p import TensorMeta

if TYPE_CHECKING:
    from mindspore import Parameter, Tensor

__all__ = ["PipelineRunner", "StepContext", "TensorMeta", "init_cluster"]


class PipelineRunner(runner.PipelineRunner):
    """`pipetrace.runtime.runner.PipelineRunner` on MindSpore: ``model`` is an
    ``nn.SequentialCell`` (cells keep their names), a sequence of cells, or ``{stage: cell}``;
    the keyword arguments are the base class's (``schedule``, ``loss_fn``, ...). The pipeline
    is the whole MindSpore world: plan ranks are MindSpore ranks."""

    def __init__(self, model: Any, **options: Any) -> None:
        super().__init__(MindSporeBackend(), model, **options)

    def gradients(self) -> tuple[Tensor, ...]:
        """The accumulated gradients, aligned with `parameters` (zeros where none yet)."""
        return accumulated_gradients(self.stages.values())  # type: ignore[arg-type]

    def named_gradients(self) -> dict[int, list[tuple[Parameter, Tensor | None]]]:
        """Stage -> (parameter, accumulated gradient or None) pairs."""
        return {
            index: list(zip(stage.params, stage.grads))  # type: ignore[attr-defined]
            for index, stage in self.stages.items()
        }

    def zero_grad(self) -> None:
        for stage in self.stages.values():
            stage.zero_grad()  # type: ignore[attr-defined]
