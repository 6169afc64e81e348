"""Which global ranks form each replica's pipeline, read from meta.json or the rank headers,
and how findings name a global rank."""

from __future__ import annotations

from types import SimpleNamespace

from pipetrace.analyze import findings as fk
from pipetrace.analyze import replicas
from pipetrace.analyze.findings import Finding
from pipetrace.analyze.pipelines import Pipelines, pipelines_of, rank_name
from pipetrace.recorder.hooks import Place


def test_two_pipelines_map_global_and_pipeline_ranks():
    pipelines = Pipelines(((0, 1), (2, 3)))
    assert pipelines.several and pipelines.count == 2
    assert [pipelines.replica_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [pipelines.pipeline_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert pipelines.peer(3, 0) == 2 and pipelines.global_rank(1, 1) == 3
    assert pipelines.global_rank(2, 0) == -1


def test_one_pipeline_is_the_identity_and_keeps_plain_names():
    pipelines = Pipelines()
    assert not pipelines.several and pipelines.count == 1
    assert (pipelines.pipeline_rank(5), pipelines.peer(5, 2)) == (5, 2)
    assert rank_name(pipelines, 5, [5]) == "rank 5"


def test_names_say_replica_stage_and_global_rank():
    strided = Pipelines(((0, 2), (1, 3)))
    assert rank_name(strided, 3, [1]) == "replica 1, stage 1, global rank 3"
    assert rank_name(strided, 2, [1, 3]) == "replica 0, stages 1,3, global rank 2"


def test_pipelines_come_from_meta_else_from_the_headers():
    meta = {"pipelines": [[0, 1], [2, 3]]}
    assert pipelines_of(meta, [], 4) == (Pipelines(((0, 1), (2, 3))), None)
    # a node's directory without meta.json: each header says its own pipeline
    headers = [Place(rank, 4, ((0, 1), (2, 3))).header() | {"rank": rank} for rank in (3, 0)]
    assert pipelines_of({}, headers, 4) == (Pipelines(((0, 1), (2, 3))), None)
    assert pipelines_of({}, [{"rank": 0}], 4) == (Pipelines(), None)


def test_pipelines_that_do_not_split_the_world_are_a_problem():
    pipelines, problem = pipelines_of({"pipelines": [[0, 1], [1, 2]]}, [], 4)
    assert pipelines == Pipelines() and "do not split the 4 ranks" in problem


def test_a_place_writes_the_header_fields():
    place = Place(
        global_rank=14, world_size=16, pipelines=((0, 1, 2, 3, 4, 5, 6, 7), tuple(range(8, 16)))
    )
    assert place.header() == {
        "replica": 1,
        "replicas": 2,
        "pipeline_rank": 6,
        "pipeline_ranks": list(range(8, 16)),
    }


class _NamedRun:
    """What naming reads of a run: its pipelines, each rank's stage and error."""

    def __init__(self, pipelines: Pipelines, errors: dict[int, str]) -> None:
        self.pipelines = pipelines
        self.present_ranks = [
            SimpleNamespace(status=SimpleNamespace(error=errors.get(r)), last_of=lambda e: None)
            for r in range(4)
        ]

    def rank_name(self, rank: int) -> str:
        return rank_name(self.pipelines, rank, [self.pipelines.pipeline_rank(rank)])


def test_findings_name_lists_of_ranks_and_keep_the_ranks_own_words():
    run = _NamedRun(Pipelines(((0, 1), (2, 3))), {3: "RuntimeError: bad batch on rank 3"})
    finding = Finding(
        fk.RANK_FAILED,
        fk.ERROR,
        "rank 3 raised RuntimeError: bad batch on rank 3 in 1F0",
        "the job was ended while rank(s) 1, 3 hung",
    )
    named = replicas._named(run, finding, replicas._quoted(run))
    assert named.message == (
        "replica 1, stage 1, global rank 3 raised RuntimeError: bad batch on rank 3 in 1F0"
    )
    assert named.cause == (
        "the job was ended while replica 0, stage 1, global rank 1 and "
        "replica 1, stage 1, global rank 3 hung"
    )
