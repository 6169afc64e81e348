"""Cut a sequential model into pipeline stages and pick the ones a rank holds; framework-free
(each backend's ``split_model`` builds its chunks from `chunk_bounds`).

Stages are contiguous runs of the model's children, numbered in data-flow order. Which rank
holds which stage is the plan's business (``plan.placement``: loop for interleaved
schedules, V for ZBV and DualPipeV); `stages_of_rank` just follows it. Chunks keep the
children's names from the full model, so a parameter is called the same in a stage and in
the full model (``3.0.weight``), which is what the parity check and user checkpoints rely on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipetrace.runtime.backend import Backend
    from pipetrace.schedule.ir import Plan


def chunk_bounds(count: int, num_stages: int, *, kind: str, unit: str) -> list[tuple[int, int]]:
    """(start, end) of ``num_stages`` contiguous runs of ``count`` children whose lengths
    differ by at most one (earlier stages get the extra child). ``kind`` and ``unit`` name
    the model and its children in the error ("Sequential", "module")."""
    if num_stages < 1 or count < num_stages:
        raise ValueError(
            f"cannot split a {kind} of {count} {unit}s into {num_stages} stages; "
            f"give the model at least one {unit} per stage"
        )
    base, extra = divmod(count, num_stages)
    bounds = []
    start = 0
    for stage in range(num_stages):
        end = start + base + (stage < extra)
        bounds.append((start, end))
        start = end
    return bounds


def stages_of_rank(chunks: list[Any], plan: Plan, rank: int) -> dict[int, Any]:
    """The chunks ``rank`` holds under ``plan.placement``, by stage index."""
    if len(chunks) != plan.num_stages:
        raise ValueError(
            f"the plan has {plan.num_stages} stages but {len(chunks)} chunks were given"
        )
    return {stage: chunks[stage] for stage in plan.stages_of(rank)}


def stage_modules(backend: Backend, model: Any, plan: Plan, rank: int) -> dict[int, Any]:
    """The modules of the stages ``rank`` holds, from a whole sequential model (split here),
    a sequence with one module per stage, or a mapping ``{stage: module}`` of only this
    rank's stages."""
    if backend.is_sequential(model):
        return stages_of_rank(backend.split_model(model, plan.num_stages), plan, rank)
    if isinstance(model, Mapping):
        expected = plan.stages_of(rank)
        if sorted(model) != expected:
            raise ValueError(
                f"rank {rank} holds stages {expected}; "
                f"got {backend.module_word}s for {sorted(model)}"
            )
        return dict(model)
    if backend.is_module(model) and not _holds_modules(backend, model):
        raise TypeError(
            f"got a {type(model).__name__}, which is not {backend.sequential_name}: give a "
            f"whole model as {backend.sequential_name}, or one {backend.module_word} per "
            f"stage (a list, a {backend.module_word} list or {{stage: {backend.module_word}}})"
        )
    return stages_of_rank(list(model), plan, rank)


def _holds_modules(backend: Backend, model: Any) -> bool:
    """A module that is a list of modules (nn.ModuleList, MindSpore's CellList): one per
    stage, like a plain list."""
    try:
        return len(model) > 0 and all(backend.is_module(part) for part in model)
    except TypeError:  # no len() or not iterable: a model of its own
        return False
