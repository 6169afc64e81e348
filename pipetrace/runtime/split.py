"""Cut a sequential model into pipeline stages and pick the ones a rank holds.

Stages are contiguous runs of the model's children, numbered in data-flow order. Which rank
holds which stage is the plan's business (``plan.placement``: loop for interleaved
schedules, V for ZBV and DualPipeV); `stages_of_rank` just follows it. Children keep their
names from the full model, so a parameter is called the same in a stage and in the full
model (``3.0.weight``), which is what the parity check and user checkpoints rely on.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from pipetrace.schedule.ir import Plan


def split_sequential(model: torch.nn.Sequential, num_stages: int) -> list[torch.nn.Sequential]:
    """Split ``model``'s children into ``num_stages`` contiguous chunks whose lengths differ
    by at most one (earlier stages get the extra child)."""
    children = list(model.named_children())
    if num_stages < 1 or len(children) < num_stages:
        raise ValueError(
            f"cannot split a Sequential of {len(children)} modules into {num_stages} stages; "
            "give the model at least one module per stage"
        )
    base, extra = divmod(len(children), num_stages)
    chunks = []
    start = 0
    for stage in range(num_stages):
        end = start + base + (stage < extra)
        chunks.append(torch.nn.Sequential(OrderedDict(children[start:end])))
        start = end
    return chunks


def stages_of_rank(
    chunks: list[torch.nn.Module], plan: Plan, rank: int
) -> dict[int, torch.nn.Module]:
    """The chunks ``rank`` holds under ``plan.placement``, by stage index."""
    if len(chunks) != plan.num_stages:
        raise ValueError(
            f"the plan has {plan.num_stages} stages but {len(chunks)} chunks were given"
        )
    return {stage: chunks[stage] for stage in plan.stages_of(rank)}
