"""`pipetrace merge DIR... -o OUT`: one run directory from several."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import orjson
import pytest

from pipetrace.analyze import reader
from pipetrace.cli import main
from pipetrace.recorder import run_dir
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


def test_merge_of_one_directory_names_its_missing_ranks_in_the_text_output(
    split_sample, tmp_path, capsys
):
    out = tmp_path / "job"
    assert main(["merge", str(split_sample[0]), "-o", str(out)]) == 1
    captured = capsys.readouterr()
    assert f"no log of rank(s) 1-2 in {split_sample[0]}" in captured.err
    assert "1 rank log(s)" in captured.out


def _fifo(path: Path, monkeypatch) -> None:
    path.unlink()
    os.mkfifo(path)  # opened blocking, reading it would hang the merge


def _directory(path: Path, monkeypatch) -> None:
    path.unlink()
    path.mkdir()


def _unreadable(path: Path, monkeypatch) -> None:
    """As chmod 000 does for a user other than root (the tests may run as root)."""
    original = reader.open_regular

    def open_regular(p):
        if Path(p) == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(p))
        return original(p)

    monkeypatch.setattr(reader, "open_regular", open_regular)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_fifo, "not a regular file (a FIFO, device or socket)"),
        (_directory, "not a regular file (a directory)"),
        (_unreadable, "Permission denied"),
    ],
    ids=["fifo", "directory", "permission"],
)
def test_an_unreadable_rank_log_is_missing_and_the_rest_is_copied(
    split_sample, tmp_path, capsys, monkeypatch, make, reason
):
    log = split_sample[1] / "rank-00001.ndjson"
    make(log, monkeypatch)
    out = tmp_path / "job"
    assert main(["merge", *map(str, split_sample), "-o", str(out), "--json"]) == 1
    summary = orjson.loads(capsys.readouterr().out)
    assert summary["ranks_missing"] == [1] and summary["ranks_copied"] == 2
    assert {
        "severity": "warning",
        "rank": 1,
        "message": f"cannot read {log}: {reason}; not copied",
    } in summary["problems"]
    assert sorted(p.name for p in out.iterdir()) == [
        "meta.json",
        "rank-00000.ndjson",
        "rank-00002.ndjson",
    ]
    assert main(["merge", *map(str, split_sample), "-o", str(out)]) == 2  # a whole run, kept


def test_an_empty_rank_log_is_copied_and_named(split_sample, tmp_path, capsys):
    (split_sample[1] / "rank-00002.ndjson").write_bytes(b"")
    out = tmp_path / "job"
    assert main(["merge", *map(str, split_sample), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"warning: {split_sample[1] / 'rank-00002.ndjson'}: empty event log" in err
    assert (out / "rank-00002.ndjson").stat().st_size == 0


def _disk_full_at(monkeypatch, name: str) -> None:
    """The output's copy of NAME is written to /dev/full: every write fails with ENOSPC."""
    original = run_dir.create_new_file

    def create_new_file(path, mode=0o644):
        if Path(path).name == name:
            return os.open("/dev/full", os.O_WRONLY)
        return original(path, mode)

    monkeypatch.setattr(run_dir, "create_new_file", create_new_file)


def test_a_merge_stopped_midway_leaves_no_partial_output(
    split_sample, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "job"
    _disk_full_at(monkeypatch, "rank-00002.ndjson")
    assert main(["merge", *map(str, split_sample), "-o", str(out)]) == 2
    assert not out.exists()
    assert capsys.readouterr().err.splitlines() == [
        f"pipetrace: error: cannot write {out / 'rank-00002.ndjson'}: No space left on device"
    ]
    monkeypatch.undo()
    assert main(["merge", *map(str, split_sample), "-o", str(out)]) == 0  # a retry works


def test_a_failed_overwrite_keeps_the_previous_run(split_sample, tmp_path, capsys, monkeypatch):
    out = tmp_path / "job"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["merge", *map(str, split_sample), "-o", str(out)]
    assert main(args) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _disk_full_at(monkeypatch, "rank-00001.ndjson")
    assert main([*args, "--overwrite"]) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _claimed_by(directory: Path, run_id: str) -> None:
    """As the nodes of an unnamed torchrun job leave them: each directory claimed with its
    own node's id, which its logs' headers carry."""
    (directory / "run-id").write_text(run_id)
    for log in directory.glob("rank-*.ndjson"):
        header, rest = log.read_bytes().split(b"\n", 1)
        log.write_bytes(orjson.dumps({**orjson.loads(header), "run_id": run_id}) + b"\n" + rest)


def test_merge_of_nodes_with_their_own_run_ids_keeps_every_log(split_sample, tmp_path, capsys):
    _claimed_by(split_sample[0], "node0:100:5")
    _claimed_by(split_sample[1], "node1:200:6")
    original = analysis(capsys, SAMPLES / "clean-1f1b")
    assert analysis(capsys, *split_sample) == original
    out = tmp_path / "job"
    assert main(["merge", *map(str, split_sample), "-o", str(out), "--json"]) == 0
    capsys.readouterr()
    assert not (out / "run-id").exists()  # no one id is every log's
    assert analysis(capsys, out) == original


def test_merge_of_one_named_run_keeps_its_id(split_sample, tmp_path, capsys):
    for directory in split_sample:
        _claimed_by(directory, "torchrun:job-7")
    out = tmp_path / "job"
    assert main(["merge", *map(str, split_sample), "-o", str(out)]) == 0
    capsys.readouterr()
    assert reader.read_run_id(out) == "torchrun:job-7"
    assert analysis(capsys, out) == analysis(capsys, SAMPLES / "clean-1f1b")


def test_merge_leaves_out_a_log_of_another_run(split_sample, tmp_path, capsys):
    """analyze sets a log whose run id is not its directory's aside; copied into OUT (one
    id per node: OUT has none) nothing could tell it any more."""
    _claimed_by(split_sample[0], "node0:100:5")
    _claimed_by(split_sample[1], "node1:200:6")
    log = split_sample[1] / "rank-00002.ndjson"
    header, rest = log.read_bytes().split(b"\n", 1)
    log.write_bytes(orjson.dumps({**orjson.loads(header), "run_id": "node1:999:9"}) + b"\n" + rest)
    out = tmp_path / "job"
    assert main(["merge", *map(str, split_sample), "-o", str(out), "--json"]) == 1
    summary = orjson.loads(capsys.readouterr().out)
    assert summary["ranks_missing"] == [2] and not (out / "rank-00002.ndjson").exists()
    assert any("is from another run" in p["message"] for p in summary["problems"])
