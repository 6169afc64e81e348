"""One pipeline stage on MindSpore (PyNative mode): an ``nn.Cell`` chunk that runs forward,
full backward, or the backward split into its input part (I, "dx") and its weight part
(W, "dw") for one micro-batch at a time. Same interface as the torch
`pipetrace.runtime.stage.PipelineStage`, so the shared executor drives either.

**Backward ordering.** MindSpore's PyNative autodiff keeps a stack of "top cells": several
live ``ms.vjp`` closures can only be called newest-first, and calling the oldest first, which
is exactly what GPipe and 1F1B do, fails with "Can not find top cell for backward". So F runs
the cell without recording anything (grad disabled) and keeps only its input (and target);
every backward step re-runs the forward inside a gradient call (``GradOperation`` /
``ms.grad``) and takes its gradients right away, so only one top cell is ever live. Each
micro-batch's gradients come from a self-contained forward+backward of the same input with
the same weights: the same numbers a retained graph would give (the parity check against a
single-process run finds relative errors of ~1e-15 in float64). The cost is one extra
forward per micro-batch.

**I and W.** Nothing of a backward survives between two steps, so a W of its own would
re-run the forward a second time. Measured on 2 x Dense(2048) + Tanh, 512 samples, float32:
forward 36 ms, dx-only re-run 77 ms, dw-only re-run 93 ms, both in one re-run 108 ms. So I
computes dx and dw in one re-run and keeps dw, and W adds it to the accumulated gradients:
I + W cost one B (108 ms instead of 170), at the price of an I that is 40 % longer than a
dx-only one. Traces of zero-bubble schedules on MindSpore therefore show heavy I and light W
steps. On stage 0, which has no dx to send, I only keeps the output gradient and W does the
whole backward. Either way I + W give the same gradients as B, bit for bit.

**Gradients.** MindSpore parameters carry no ``.grad``: each stage accumulates its
parameters' gradients itself (`grads`, aligned with `params`) across micro-batches and
iterations until `zero_grad`; the runner hands them to an optimizer.

**Timing and threads.** PyNative queues ops and runs them asynchronously; each compute step
waits for its own results before returning, so that the recorder's step end is when the work
is done (not when it was queued) and a failure surfaces in the step that caused it. MindSpore's
PyNative executor is one per process and not safe for concurrent cells on two threads (a
forward on one thread during a gradient call on another breaks the latter's top cell), so
compute steps of a process are serialised by one lock: an OVERLAP_F_B composite still runs
its halves on two threads, but they take turns.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipetrace.runtime.stage_base import StageBase

if TYPE_CHECKING:
    from mindspore import Parameter, Tensor, nn

LossFn = Callable[["Tensor", "Tensor"], "Tensor"]

# One PyNative executor per process: compute of every stage of the process takes turns.
COMPUTE_LOCK = threading.Lock()


def pynative_executor() -> Any:
    try:
        from mindspore.graph.api import _pynative_executor
    except ImportError:  # MindSpore < 2.9 kept it in mindspore.common.api
        from mindspore.common.api import _pynative_executor
    return _pynative_executor


def enable_grad_on_this_thread() -> None:
    """PyNative's grad switch is per thread: a thread that computes gradients sets it itself."""
    pynative_executor().set_enable_grad(True)


def restore_python_sigint() -> None:
    """Give SIGINT back to the interpreter. MindSpore (2.10) puts C handlers of its own over
    it: ``init()`` does, and its runtime does again, once, from a thread of its own some time
    after the first ops (``signal.getsignal`` still names the Python handler, which then
    never runs). Without this a Ctrl-C never reaches Python: no KeyboardInterrupt, no
    interrupt in the recording, and `pipetrace analyze` reads the SIGTERM the launcher sends
    next as the ranks killed from outside. Called after ``init()`` and at each iteration's
    start (a stage's `reset`), which catches the runtime's handler by the second."""
    handler = signal.getsignal(signal.SIGINT)
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)


@dataclass(slots=True)
class _Saved:
    """What one micro-batch keeps between its forward and its (last) backward step."""

    input: Tensor  # the stage input, for the re-run
    target: Tensor | None = None  # last stage: the loss target
    loss_scale: float = 1.0
    output_grad: Tensor | None = None  # kept by I for W on stage 0
    weight_grads: tuple[Tensor, ...] | None = None  # kept by I for W on the other stages


class MindSporeStage(StageBase):
    """A cell chunk (see `StageBase`). ``losses`` holds 0-dim tensors; ``grads`` the
    accumulated gradients of ``params``."""

    module: nn.Cell
    losses: dict[int, Tensor]
    _saved: dict[int, _Saved]

    def __init__(
        self,
        module: nn.Cell,
        *,
        stage_index: int,
        num_stages: int,
        loss_fn: LossFn | None = None,
    ) -> None:
        import mindspore as ms
        from mindspore import ops

        super().__init__(module, stage_index=stage_index, num_stages=num_stages, loss_fn=loss_fn)
        self.params: list[Parameter] = list(module.trainable_params())
        self.grads: list[Tensor | None] = [None] * len(self.params)
        self._executor = pynative_executor()
        self._loss_scale = 1.0
        weights = ms.ParameterTuple(self.params) if self.params else None
        # Gradient functions, built once. Middle stages take the output gradient as the
        # sensitivity; the last stage differentiates its scalar (scaled) loss.
        if self.is_last:
            self._grad_dx_dw = ms.grad(self._scaled_loss, grad_position=0, weights=weights)
            self._grad_dw = (
                ms.grad(self._scaled_loss, grad_position=None, weights=weights) if weights else None
            )
        else:
            if weights is None:
                self._grad_dx_dw = ops.GradOperation(get_all=True, sens_param=True)(module)
            else:
                self._grad_dx_dw = ops.GradOperation(
                    get_all=True, get_by_list=True, sens_param=True
                )(module, weights)
            self._grad_dw = (
                ops.GradOperation(get_by_list=True, sens_param=True)(module, weights)
                if weights
                else None
            )

    # -- steps -----------------------------------------------------------------------------

    def reset(self) -> None:
        super().reset()
        restore_python_sigint()

    def forward(
        self, mb: int, x: Tensor, target: Tensor | None = None, loss_scale: float = 1.0
    ) -> Tensor:
        """Run micro-batch ``mb`` (nothing is recorded for autodiff); returns the activation
        to pass on, or the loss on the last stage."""
        executor = self._executor
        with COMPUTE_LOCK:
            enabled = executor.enable_grad()
            executor.set_enable_grad(False)
            try:
                output = self.module(x)
                if self.is_last:
                    output = self.loss_fn(output, target)  # type: ignore[misc]
                executor.sync()
            finally:
                executor.set_enable_grad(enabled)
        if self.is_last:
            self.losses[mb] = output
            self._saved[mb] = _Saved(x, target, loss_scale)
        else:
            self._saved[mb] = _Saved(x)
        if self.count_saved:  # the input is all it keeps: its backward re-runs the forward
            self.held_bytes[mb] = x.nbytes
        return output

    def backward(self, mb: int, output_grad: Tensor | None) -> Tensor | None:
        """Full backward (dx and dw) of micro-batch ``mb``; returns dx (None on stage 0)."""
        saved = self._release(mb)
        dx, dw = self._gradients(saved, output_grad, dx=not self.is_first)
        self._accumulate(dw)
        return dx

    def backward_input(self, mb: int, output_grad: Tensor | None) -> Tensor | None:
        """dx of micro-batch ``mb``; its dw is computed in the same pass and kept for W.
        Stage 0 has no dx to produce: it keeps the output gradient and W does the work."""
        saved = self._saved[mb]
        if self.is_first:
            saved.output_grad = output_grad
            return None
        dx, saved.weight_grads = self._gradients(saved, output_grad, dx=True)
        return dx

    def backward_weight(self, mb: int) -> None:
        """dw of micro-batch ``mb`` (after `backward_input`), accumulated into `grads`."""
        saved = self._release(mb)
        if saved.weight_grads is None:  # stage 0: the whole backward happens here
            _, dw = self._gradients(saved, saved.output_grad, dx=False)
            self._accumulate(dw)
        else:
            self._accumulate(saved.weight_grads)

    def parameters(self) -> list[Parameter]:
        """The cell's trainable parameters (aligned with `grads`)."""
        return self.params

    def zero_grad(self) -> None:
        self.grads = [None] * len(self.params)

    # -- gradients -------------------------------------------------------------------------

    def _scaled_loss(self, x: Tensor, target: Tensor) -> Tensor:
        loss = self.loss_fn(self.module(x), target)  # type: ignore[misc]
        if self._loss_scale == 1.0:
            return loss
        from mindspore import Tensor

        # a Python float multiplier is rounded to float32, even for a float64 loss: 1/M off
        # by 1.5e-8 relative for M = 5 (the gradients of every M that is no power of two)
        return loss * Tensor(self._loss_scale, loss.dtype)

    def _gradients(
        self, saved: _Saved, output_grad: Tensor | None, *, dx: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        """Re-run the forward of ``saved.input`` and return (dx or None, dw)."""
        executor = self._executor
        with COMPUTE_LOCK:
            enabled = executor.enable_grad()
            executor.set_enable_grad(True)
            try:
                if self.is_last:
                    self._loss_scale = saved.loss_scale
                    args = (saved.input, saved.target)
                else:
                    args = (saved.input, output_grad)
                if dx or self._grad_dw is None:
                    result = self._grad_dx_dw(*args)
                    input_grad, weight_grads = _split_result(
                        result, self.is_last, bool(self.params)
                    )
                else:
                    input_grad, weight_grads = None, tuple(self._grad_dw(*args))
                executor.sync()
            finally:
                executor.set_enable_grad(enabled)
        return (input_grad if dx else None), weight_grads

    def _accumulate(self, weight_grads: tuple[Tensor, ...]) -> None:
        grads = self.grads
        for index, grad in enumerate(weight_grads):
            held = grads[index]
            grads[index] = grad if held is None else held + grad


def _split_result(result: Any, is_last: bool, has_params: bool) -> tuple[Any, tuple[Any, ...]]:
    """(dx, dw) from what a gradient function returned (the shapes differ by API)."""
    if not has_params:  # GradOperation(get_all) -> (dx,); ms.grad(position 0) -> dx
        return (result if is_last else result[0]), ()
    input_grads, weight_grads = result  # ms.grad -> (dx, dw); GradOperation -> ((dx,), dw)
    return (input_grads if is_last else input_grads[0]), tuple(weight_grads)
