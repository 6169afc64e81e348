"""Two replicas of a 2-stage torch.distributed.pipelining 1F1B pipeline, each in its own
pipeline group, recorded with `pipetrace.torch_pipelining.record` (run under torchrun with
4 processes by test_replica_runs.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules

from pipetrace.torch_pipelining import record


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    index = rank % 2
    torch.manual_seed(index)
    module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
    stage = PipelineStage(module, index, 2, torch.device("cpu"), group=groups[rank // 2])
    loss_fn = torch.nn.functional.mse_loss
    schedule = schedules.Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    with record(schedule):
        for step in range(2):
            inputs = torch.randn(16, 16, generator=torch.Generator().manual_seed(step))
            schedule.step(
                *((inputs,) if stage.is_first else ()),
                target=torch.tanh(inputs) if stage.is_last else None,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
