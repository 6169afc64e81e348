"""A run spread over several directories (one per node): analyze, export, diff, tui."""

from __future__ import annotations

import json
import shutil

import orjson
import pytest

from pipetrace.analyze.load import load_run
from pipetrace.analyze.source import open_source
from pipetrace.cli import main
from pipetrace.testing.cluster import FakeCluster
from pipetrace.tui.session import open_session
from tests.multidir.conftest import SAMPLES, split_run


def analysis_json(capsys, *args: str) -> tuple[int, dict]:
    code = main(["analyze", *args, "--json", "--workers", "0"])
    return code, orjson.loads(capsys.readouterr().out)


def comparable(data: dict) -> dict:
    """What must not change when a run is split: everything but where it was read from."""
    return {k: data[k] for k in ("ranks", "counts", "findings", "metrics")}


def test_split_run_analyzes_as_the_original(split_sample, capsys):
    _, whole = analysis_json(capsys, str(SAMPLES / "clean-1f1b"))
    code, split = analysis_json(capsys, *map(str, split_sample))
    assert code == 0  # a node without meta.json is said, but is no damage
    assert comparable(split) == comparable(whole)
    assert split["run"]["path"] == str(split_sample[0])
    assert split["run"]["directories"] == [str(d) for d in split_sample]
    [problem] = split["input_problems"]
    assert problem["severity"] == "info"
    assert f"{split_sample[1]}: no meta.json" in problem["message"]


def test_a_glob_names_the_same_run(split_sample, capsys):
    _, listed = analysis_json(capsys, *map(str, split_sample))
    code, globbed = analysis_json(capsys, str(split_sample[0].parent / "node*"))
    assert code == 0 and globbed == listed


def test_a_glob_passes_over_the_files_beside_the_runs(split_sample, capsys):
    # `pipetrace export 'runs/node*'` writes runs/node0.pftrace, which the glob matches too
    _, listed = analysis_json(capsys, *map(str, split_sample))
    (split_sample[0].parent / f"{split_sample[0].name}.pftrace").write_bytes(b"trace")
    code, globbed = analysis_json(capsys, str(split_sample[0].parent / "node*"))
    assert code == 0 and globbed == listed


def test_a_glob_that_matches_nothing_is_an_input_error(tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "node*")]) == 2
    err = capsys.readouterr().err
    assert "no run directory matches" in err and len(err.strip().splitlines()) == 1


def test_ranks_without_a_log_anywhere_are_named_and_the_rest_analyzed(split_sample, capsys):
    (split_sample[1] / "rank-00002.ndjson").unlink()
    code, data = analysis_json(capsys, *map(str, split_sample))
    assert code == 1  # a missing rank is a problem
    messages = [p["message"] for p in data["input_problems"] if p["severity"] == "warning"]
    assert any("no log of rank(s) 2 in any of the 2 directories" in m for m in messages)
    states = {r["rank"]: r["state"] for r in data["ranks"]}
    assert states[0] == states[1] == "finished" and states[2] == "missing"
    (absent,) = [f for f in data["findings"] if f["kind"] == "rank_failed" and f["ranks"] == [2]]
    assert "(rank-00002.ndjson: in none of the 2 directories)" in absent["message"]


def test_a_real_log_wins_over_a_directory_of_its_name(split_sample, capsys):
    # the directory (4,096 bytes on most file systems) comes first and is larger
    (split_sample[0] / "rank-00001.ndjson").mkdir()
    _, whole = analysis_json(capsys, str(SAMPLES / "clean-1f1b"))
    _, data = analysis_json(capsys, *map(str, split_sample))
    assert comparable(data) == comparable(whole)
    (said,) = [p["message"] for p in data["input_problems"] if "is in both" in p["message"]]
    assert "(not a readable file and " in said and said.endswith(f"read from {split_sample[1]}")


def test_a_log_found_twice_is_read_once(split_sample, capsys):
    shutil.copy(split_sample[1] / "rank-00001.ndjson", split_sample[0])
    _, whole = analysis_json(capsys, str(SAMPLES / "clean-1f1b"))
    code, data = analysis_json(capsys, *map(str, split_sample))
    assert code == 0 and comparable(data) == comparable(whole)
    assert any(
        "rank-00001.ndjson is in both" in p["message"] and p["rank"] == 1
        for p in data["input_problems"]
    )


@pytest.fixture
def two_runs(tmp_path, monkeypatch):
    """Two fake-cluster runs recorded under the named run ids "job-a" and "job-b"."""
    paths = []
    for name in ("job-a", "job-b"):
        monkeypatch.setenv("PIPETRACE_RUN_ID", name)
        path = tmp_path / name
        FakeCluster.of("1f1b", ranks=2, microbatches=2, iterations=1).record(path)
        paths.append(path)
    return paths


def test_two_different_runs_are_refused_naming_both(two_runs, capsys):
    assert main(["analyze", *map(str, two_runs)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "two different runs" in err and "'job-a'" in err and "'job-b'" in err


def test_a_node_of_another_named_run_is_refused(two_runs, capsys):
    (two_runs[1] / "meta.json").unlink()  # only the run ids tell them apart
    assert main(["analyze", *map(str, two_runs)]) == 2
    assert "'job-a'" in capsys.readouterr().err


def test_no_meta_json_in_any_directory(split_sample, capsys):
    (split_sample[0] / "meta.json").unlink()
    assert main(["analyze", *map(str, split_sample)]) == 2
    assert "holds a meta.json" in capsys.readouterr().err


def test_export_and_tui_session_read_several_directories(split_sample, tmp_path, capsys):
    out = tmp_path / "job.pftrace"
    assert main(["export", *map(str, split_sample), "-o", str(out), "--workers", "0"]) == 0
    assert out.stat().st_size > 0
    session = open_session(list(split_sample), workers=0)
    assert session.path == split_sample[0]
    assert [r.present for r in session.run.ranks] == [True, True, True]


def test_diff_takes_each_run_as_several_directories(split_sample, capsys):
    whole = str(SAMPLES / "clean-1f1b")
    args = ["diff", "-a", str(split_sample[0]), "-a", str(split_sample[1]), "-b", whole]
    assert main([*args, "--json"]) == 0
    data = orjson.loads(capsys.readouterr().out)
    same = orjson.loads(_diff_json(capsys, whole, whole))  # the same run on both sides
    assert data["a"].pop("directories") == [str(d) for d in split_sample]
    assert {k: v for k, v in data.items() if k != "a"} == {
        k: v for k, v in same.items() if k != "a"
    }
    assert {k: v for k, v in data["a"].items() if k != "path"} == {
        k: v for k, v in same["a"].items() if k not in ("path", "directories")
    }
    assert main(["diff", "-a", whole, whole]) == 2  # -a with a positional run: ambiguous
    assert main(["diff", whole]) == 2
    assert "give two runs" in capsys.readouterr().err


def _diff_json(capsys, a: str, b: str) -> bytes:
    assert main(["diff", a, b, "--json"]) == 0
    return capsys.readouterr().out.encode()


def test_the_loader_takes_a_gathered_source(split_sample):
    source = open_source(split_sample)
    assert source.meta_dir == split_sample[0]
    assert [log.parent for log in source.logs] == [split_sample[0], *[split_sample[1]] * 2]
    run = load_run(source, workers=0)
    assert run.directories == tuple(split_sample)


def test_tui_and_export_refuse_two_runs_before_anything_else(two_runs, capsys):
    for verb in ("tui", "export"):
        assert main([verb, *map(str, two_runs)]) == 2
        assert "two different runs" in capsys.readouterr().err
    assert not list(two_runs[0].parent.glob("*.pftrace"))


def test_export_writes_beside_the_directory_holding_meta_json(split_sample, capsys):
    assert main(["export", str(split_sample[1]), str(split_sample[0]), "--workers", "0"]) == 0
    assert (split_sample[0].parent / "node0.pftrace").stat().st_size > 0


def test_the_nodes_without_meta_json_are_one_line(tmp_path, capsys):
    node0, node1 = split_run(SAMPLES / "clean-1f1b", tmp_path, [1, 2])
    node2 = tmp_path / "node2"
    node2.mkdir()
    (node1 / "rank-00002.ndjson").rename(node2 / "rank-00002.ndjson")
    code, split = analysis_json(capsys, str(node0), str(node1), str(node2))
    assert code == 0
    [problem] = split["input_problems"]
    assert problem["message"] == f"{node1}, {node2}: no meta.json (the run's is read from {node0})"


def test_ranks_no_directory_holds_are_one_warning_and_one_finding(split_sample, capsys):
    """A node not copied back: its ranks are named once among the input problems and once
    among the findings, not once per rank in each."""
    for log in split_sample[1].glob("rank-*.ndjson"):
        log.unlink()
    code, split = analysis_json(capsys, *map(str, split_sample))
    assert code == 1
    messages = [p["message"] for p in split["input_problems"]]
    assert [m for m in messages if "1, 2" in m or "1-2" in m] == [
        "no log of rank(s) 1-2 in any of the 2 directories (a node not copied back?)"
    ]
    assert not [m for m in messages if "missing event log" in m]
    (missing,) = [f for f in split["findings"] if f["kind"] == "rank_failed"]
    assert missing["ranks"] == [1, 2] and missing["message"] == (
        "2 ranks have no usable log: ranks 1-2"
    )
    # rank 0 completed messages with rank 1; rank 2's only peer is rank 1
    assert missing["cause"].startswith("1 of them ran (their peers completed messages with them)")


def test_two_copies_of_meta_json_that_differ_name_what_differs(split_sample, capsys):
    first, second = split_sample
    meta = json.loads((first / "meta.json").read_text())
    (second / "meta.json").write_text(json.dumps({**meta, "created": meta["created"] + 5}))
    assert main(["analyze", str(first), str(second)]) == 2
    err = capsys.readouterr().err
    assert f"meta.json created {meta['created']} and {meta['created'] + 5}" in err
    assert "run ids" not in err  # both directories have one: the same
