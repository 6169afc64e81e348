"""The public API for user scripts: run your own model with a pipeline schedule.

Typical use under torchrun (each process runs the same script)::

    import torch
    from pipetrace.runtime.api import PipelineRunner

    model = torch.nn.Sequential(...)            # the whole model, same init on every rank
    runner = PipelineRunner(model, schedule="1f1b", num_microbatches=8, loss_fn=my_loss)
    optimizer = torch.optim.SGD(runner.parameters(), lr=0.1)
    for inputs, targets in data:
        loss = runner.step(inputs, targets)      # forward + backward of all micro-batches
        optimizer.step()
        optimizer.zero_grad()
    runner.close()

The process group is the one the script initialised, or, if none, one made from torchrun's
environment with gloo on CPU and NCCL on CUDA (chosen from the model's device). Multi-node
jobs are plain torchrun jobs; nothing here is specific to one machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipetrace.recorder.hooks import RecorderHooks
from pipetrace.recorder.setup import RecordSettings, torch_recorder
from pipetrace.runtime.executor import Executor, StepContext
from pipetrace.runtime.p2p import P2P, TensorMeta
from pipetrace.runtime.runner import RunnerBase, resolve_plan, split_batch
from pipetrace.runtime.split import split_sequential, stages_of_rank
from pipetrace.runtime.stage import LossFn, PipelineStage
from pipetrace.schedule.ir import Plan

__all__ = ["PipelineRunner", "StepContext", "TensorMeta", "init_distributed"]

Batch = torch.Tensor | Sequence[torch.Tensor] | None


def init_distributed(device: torch.device | str, *, timeout: float = 60.0) -> None:
    """Initialise the default process group from torchrun's environment variables
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), with NCCL for a CUDA device and gloo
    otherwise. ``timeout`` bounds how long any rank waits on a peer."""
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout),
    )


class PipelineRunner(RunnerBase):
    """This rank's part of a pipeline: its stages, its plan, its messages.

    ``model`` is the whole model as an ``nn.Sequential`` (split into the plan's stages), a
    sequence with one module per stage, or a mapping ``{stage: module}`` of only the stages
    this rank holds (so that big models need not be built whole on every rank).
    ``schedule`` is a built-in name (with ``num_microbatches``) or a `Plan`; a plan without
    messages is lowered here. ``group`` is the pipeline's process group (default: the world);
    ranks in the plan are ranks in that group. ``tensor_meta`` gives message shapes up front
    (see `P2P`); it must be the same on every rank.

    The last stage backpropagates ``loss_fn(output, target) / M`` for each micro-batch, so
    after `step` the gradients are those of the mean loss over the whole batch.
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module] | Mapping[int, torch.nn.Module],
        *,
        schedule: str | Plan,
        loss_fn: LossFn,
        num_microbatches: int | None = None,
        stages_per_rank: int | None = None,
        overlap_p2p: bool = False,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        recorder: RecorderHooks | None = None,
        tensor_meta: dict[tuple[str, int], TensorMeta] | None = None,
        timeout: float = 60.0,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        if device is None:
            device = _device_of(model)
        self.device = torch.device(device)
        if not dist.is_initialized():
            init_distributed(self.device, timeout=timeout)
        self.group = group
        self.rank = dist.get_rank(group)
        self.plan = resolve_plan(
            schedule, dist.get_world_size(group), num_microbatches, stages_per_rank
        )
        modules = _stage_modules(model, self.plan, self.rank)
        num_stages = self.plan.num_stages
        self.stages = {
            index: PipelineStage(
                module,
                stage_index=index,
                num_stages=num_stages,
                loss_fn=loss_fn if index == num_stages - 1 else None,
            )
            for index, module in modules.items()
        }
        if recorder is None:  # PIPETRACE_DIR=run/ turns recording on in a user's script
            recorder = torch_recorder(RecordSettings.from_env())
        self.recorder: RecorderHooks = recorder
        needs_p2p = any(step.is_comm for step in self.plan.steps(self.rank))
        p2p = None
        if needs_p2p:
            p2p = P2P(
                num_stages=num_stages,
                device=self.device,
                recorder=self.recorder,
                overlap=overlap_p2p,
                group=group,
                known=tensor_meta,
            )
        self.executor = Executor(
            plan=self.plan, rank=self.rank, stages=self.stages, p2p=p2p, recorder=self.recorder
        )
        self._failure: BaseException | None = None
        self._closed = False
        config = {"overlap_p2p": overlap_p2p, "device": str(self.device), **(run_config or {})}
        # Pipeline ranks (in ``group``): the plan and P2P peers speak of those.
        self.recorder.begin_run(
            rank=self.rank, world_size=dist.get_world_size(group), plan=self.plan, config=config
        )

    @property
    def stage_modules(self) -> dict[int, torch.nn.Module]:
        """The modules of the stages this rank holds, by stage index."""
        return {index: stage.module for index, stage in self.stages.items()}

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This rank's parameters (give them to the optimizer)."""
        for stage in self.stages.values():
            yield from stage.module.parameters()

    def _split(self, batch: Batch, num: int, what: str) -> Sequence[torch.Tensor] | None:
        return split_batch(batch, num, what, tensor_type=torch.Tensor, split=torch.Tensor.split)


def _device_of(model: Any) -> torch.device:
    modules = (
        model.values()
        if isinstance(model, Mapping)
        else [model]
        if isinstance(model, torch.nn.Module)
        else model
    )
    for module in modules:
        for param in module.parameters():
            return param.device
    return torch.device("cpu")


def _stage_modules(
    model: torch.nn.Module | Sequence[torch.nn.Module] | Mapping[int, torch.nn.Module],
    plan: Plan,
    rank: int,
) -> dict[int, torch.nn.Module]:
    if isinstance(model, torch.nn.Sequential):
        return stages_of_rank(split_sequential(model, plan.num_stages), plan, rank)
    if isinstance(model, Mapping):
        expected = plan.stages_of(rank)
        if sorted(model) != expected:
            raise ValueError(
                f"rank {rank} holds stages {expected}; got modules for {sorted(model)}"
            )
        return dict(model)
    if isinstance(model, torch.nn.Module):
        raise TypeError("give a whole model as nn.Sequential, or one module per stage")
    return stages_of_rank(list(model), plan, rank)
