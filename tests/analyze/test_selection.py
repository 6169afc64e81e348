"""`--ranks` and `--replica`: only some ranks loaded, and findings that say so."""

from __future__ import annotations

import orjson
import pytest

from pipetrace.analyze.selection import (
    RankSelection,
    format_rank_list,
    parse_rank_list,
    replica_of_ranks,
    short_rank_list,
)
from pipetrace.cli import main
from pipetrace.testing.cluster import FakeCluster
from pipetrace.testing.synthetic import write_synthetic_run
from pipetrace.tui.session import open_session


def test_rank_lists_read_and_write_back():
    assert parse_rank_list("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_rank_list(" 5 , 2-2") == {2, 5}
    assert format_rank_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    for bad in ("", "a", "3-1", "-2", "1-", "1,,2"):
        with pytest.raises(ValueError):
            parse_rank_list(bad)


def test_a_long_rank_list_without_ranges_is_cut_to_its_ends():
    strided = range(9, 320, 10)  # stage 9 of 32 replicas laid out rank = replica * 10 + stage
    assert short_rank_list(strided) == "9,19,29,...,319 (32 ranks)"
    assert short_rank_list(range(288, 320)) == "288-319"
    assert short_rank_list([1, 3, 5]) == "1,3,5"


def _json(capsys, *args: str) -> tuple[int, dict]:
    code = main(["analyze", *args, "--json", "--no-cache"])
    return code, orjson.loads(capsys.readouterr().out)


def _states(data: dict) -> list[str]:
    return [r["state"] for r in data["ranks"]]


def test_a_wait_on_a_rank_left_out_names_it_as_not_loaded(hung_run, capsys):
    _, everything = _json(capsys, str(hung_run))
    (stall,) = [f for f in everything["findings"] if f["kind"] == "rank_stalled"]
    assert stall["details"]["terminal_rank"] == 3
    assert stall["details"]["terminal_state"] == "computing"

    code, part = _json(capsys, str(hung_run), "--ranks", "0-2")
    assert code == 1
    assert _states(part)[3] == "not_loaded"
    kinds = {f["kind"] for f in part["findings"]}
    assert "deadlock" not in kinds and "rank_failed" not in kinds
    (stall,) = [f for f in part["findings"] if f["kind"] == "rank_stalled"]
    assert stall["details"]["terminal_rank"] == 3
    assert stall["details"]["terminal_state"] == "not_loaded"
    assert "rank 3 was not loaded (left out by --ranks 0-2)" in stall["message"]
    assert any("only rank(s) 0-2 of 4 loaded" in p["message"] for p in part["input_problems"])


def test_a_replica_loads_its_pipeline_ranks(tmp_path, capsys):
    path = tmp_path / "run"
    config = {"schedule": "1f1b", "data_parallel": 2, "fsdp": True}
    FakeCluster.of("1f1b", ranks=4, microbatches=2, config=config).record(path)
    code, data = _json(capsys, str(path), "--replica", "1")
    assert code == 0
    assert _states(data) == ["not_loaded", "not_loaded", "finished", "finished"]
    assert data["findings"] == []


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--ranks", "0-x"], "'0-x' is not a number or a range like 0-3"),
        (["--ranks", "2,9"], "--ranks: the run has ranks 0-3; no rank 9"),
        (["--replica", "1"], "--replica: the run has one replica (0); no replica 1"),
    ],
)
def test_a_bad_selection_is_a_usage_error(hung_run, capsys, flags, said):
    assert main(["analyze", str(hung_run), *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_export_and_the_tui_load_the_selection(hung_run, tmp_path):
    out = tmp_path / "part.pftrace"
    assert main(["export", str(hung_run), "--ranks", "0-1", "-o", str(out), "--no-cache"]) == 0
    assert out.stat().st_size > 0
    session = open_session(hung_run, select=RankSelection(ranks=frozenset({2, 3})), cache=False)
    assert [r.status.state for r in session.run.ranks[:2]] == ["not_loaded"] * 2
    assert all(r.present for r in session.run.ranks[2:])


def test_replicas_follow_the_pipelines_meta_json_names():
    assert replica_of_ranks({"pipelines": [[0, 2], [1, 3]]}, 4) == [0, 1, 0, 1]
    assert replica_of_ranks({"config": {"data_parallel": 2}}, 4) == [0, 0, 1, 1]
    assert replica_of_ranks({"config": {"data_parallel": 3}}, 4) == [0, 0, 0, 0]
    only_replica_0 = {"config": {"data_parallel": 2, "ranks": 4}}
    assert replica_of_ranks(only_replica_0, 4) == [0, 0, 0, 0]


def test_ranks_in_no_particular_order_are_each_read_from_their_own_log(tmp_path, capsys):
    """A set of ranks iterates in hash order ({21, 53, 85} as 53, 85, 21): each rank's log
    was handed to another rank, which set it aside as from another run."""
    write_synthetic_run(tmp_path, schedule="gpipe", num_ranks=96, num_microbatches=2)
    code, data = _json(capsys, str(tmp_path), "--ranks", "21,53,85")
    assert code == 0, data["input_problems"]
    loaded = [r["rank"] for r in data["ranks"] if r["state"] != "not_loaded"]
    assert loaded == [21, 53, 85]
    assert not [p for p in data["input_problems"] if "another run" in p["message"]]
