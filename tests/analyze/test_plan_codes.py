"""The codes of the ranks' plans and of meta.json's plan: a row that a rank ran, every text
of it used by the rank's events, is coded from the rank's own codes (`RawRank.plan_index`)
instead of looking each text up in the run's catalog. Both ways must give the same model,
whatever meta.json's plan says (rows that differ from what the ranks ran, texts no event
used, bubbles, rows no rank ran)."""

from __future__ import annotations

import shutil

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipetrace.analyze import cache
from pipetrace.analyze.load import _Assembly, load_run
from pipetrace.analyze.parse import parse_rank_file
from pipetrace.recorder import format as fmt
from pipetrace.runtime.faults import Hang
from pipetrace.testing.aging import age_logs
from pipetrace.testing.cluster import FakeCluster
from tests.analyze.model_equality import assert_same


@pytest.fixture(scope="module")
def hung_run(tmp_path_factory):
    """4 ranks, rank 3 hangs: the ranks stop before running all of their plan's steps."""
    path = tmp_path_factory.mktemp("plan-codes") / "run"
    FakeCluster.of(faults=[Hang(rank=3, step=0, microbatch=1, phase="B")]).record(path)
    age_logs(path)
    return path


@pytest.fixture(scope="module")
def clean_4(tmp_path_factory):
    """4 ranks that ran their whole plan."""
    path = tmp_path_factory.mktemp("plan-codes") / "clean"
    FakeCluster.of().record(path)
    age_logs(path)
    return path


def test_the_plan_index_places_each_planned_text(hung_run):
    for log in sorted(hung_run.glob("rank-*.ndjson")):
        raw = parse_rank_file(log)
        plan = raw.run_start["plan"]
        assert len(raw.plan_index) == len(plan) and raw.plan_index.dtype == np.int32
        for text, at in zip(plan, raw.plan_index.tolist()):
            assert raw.texts[at] == text if at >= 0 else text not in raw.texts
    assert (parse_rank_file(fmt.rank_log_path(hung_run, 3)).plan_index < 0).any()


def _looked_up(monkeypatch) -> None:
    """Every row of meta.json's plan looked up in the catalog, as before the rows' codes
    were taken from the ranks."""
    rows_ran = _Assembly._rows_ran
    monkeypatch.setattr(
        _Assembly, "_rows_ran", lambda self, row_of: (rows_ran(self, row_of)[0], {})
    )


def _changed(meta: dict, row: int, change: str, where: int) -> dict:
    plan = [list(r) for r in meta["plan"]]
    texts = plan[row]
    at = where % len(texts)
    if change == "swap":
        texts[at], texts[-1] = texts[-1], texts[at]
    elif change == "drop":
        del texts[at]
    elif change == "unrun text":
        texts[at] = "7F9"
    elif change == "bubble":
        texts.insert(at, None)
    elif change == "empty bubble":
        texts.insert(at, "")
    elif change == "extra row":
        plan.append(list(texts))
    elif change == "not a step":
        texts[at] = "not a step"
    return {**meta, "plan": plan}


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    changes=st.lists(
        st.tuples(
            st.integers(0, 3),
            st.sampled_from(
                [
                    "none",
                    "swap",
                    "drop",
                    "unrun text",
                    "bubble",
                    "empty bubble",
                    "extra row",
                    "not a step",
                ]
            ),
            st.integers(0, 1000),
        ),
        max_size=3,
    ),
    hung=st.booleans(),
)
def test_rows_coded_from_the_ranks_equal_rows_looked_up(
    hung_run, clean_4, tmp_path_factory, monkeypatch, changes, hung
):
    run = tmp_path_factory.mktemp("changed") / "run"
    source = hung_run if hung else clean_4
    shutil.copytree(source, run, ignore=shutil.ignore_patterns(cache.CACHE_DIR))
    meta = orjson.loads((run / fmt.META_FILE).read_bytes())
    for row, change, where in changes:
        meta = _changed(meta, row, change, where)
    (run / fmt.META_FILE).write_bytes(orjson.dumps(meta))
    built = load_run(run, workers=0)  # writes the run entry (the logs are aged)
    reopened = load_run(run, workers=0)
    assert reopened.plan == built.plan
    with monkeypatch.context() as patched:
        _looked_up(patched)
        looked_up = load_run(run, workers=0, cache=False)
    assert_same(built, looked_up)
    assert built.plan == looked_up.plan


def test_rows_the_ranks_ran_whole_are_not_looked_up(clean_4, hung_run, monkeypatch):
    """A clean run's ranks used every text of their plan; a hang at the first step leaves
    texts of every plan unused."""
    rows_ran, seen = _Assembly._rows_ran, []

    def spied(self, row_of):
        ran, known = rows_ran(self, row_of)
        seen.append((ran, sorted(known)))
        return ran, known

    monkeypatch.setattr(_Assembly, "_rows_ran", spied)
    load_run(clean_4, workers=0, cache=False)
    load_run(hung_run, workers=0, cache=False)
    assert seen == [({0, 1, 2, 3}, [0, 1, 2, 3]), ({0, 1, 2, 3}, [])]
