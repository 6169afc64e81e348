"""The FSDP steps (UNSHARD, RESHARD, REDUCE_GRAD) on stages sharded with torch FSDP2.

A stage is sharded when its module (or a submodule) went through ``fully_shard``; on any
other stage the three steps are no-ops. Within an iteration the micro-batch backwards only
accumulate unsharded gradients (no gradient sync, no reshard after backward); REDUCE_GRAD,
placed after the stage's last B or W, then reduce-scatters them once. FSDP2 has no public call
that reduces gradients outside an autograd backward, so REDUCE_GRAD uses the same FSDP
internals torch.distributed.pipelining uses for this (checked on torch 2.13).

torch.distributed.fsdp is never imported here: if nothing imported it, no module can be
sharded, and the runtime pays nothing.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from pipetrace.schedule.ir import Step

if TYPE_CHECKING:
    from pipetrace.runtime.stage import PipelineStage


class FsdpSteps:
    """Handlers for the FSDP step kinds over one rank's stages."""

    def __init__(self, stages: dict[int, PipelineStage]) -> None:
        self._sharded: dict[int, list[Any]] = {}
        fsdp = sys.modules.get("torch.distributed.fsdp")
        if fsdp is not None:
            for index, stage in stages.items():
                modules = [m for m in stage.module.modules() if isinstance(m, fsdp.FSDPModule)]
                if modules:
                    self._sharded[index] = modules
        self.pending: dict[int, list[Any]] = {}  # stage -> unshard handles not yet waited

    def begin_iteration(self) -> None:
        for modules in self._sharded.values():
            for module in modules:
                module.set_requires_gradient_sync(False, recurse=False)
                module.set_reshard_after_backward(False, recurse=False)
                module.set_is_last_backward(False)

    def wait_unshard(self, stage: int) -> None:
        """Called before compute on ``stage`` while unshards are in flight."""
        for handle in self.pending.pop(stage, ()):
            handle.wait()

    def unshard(self, position: int, step: Step) -> None:
        modules = self._sharded.get(step.stage)  # type: ignore[arg-type]
        if modules:
            self.pending[step.stage] = [m.unshard(async_op=True) for m in modules]  # type: ignore[index]

    def reshard(self, position: int, step: Step) -> None:
        modules = self._sharded.get(step.stage)  # type: ignore[arg-type]
        if modules:
            self.wait_unshard(step.stage)  # type: ignore[arg-type]
            for module in modules:
                module.reshard()

    def reduce_grad(self, position: int, step: Step) -> None:
        modules = self._sharded.get(step.stage)  # type: ignore[arg-type]
        if not modules:
            return
        root = modules[0]  # modules() lists the outermost sharded module first
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
        root.set_is_last_backward(True)
        state = root._get_fsdp_state()
        for module_state in state._state_ctx.all_states:
            for param_group in module_state._fsdp_param_groups:
                param_group.post_backward()
        state._root_post_backward_final_callback()
