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

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipetrace.runtime import runner
from pipetrace.runtime.executor import StepContext
from pipetrace.runtime.p2p import TensorMeta
from pipetrace.runtime.torch_backend import TorchBackend, init_distributed

__all__ = ["PipelineRunner", "StepContext", "TensorMeta", "init_distributed"]

Model = torch.nn.Module | Sequence[torch.nn.Module] | Mapping[int, torch.nn.Module]


class PipelineRunner(runner.PipelineRunner):
    """`pipetrace.runtime.runner.PipelineRunner` on torch: ``model`` is an ``nn.Sequential``,
    a sequence of modules, or ``{stage: module}``; the other keyword arguments are the base
    class's (``schedule``, ``loss_fn``, ``num_microbatches``, ...).

    ``group`` is the pipeline's process group (default: the world); ranks in the plan are
    ranks in that group. ``device`` defaults to the model's.
    """

    def __init__(
        self,
        model: Model,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        **options: Any,
    ) -> None:
        self.device = torch.device(device if device is not None else _device_of(model))
        self.group = group
        super().__init__(TorchBackend(self.device, group), model, **options)


def _device_of(model: Model) -> torch.device:
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
