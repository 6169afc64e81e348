"""Which global ranks form each replica's pipeline, and how a global rank is named.

A job with data parallelism runs one pipeline per replica, all on the same plan: meta.json's
plan rows and ``placement`` speak of pipeline ranks, the logs, findings and views of global
ranks. `Pipelines` translates; a run of one pipeline (every run recorded before replicas
were) is the identity, and its names stay plain ``rank N``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipetrace.recorder.format import is_int64


@dataclass(frozen=True)
class Pipelines:
    """``groups[replica][pipeline_rank]`` is a global rank; no groups: one pipeline, whose
    pipeline rank r is global rank r."""

    groups: tuple[tuple[int, ...], ...] = ()
    _where: dict[int, tuple[int, int]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for replica, ranks in enumerate(self.groups):
            for pipeline_rank, rank in enumerate(ranks):
                self._where[rank] = (replica, pipeline_rank)

    @property
    def several(self) -> bool:
        return len(self.groups) > 1

    @property
    def count(self) -> int:
        return max(1, len(self.groups))

    def replica_of(self, rank: int) -> int:
        return self._where.get(rank, (0, rank))[0]

    def pipeline_rank(self, rank: int) -> int:
        """The row of the plan that global rank ``rank`` runs."""
        return self._where.get(rank, (0, rank))[1]

    def global_rank(self, replica: int, pipeline_rank: int) -> int:
        """The global rank of ``pipeline_rank`` in ``replica`` (-1 when there is none)."""
        if not self.groups:
            return pipeline_rank
        ranks = self.groups[replica] if 0 <= replica < len(self.groups) else ()
        return ranks[pipeline_rank] if 0 <= pipeline_rank < len(ranks) else -1

    def peer(self, rank: int, pipeline_rank: int) -> int:
        """Pipeline rank ``pipeline_rank`` of ``rank``'s own pipeline, as a global rank."""
        return self.global_rank(self.replica_of(rank), pipeline_rank)

    def members(self, replica: int) -> tuple[int, ...]:
        return self.groups[replica] if self.groups else ()

    def to_json(self) -> list[list[int]]:
        return [list(g) for g in self.groups]


def pipelines_of(
    meta: dict[str, Any], headers: Iterable[dict[str, Any]], world_size: int
) -> tuple[Pipelines, str | None]:
    """The run's pipelines from meta.json's ``pipelines``, else from the rank headers (a
    node's directory without meta.json still says who each rank is); (one pipeline, a
    problem) when what they say does not partition the world."""
    groups = meta.get("pipelines")
    if groups is None:
        found = {
            tuple(h["pipeline_ranks"]): h.get("replica")
            for h in headers
            if isinstance(h.get("pipeline_ranks"), list)
        }
        if not found:
            return Pipelines(), None
        groups = [list(ranks) for ranks, _ in sorted(found.items(), key=lambda kv: min(kv[0]))]
    if _partitions(groups, world_size):
        return Pipelines(tuple(tuple(g) for g in groups)), None
    return Pipelines(), (
        f"the replicas' pipelines {groups!r} do not split the {world_size} ranks into equal "
        "groups; the run is analyzed as one pipeline"
    )


def _partitions(groups: Any, world_size: int) -> bool:
    if not isinstance(groups, list) or not groups:
        return False
    if not all(isinstance(g, list) and g and all(map(is_int64, g)) for g in groups):
        return False
    flat = sorted(r for g in groups for r in g)
    return flat == list(range(world_size)) and len({len(g) for g in groups}) == 1


def rank_name(pipelines: Pipelines, rank: int, stages: Sequence[int]) -> str:
    """``rank 3`` in a run of one pipeline; ``replica 1, stage 1, global rank 3`` when there
    are several (``stages 0,2`` for a rank holding more than one)."""
    if not pipelines.several:
        return f"rank {rank}"
    where = f"replica {pipelines.replica_of(rank)}"
    if stages:
        word = "stage" if len(stages) == 1 else "stages"
        where += f", {word} {','.join(map(str, stages))}"
    return f"{where}, global rank {rank}"
