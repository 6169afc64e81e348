"""`pipetrace merge DIR... -o OUT`: one run directory from several."""

from __future__ import annotations

import os

import orjson

from pipetrace.cli import main
from tests.multidir.conftest import SAMPLES


def analysis(capsys, *dirs) -> dict:
    main(["analyze", *map(str, dirs), "--json", "--workers", "0"])
    data = orjson.loads(capsys.readouterr().out)
    return {k: data[k] for k in ("ranks", "findings", "metrics")}


def test_merged_directory_is_the_original_run(split_sample, tmp_path, capsys):
    out = tmp_path / "job"
    assert main(["merge", *map(str, split_sample), "-o", str(out), "--json"]) == 0
    summary = orjson.loads(capsys.readouterr().out)
    assert summary["output"] == str(out) and summary["meta_from"] == str(split_sample[0])
    assert summary["ranks_copied"] == 3 and summary["ranks_missing"] == []
    assert sorted(p.name for p in out.iterdir()) == sorted(  # the run, not a reader's cache
        p.name for p in (SAMPLES / "clean-1f1b").iterdir() if p.is_file()
    )
    assert analysis(capsys, out) == analysis(capsys, SAMPLES / "clean-1f1b")
    assert sorted(p.name for p in split_sample[1].iterdir()) == [  # inputs untouched
        "rank-00001.ndjson",
        "rank-00002.ndjson",
    ]


def test_merge_names_ranks_without_a_log_and_copies_the_rest(split_sample, tmp_path, capsys):
    (split_sample[1] / "rank-00001.ndjson").unlink()
    out = tmp_path / "job"
    assert main(["merge", *map(str, split_sample), "-o", str(out), "--json"]) == 1
    summary = orjson.loads(capsys.readouterr().out)
    assert summary["ranks_missing"] == [1] and summary["ranks_copied"] == 2
    assert not (out / "rank-00001.ndjson").exists() and (out / "rank-00002.ndjson").exists()


def test_merge_refuses_to_replace_a_run_without_overwrite(split_sample, tmp_path, capsys):
    out = tmp_path / "job"
    args = ["merge", *map(str, split_sample), "-o", str(out)]
    assert main(args) == 0
    before = (out / "meta.json").stat().st_mtime_ns
    assert main(args) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "meta.json").stat().st_mtime_ns == before
    assert main([*args, "--overwrite"]) == 0
    assert "wrote" in capsys.readouterr().out


def test_merge_never_writes_into_an_input_or_through_a_link(split_sample, tmp_path, capsys):
    assert main(["merge", *map(str, split_sample), "-o", str(split_sample[1]), "--overwrite"]) == 2
    assert "one of the directories being merged" in capsys.readouterr().err
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, tmp_path / "link")
    assert main(["merge", *map(str, split_sample), "-o", str(tmp_path / "link")]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert list(target.iterdir()) == []
