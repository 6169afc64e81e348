"""The run directory a recording claims: links are never followed, foreign or previous runs
are refused, and every process of one run agrees (`pipetrace.recorder.run_dir`)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from pipetrace.recorder import format as fmt
from pipetrace.recorder.queue import RecordQueue
from pipetrace.recorder.run_dir import (
    RUN_ID_FILE,
    RunDirError,
    check_directory,
    claim,
    create_new_file,
    current_run_id,
    remove_previous_run,
)
from pipetrace.recorder.writer import EventWriter


def test_the_processes_of_one_run_all_claim_the_directory(tmp_path):
    """Each rank claims, then writes its log at once (as the recorder does): a rank that
    looks while a peer is between its claim and its log must not take the peer's log for a
    previous run. Many rounds, with thread switches as often as possible."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for round_ in range(20):
            run_dir = tmp_path / f"run{round_}"
            assert _claim_from_threads(run_dir, ranks=8) == []
            assert (run_dir / RUN_ID_FILE).read_text() == "run-a"
    finally:
        sys.setswitchinterval(interval)


def _claim_from_threads(run_dir, *, ranks: int) -> list[BaseException]:
    errors: list[BaseException] = []

    def claim_as_a_rank(rank: int) -> None:
        try:
            claim(run_dir, "run-a")
            os.close(create_new_file(fmt.rank_log_path(run_dir, rank)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=claim_as_a_rank, args=(r,)) for r in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_another_run_in_the_directory_is_refused(tmp_path):
    claim(tmp_path, "first")
    with pytest.raises(RunDirError, match=r"already holds another run.*--overwrite"):
        claim(tmp_path, "second")


def test_a_previous_run_without_a_claim_is_refused_until_removed(tmp_path):
    (tmp_path / fmt.META_FILE).write_text("{}")
    (tmp_path / fmt.rank_log_name(3)).write_text("")
    with pytest.raises(RunDirError, match=r"already holds a run \(meta.json\)"):
        claim(tmp_path, "new")
    remove_previous_run(tmp_path)
    claim(tmp_path, "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == [RUN_ID_FILE]


def test_a_run_directory_that_is_a_link_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "run").symlink_to(target)
    with pytest.raises(RunDirError, match="is a symbolic link"):
        claim(tmp_path / "run", "a")
    assert list(target.iterdir()) == []


def test_a_directory_that_cannot_be_created_is_one_line(tmp_path):
    with pytest.raises(RunDirError, match=r"^cannot create run directory /proc/nope/run: "):
        check_directory(tmp_path.joinpath("/proc/nope/run"), create=True)


def test_a_full_disk_at_the_claim_is_one_line_and_leaves_no_file(tmp_path):
    """`pipetrace run` where no byte can be written (a file size limit of 0: EFBIG, as a full
    disk's ENOSPC): one line, exit 2, and no private claim file left behind."""
    import resource
    import subprocess

    out = tmp_path / "run"
    run = [sys.executable, "-m", "pipetrace", "run", "-s", "1f1b", "-p", "2", "-m", "2"]
    done = subprocess.run(
        [*run, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY)),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"pipetrace: error: cannot write in {out}: File too large\n"
    assert os.listdir(out) == []


def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(RunDirError, match="belongs to another user"):
        check_directory(tmp_path, create=False)


def test_a_planted_link_at_a_log_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    log = tmp_path / fmt.rank_log_name(0)
    log.symlink_to(victim)
    with pytest.raises(RunDirError, match="already exists"):
        EventWriter(log, {"h": 1}, RecordQueue(), flush_interval=1)
    assert victim.read_text() == "precious"


def test_a_dangling_link_does_not_create_its_target(tmp_path):
    (tmp_path / "meta.json.tmp").symlink_to(tmp_path / "created-elsewhere")
    with pytest.raises(RunDirError, match="already exists"):
        create_new_file(tmp_path / "meta.json.tmp")
    assert not (tmp_path / "created-elsewhere").exists()


def test_a_planted_link_at_meta_json_is_replaced_not_followed(tmp_path):
    from pipetrace.recorder.recorder import write_meta
    from pipetrace.schedule.builders import build_plan

    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / fmt.META_FILE).symlink_to(victim)
    plan = build_plan("1f1b", num_ranks=2, num_microbatches=2, comms=True)
    write_meta(
        tmp_path,
        plan=plan,
        world_size=2,
        config={},
        framework="none",
        framework_version="0",
        created_ns=0,
    )
    assert victim.read_text() == "precious"
    assert not (tmp_path / fmt.META_FILE).is_symlink()


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"PIPETRACE_RUN_ID": "given", "TORCHELASTIC_RUN_ID": "job"}, "given"),
        ({"TORCHELASTIC_RUN_ID": "job7"}, "torchrun:job7"),
    ],
)
def test_the_run_id_comes_from_the_launcher_or_torchrun(environ, expected):
    assert current_run_id(environ) == expected


def test_without_a_named_run_the_parent_process_is_the_run():
    unnamed = current_run_id({"TORCHELASTIC_RUN_ID": "none"})
    assert unnamed.split(":")[1] == str(os.getppid())
    assert unnamed == current_run_id({})
