"""The parity check: does the pipeline compute what one process would? One check for every
backend, on numpy arrays (the backend reads its tensors: `pipetrace.runtime.backend`).

After the first training step, every rank runs the whole model on the whole batch in a
single process (it is small) and compares the gradient of each parameter it holds, and the
rank holding the last stage compares the loss. The error measure is relative to the size
of the reference: ``max|g - g_ref| / max|g_ref|`` per parameter (so tiny individual entries
cannot blow it up) and ``|loss - loss_ref| / |loss_ref|``. The tolerance is 1e-5; the demo
runs in float64, where a correct pipeline lands near 1e-15.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from pipetrace.runtime.results import ParityReport

if TYPE_CHECKING:
    from pipetrace.runtime.backend import LossFn
    from pipetrace.runtime.runner import PipelineRunner

TOLERANCE = 1e-5


def relative_error(value: Any, reference: Any) -> float:
    """``max|value - reference| / max|reference|`` (inf when the shapes differ)."""
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


def compare(
    *,
    rank: int,
    gradients: Mapping[int, Iterable[tuple[str, Any]]],
    loss: float | None,
    reference_loss: float,
    reference_grads: Mapping[str, Any],
    tolerance: float = TOLERANCE,
) -> ParityReport:
    """Compare this rank's stage gradients (stage -> (parameter name, array or None)) and
    loss, if it has one, with the reference. Parameter names must be the full model's (see
    `pipetrace.runtime.split`)."""
    report = ParityReport(rank, tolerance)
    if loss is not None:
        report.add("loss", relative_error(loss, reference_loss))
    for stage, pairs in sorted(gradients.items()):
        for name, grad in pairs:
            what = f"gradient of {name} (stage {stage})"
            if grad is None:
                report.add(what + " (missing)", float("inf"))
                continue
            report.add(what, relative_error(grad, reference_grads[name]))
    return report


def check(
    runner: PipelineRunner,
    reference: Any,
    inputs: Any,
    targets: Any,
    *,
    loss: float | None,
    loss_fn: LossFn,
    rank: int | None = None,
    tolerance: float = TOLERANCE,
) -> ParityReport:
    """Compare ``runner``'s gradients and ``loss`` of the step just run on ``inputs`` and
    ``targets`` (before the optimizer step) with one single-process step of ``reference``, a
    copy of the whole model with the same weights (used up). ``rank`` names the process in
    the report (default: the runner's pipeline rank). Every rank must call this: gathering
    sharded gradients is a collective."""
    backend = runner.backend
    reference_loss, reference_grads = backend.reference_gradients(
        reference, inputs, targets, loss_fn
    )
    return compare(
        rank=runner.rank if rank is None else rank,
        gradients=backend.stage_gradients(runner.stages),
        loss=loss,
        reference_loss=reference_loss,
        reference_grads=reference_grads,
        tolerance=tolerance,
    )
