"""``pipetrace run --runtime torch``: the demo on torch.distributed.pipelining's own classes
computes what pipetrace's runtime computes (same losses, gradients equal to one process's),
a profiler still sees torch's ``PP:<action>`` ranges, ``pipetrace diff`` compares the two,
and stages sharded with FSDP2 over two data-parallel replicas (every replica recorded) record
their UNSHARD / RESHARD / REDUCE_GRAD actions in a run that analyzes clean."""

from __future__ import annotations

import re

import pytest
from tp_runs import analyze_json, errors, events, pipetrace

pytestmark = pytest.mark.multiproc

FSDP_KINDS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")


def losses(stdout: str) -> list[str]:
    return re.findall(r"^step \d+  loss (\S+)$", stdout, flags=re.MULTILINE)


def test_torch_runtime_trains_like_pipetraces_and_diff_compares_them(tmp_path):
    args = ("run", "-s", "interleaved-1f1b", "-p", "2", "-m", "4", "-n", "2", "--check-parity")
    ours = pipetrace(*args, "--out", str(tmp_path / "ours"))
    torchs = pipetrace(
        *args, "--runtime", "torch", "--torch-profiler", "--out", str(tmp_path / "torch")
    )
    assert ours.returncode == 0 and torchs.returncode == 0, torchs.stderr
    assert "ScheduleInterleaved1F1B" in torchs.stdout and "parity ok" in torchs.stdout
    assert len(losses(torchs.stdout)) == 2 and losses(torchs.stdout) == losses(ours.stdout)
    # torch's per-action ranges survive recording, next to pipetrace's own
    profile = (tmp_path / "torch" / "profiler" / "rank-00000.json").read_text()
    assert '"PP:0F0"' in profile and '"pipetrace/0F0"' in profile
    diff = pipetrace("diff", str(tmp_path / "ours"), str(tmp_path / "torch"))
    assert diff.returncode == 0, diff.stderr
    assert "interleaved-1f1b" in diff.stdout and "ScheduleInterleaved1F1B" in diff.stdout


def test_fsdp2_stages_on_torchs_runtime_record_their_actions(tmp_path):
    run_dir = tmp_path / "run"
    done = pipetrace(
        "run", "--runtime", "torch", "-s", "interleaved-1f1b", "-p", "2", "-d", "2", "--fsdp",
        "-m", "4", "-n", "2", "--check-parity", "--out", str(run_dir),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "parity ok" in done.stdout
    code, report = analyze_json(run_dir)
    assert code == 0 and not errors(report), errors(report)
    assert report["run"]["world_size"] == 4  # every replica's pipeline, by global rank
    for rank in range(4):
        log = events(run_dir, rank)
        recorded = {e["step"] for e in log if e["e"] == "step_begin"}
        for kind in FSDP_KINDS:  # each of the rank's two stages
            assert sum(kind in step for step in recorded) == 2, (rank, kind, recorded)
        assert log[-1]["e"] == "run_end"
