"""Two replicas of a 2-stage torch.distributed.pipelining 1F1B pipeline, each in its own
pipeline group, recorded with `pipetrace.torch_pipelining.record` (run under torchrun with
4 processes by test_replica_runs.py). After each step the replicas all-reduce their
gradients in the script's own collective; ``DP_HANG_RANK=r`` makes global rank r hang in
its forward at the second step, ``DP_PAUSE_RANK=r`` pause there for 3 s once."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules

from pipetrace.torch_pipelining import record

HANG_RANK = int(os.environ.get("DP_HANG_RANK", "-1"))
PAUSE_RANK = int(os.environ.get("DP_PAUSE_RANK", "-1"))


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # every rank makes every group: the pipelines, then the replicas of each stage
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    index = rank % 2
    torch.manual_seed(index)
    module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
    stage = PipelineStage(module, index, 2, torch.device("cpu"), group=groups[rank // 2])
    loss_fn = torch.nn.functional.mse_loss
    schedule = schedules.Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    with record(schedule):
        for step in range(2):
            if step == 1 and rank == HANG_RANK:
                module.register_forward_hook(lambda *_: _hang())
            if step == 1 and rank == PAUSE_RANK:
                module.register_forward_hook(_pause_once)
            inputs = torch.randn(16, 16, generator=torch.Generator().manual_seed(step))
            schedule.step(
                *((inputs,) if stage.is_first else ()),
                target=torch.tanh(inputs) if stage.is_last else None,
            )
            for parameter in module.parameters():
                dist.all_reduce(parameter.grad, group=replicas[index])
    dist.destroy_process_group()


_paused: list[bool] = []


def _pause_once(*_: object) -> None:
    if not _paused:
        _paused.append(True)
        time.sleep(3)


def _hang() -> None:
    while True:
        time.sleep(0.5)


if __name__ == "__main__":
    main()
