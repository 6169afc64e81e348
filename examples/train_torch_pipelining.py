"""Train with torch.distributed.pipelining, recorded by pipetrace with one line.

    PIPETRACE_DIR=run/ torchrun --nproc-per-node 2 examples/train_torch_pipelining.py
    PIPETRACE_DIR=run/ torchrun --nproc-per-node 4 examples/train_torch_pipelining.py \\
        --schedule ScheduleInterleaved1F1B --stages-per-rank 2 --microbatches 8
    pipetrace analyze run/

This is an ordinary torch.distributed.pipelining script: each rank builds its stages and a
schedule. The only pipetrace line is ``with record(schedule):``; without ``PIPETRACE_DIR`` it
patches nothing and the script runs torch's code unchanged.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules

from pipetrace.torch_pipelining import record

FEATURES = 64
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def stage_ranks(schedule: str, world_size: int, num_stages: int) -> list[int]:
    """Which rank holds each stage: round robin, or a V for the V-shaped schedules."""
    if schedule in V_SHAPED:
        return [s if s < world_size else 2 * world_size - 1 - s for s in range(num_stages)]
    return [s % world_size for s in range(num_stages)]


def block(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, FEATURES), torch.nn.Tanh())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedule", default="Schedule1F1B", help="a class in schedules")
    parser.add_argument("--stages-per-rank", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    single = args.schedule in ("ScheduleGPipe", "Schedule1F1B")
    num_stages = world_size * (1 if single else args.stages_per_rank)
    placement = stage_ranks(args.schedule, world_size, num_stages)
    stages = [
        PipelineStage(block(s), s, num_stages, torch.device("cpu"))
        for s in range(num_stages)
        if placement[s] == rank
    ]
    schedule_class = getattr(schedules, args.schedule)
    schedule = schedule_class(
        stages[0] if single else stages,
        n_microbatches=args.microbatches,
        loss_fn=torch.nn.functional.mse_loss,
    )
    optimizer = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.1)
    first = any(stage.is_first for stage in stages)
    last = any(stage.is_last for stage in stages)

    with record(schedule):  # PIPETRACE_DIR=run/ turns it on
        for step in range(args.steps):
            generator = torch.Generator().manual_seed(step)
            inputs = torch.randn(args.microbatches * 8, FEATURES, generator=generator)
            losses: list[torch.Tensor] = []
            schedule.step(
                *((inputs,) if first else ()),
                target=torch.tanh(inputs) if last else None,
                losses=losses if last else None,
            )
            optimizer.step()
            optimizer.zero_grad()
            if last:
                print(f"step {step}: loss {torch.stack(losses).mean():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
