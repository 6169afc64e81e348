"""Cut a ``SequentialCell`` into pipeline stages and pick the ones a rank holds (the
MindSpore twin of `pipetrace.runtime.split`).

Chunks keep the full model's cell names, and MindSpore parameters keep the names they got in
the full model (``3.0.weight``), which the parity check and user checkpoints rely on.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mindspore import nn

    from pipetrace.schedule.ir import Plan


def split_sequential(model: nn.SequentialCell, num_stages: int) -> list[nn.SequentialCell]:
    """Split ``model``'s cells into ``num_stages`` contiguous chunks whose lengths differ by at
    most one (earlier stages get the extra cell). Chunks keep the full model's cell names, and
    parameters keep their names (``3.0.weight``), which the parity check relies on."""
    from mindspore import nn

    children = list(model.name_cells().items())
    if num_stages < 1 or len(children) < num_stages:
        raise ValueError(
            f"cannot split a SequentialCell of {len(children)} cells into {num_stages} stages; "
            "give the model at least one cell per stage"
        )
    base, extra = divmod(len(children), num_stages)
    chunks = []
    start = 0
    for stage in range(num_stages):
        end = start + base + (stage < extra)
        chunks.append(nn.SequentialCell(OrderedDict(children[start:end])))
        start = end
    return chunks


def stages_of_rank(chunks: list[nn.Cell], plan: Plan, rank: int) -> dict[int, nn.Cell]:
    """The chunks ``rank`` holds under ``plan.placement``, by stage index."""
    if len(chunks) != plan.num_stages:
        raise ValueError(
            f"the plan has {plan.num_stages} stages but {len(chunks)} chunks were given"
        )
    return {stage: chunks[stage] for stage in plan.stages_of(rank)}
