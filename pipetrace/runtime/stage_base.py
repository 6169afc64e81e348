"""What every backend's pipeline stage shares: its place in the pipeline, its loss function,
and the per-micro-batch state kept between a forward and its last backward step.

A backend's stage (`pipetrace.runtime.stage.PipelineStage`,
`pipetrace.runtime.mindspore.stage.MindSporeStage`) adds the four compute steps (forward,
full backward, and the backward split into dx and dw); `pipetrace.runtime.backend.Stage`
is the interface the executor drives. Framework-free.
"""

from __future__ import annotations

from typing import Any


class StageBase:
    """A module chunk at position ``stage_index`` of ``num_stages``.

    The last stage applies ``loss_fn(output, target)`` and backpropagates
    ``loss * loss_scale`` (the executor passes 1/M, so that gradients accumulated over M
    micro-batches are those of the mean loss, as with one big batch). ``losses`` holds the
    unscaled loss of each micro-batch.

    With ``count_saved`` on (the executor turns it on when its recorder samples memory) a
    stage also counts, per micro-batch, the bytes of activations it holds for that
    micro-batch's backward steps until the last of them (`held_bytes`, `saved_bytes`).
    With ``input_fixed`` on too (the executor sets it on a stage fed over P2P, whose
    streams' shapes are exchanged once and fixed for the runner's life), a stage that
    measures those bytes (the torch stage walks autograd's graph once per input shape)
    measures them at the first forward and takes them as they are after, without looking
    the input's shape up at each forward.
    """

    def __init__(
        self, module: Any, *, stage_index: int, num_stages: int, loss_fn: Any = None
    ) -> None:
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} outside 0..{num_stages - 1}")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        if self.is_last and loss_fn is None:
            raise ValueError(f"stage {stage_index} is the last stage and needs a loss_fn")
        self.loss_fn = loss_fn
        self.losses: dict[int, Any] = {}  # micro-batch -> unscaled loss (last stage)
        self._saved: dict[int, Any] = {}  # micro-batch -> what its backward steps need
        self.count_saved = False
        self.held_bytes: dict[int, int] = {}
        """Micro-batch -> the bytes its backward holds (while ``count_saved``): the executor
        sums them for a memory sample, without a call into the stage."""
        self.input_fixed = False
        self._saved_per_input: dict[Any, int] = {}  # (shape, dtype) -> bytes, once measured
        self._saved_fixed: int | None = None  # the bytes of every forward, with input_fixed

    def pending(self) -> int:
        """Micro-batches whose backward has not finished (0 after a clean iteration)."""
        return len(self._saved)

    def saved_bytes(self) -> int:
        """Bytes of activations held for pending backward steps (0 unless ``count_saved``)."""
        return sum(self.held_bytes.values())

    def _release(self, mb: int) -> Any:
        """Micro-batch ``mb``'s saved state, forgotten here: its last backward step runs."""
        self.held_bytes.pop(mb, None)
        return self._saved.pop(mb)

    def reset(self) -> None:
        """Forget per-iteration state (losses and anything an aborted iteration left)."""
        self._saved.clear()
        self.held_bytes.clear()
        self.losses.clear()
