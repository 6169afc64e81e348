"""`export -o` writes only regular files it creates: never through a link, onto a device or
into a FIFO; errors are one line with exit code 2. (A FIFO stands for every non-regular
target: a test aimed at a real device node would replace it on a regression.)"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pipetrace.cli import main

SAMPLE = Path(__file__).resolve().parents[2] / "sample_traces" / "clean-1f1b"


def export_to(out: Path, capsys) -> tuple[int, str]:
    code = main(["export", str(SAMPLE), "-o", str(out), "--no-findings"])
    return code, capsys.readouterr().err


def test_a_fifo_target_is_refused_and_left_alone(tmp_path, capsys):
    target = tmp_path / "trace.pftrace"
    os.mkfifo(target)
    code, err = export_to(target, capsys)
    assert code == 2 and "not a regular file" in err and err.count("\n") == 1
    assert stat.S_ISFIFO(os.lstat(target).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.pftrace"]  # no temp left


def test_a_symlink_target_is_refused_and_its_target_kept(tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    link = tmp_path / "trace.pftrace"
    link.symlink_to(victim)
    code, err = export_to(link, capsys)
    assert code == 2 and "symbolic link" in err
    assert victim.read_text() == "keep me" and link.is_symlink()


def test_a_missing_directory_is_one_line(tmp_path, capsys):
    code, err = export_to(tmp_path / "absent" / "trace.pftrace", capsys)
    assert code == 2 and "no directory" in err and err.count("\n") == 1


def test_an_existing_regular_file_is_replaced(tmp_path, capsys):
    target = tmp_path / "trace.json"
    target.write_text("old")
    code = main(["export", str(SAMPLE), "-o", str(target), "--format", "chrome-json"])
    assert code == 0, capsys.readouterr().err
    assert target.read_bytes().startswith(b"{") and not target.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]


def test_the_runs_own_files_are_never_an_output(tmp_path, capsys):
    """A slip of -o would have replaced the recording (meta.json, a rank log) or posed as
    one more rank's log in its directory."""
    run = tmp_path / "run"
    run.mkdir()
    for f in [SAMPLE / "meta.json", *SAMPLE.glob("rank-*.ndjson")]:
        (run / f.name).write_bytes(f.read_bytes())
    before = {f.name: f.read_bytes() for f in run.iterdir()}
    for name in ("meta.json", "rank-00001.ndjson", "rank-00007.ndjson", "run-id"):
        code = main(["export", str(run), "-o", str(run / name), "--no-findings"])
        err = capsys.readouterr().err
        assert code == 2 and "the run's own" in err and err.count("\n") == 1, (name, err)
    assert {f.name: f.read_bytes() for f in run.iterdir()} == before
    assert main(["export", str(run), "-o", str(run / "run.pftrace"), "--no-findings"]) == 0
