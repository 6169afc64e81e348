"""The parity check on MindSpore: does the pipeline compute what one MindSpore process would?

As `pipetrace.runtime.parity` (same measure, same tolerance, same `ParityReport`): after the
first training step each rank runs the whole model on the whole batch in one process and
compares the gradient of each parameter it holds, the rank holding the last stage also the
loss. Errors are ``max|g - g_ref| / max|g_ref|`` per parameter; the demo runs in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from pipetrace.runtime.results import ParityReport

if TYPE_CHECKING:
    from mindspore import Parameter, Tensor, nn

TOLERANCE = 1e-5  # as pipetrace.runtime.parity.TOLERANCE (which imports torch)


def relative_error(value: np.ndarray, reference: np.ndarray) -> float:
    value = np.asarray(value, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    if value.shape != reference.shape:
        return float("inf")
    if not reference.size:
        return 0.0
    scale = float(np.abs(reference).max())
    diff = float(np.abs(value - reference).max())
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def reference_gradients(
    model: nn.Cell,
    inputs: Tensor,
    targets: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> tuple[float, dict[str, np.ndarray]]:
    """The loss and every parameter's gradient (by parameter name) of one single-process
    step on the whole batch."""
    import mindspore as ms

    params = model.trainable_params()

    def loss_of(x: Tensor, y: Tensor) -> Tensor:
        return loss_fn(model(x), y)

    loss, grads = ms.value_and_grad(loss_of, grad_position=None, weights=params)(inputs, targets)
    return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(params, grads)}


def compare(
    *,
    rank: int,
    stage_gradients: dict[int, Iterable[tuple[Parameter, Tensor | None]]],
    loss: float | None,
    reference_loss: float,
    reference_grads: dict[str, np.ndarray],
    tolerance: float = TOLERANCE,
) -> ParityReport:
    """Compare this rank's stage gradients (and loss, if it has one) with the reference."""
    report = ParityReport(rank, tolerance)
    if loss is not None:
        report.add("loss", relative_error(np.float64(loss), np.float64(reference_loss)))
    for stage, pairs in sorted(stage_gradients.items()):
        for param, grad in pairs:
            what = f"gradient of {param.name} (stage {stage})"
            if grad is None:
                report.add(what + " (missing)", float("inf"))
                continue
            report.add(what, relative_error(grad.asnumpy(), reference_grads[param.name]))
    return report
