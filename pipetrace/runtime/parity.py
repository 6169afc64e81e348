"""The parity check: does the pipeline compute what one process would?

After the first training step, every rank runs the whole model on the whole batch in a
single process (it is small) and compares the gradient of each parameter it holds, and the
rank holding the last stage compares the loss. The error measure is relative to the size
of the reference: ``max|g - g_ref| / max|g_ref|`` per parameter (so tiny individual entries
cannot blow it up) and ``|loss - loss_ref| / |loss_ref|``. The tolerance is 1e-5; the demo
runs in float64, where a correct pipeline lands near 1e-15.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipetrace.runtime.results import ParityReport

TOLERANCE = 1e-5


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    value = value.detach().to(torch.float64)
    reference = reference.detach().to(torch.float64)
    if value.shape != reference.shape:
        return float("inf")
    scale = reference.abs().max().item() if reference.numel() else 0.0
    diff = (value - reference).abs().max().item() if reference.numel() else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def reference_gradients(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and every parameter's gradient of one single-process step (``model`` is
    used up: its gradients are overwritten)."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def compare(
    *,
    rank: int,
    stage_modules: dict[int, torch.nn.Module],
    loss: float | None,
    reference_loss: torch.Tensor,
    reference_grads: dict[str, torch.Tensor],
    tolerance: float = TOLERANCE,
) -> ParityReport:
    """Compare this rank's stage gradients (and loss, if it has one) with the reference.

    Parameter names in ``stage_modules`` must match the full model's (see `split`). Sharded
    (FSDP) gradients are gathered first, which is a collective over their replicas.
    """
    report = ParityReport(rank, tolerance)
    if loss is not None:
        report.add("loss", relative_error(torch.tensor(loss, dtype=torch.float64), reference_loss))
    for stage, module in sorted(stage_modules.items()):
        for name, param in module.named_parameters():
            what = f"gradient of {name} (stage {stage})"
            grad = param.grad
            if grad is None:
                report.add(what + " (missing)", float("inf"))
                continue
            if hasattr(grad, "full_tensor"):  # a DTensor shard under FSDP
                grad = grad.full_tensor()
            report.add(what, relative_error(grad, reference_grads[name]))
    return report
