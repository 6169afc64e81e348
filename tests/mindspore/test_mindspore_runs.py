"""Real MindSpore runs: a local cluster (scheduler + 2 workers) started by pipetrace, checked
against a single-process MindSpore run, recorded, analyzed, exported and opened in the TUI
like torch runs; a crashing and a hanging rank are diagnosed, and no process is left behind.

MindSpore is slow to start (several seconds per cluster) and to step (~10 ms per tiny op on
CPU), so each test starts one cluster and runs small cases (2 ranks, M=4, 1-2 steps)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys

import pytest

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.load import load_run
from pipetrace.cli import main
from pipetrace.recorder import format as fmt
from pipetrace.runtime.config import DemoConfig, RunConfig
from pipetrace.schedule.ir import StepKind
from tests.ranks import BlockAt, RaiseAt, Record, alive, children_of_this_process
from tests.tui.conftest import wait_loaded

pytest.importorskip("mindspore")
pytestmark = pytest.mark.multiproc

# A smaller demo than the CLI's: MindSpore ops are slow on CPU (docs/mindspore.md).
BASE = RunConfig(
    schedule="1f1b",
    ranks=2,
    microbatches=4,
    steps=2,
    backend="mindspore",
    check_parity=True,
    timeout=60,
    demo=DemoConfig(width=32, microbatch_size=8),
)


def test_schedules_match_single_process_and_record_clean_runs(tmp_path):
    from pipetrace.runtime.mindspore.cluster import launch

    cases = [
        BASE,
        # 6 micro-batches: a loss scale of 1/6, which a float32 multiplier would round
        dataclasses.replace(BASE, schedule="interleaved-1f1b", stages_per_rank=2, microbatches=6),
        dataclasses.replace(BASE, schedule="zb1p"),
        dataclasses.replace(
            BASE, schedule="dualpipev", overlap_p2p=True
        ),  # OVERLAP_F_B on two threads
    ]
    result = launch(
        cases,
        make_recorder=Record(str(tmp_path), several=True, backend="mindspore"),
        kill_grace=5.0,
    )
    assert result.ok, result.failures
    assert not [pid for pid in result.pids if alive(pid)]
    for index, case in enumerate(cases):
        reports = [result.results[rank][index].parity for rank in range(2)]
        assert all(r.ok and r.max_relative_error < 1e-12 for r in reports), (case.schedule, reports)
        stages = case.plan().num_stages
        assert sum(r.compared for r in reports) == 1 + 2 * 2 * stages  # loss + (w, b) x 2 blocks
        (losses,) = [
            result.results[rank][index].losses
            for rank in range(2)
            if result.results[rank][index].losses
        ]
        assert len(losses) == 2 and losses[1] < losses[0]

        analysis = analyze(load_run(tmp_path / f"case-{index}", workers=0))
        errors = [(f.kind, f.message) for f in analysis.findings if f.severity == "error"]
        assert errors == [], case.schedule
        assert {r.status.state for r in analysis.run.ranks} == {"finished"}
        assert all((r.p2p.match_rank >= 0).all() for r in analysis.run.ranks), case.schedule
        summary = analysis.to_json()
        assert summary["run"]["framework"] == "mindspore"
        assert summary["metrics"]["overlap_mode"] == case.overlap_p2p
        if case.overlap_p2p:
            log = (tmp_path / f"case-{index}" / fmt.rank_log_name(0)).read_text()
            assert '"th":"overlap"' in log

    # the other views work unchanged on a MindSpore recording
    assert main(["export", str(tmp_path / "case-0"), "-o", str(tmp_path / "case-0.pftrace")]) == 0
    assert (tmp_path / "case-0.pftrace").stat().st_size > 1000
    text, error = asyncio.run(_open_in_tui(tmp_path / "case-0"))
    assert error is None and "r0 main" in text and "r1 main" in text


async def _open_in_tui(run_dir) -> tuple[str, str | None]:
    from pipetrace.tui.app import PipetraceApp

    app = PipetraceApp(run_dir)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_loaded(pilot)
        text = "\n".join(
            "".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips()
        )
        return text, app.load_error


def test_run_cli_trains_with_parity_and_analyze_finds_it_clean(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipetrace",
            "run",
            "--backend",
            "mindspore",
            "-s",
            "zb1p",
            "-p",
            "2",
            "-m",
            "4",
            "-n",
            "2",
            "--check-parity",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "zb1p: 2 ranks, 2 stages on ranks 0,1, 4 micro-batches, plain P2P"
    assert [line.split()[:2] for line in lines[1:3]] == [["step", "1"], ["step", "2"]]
    assert lines[-2].startswith(
        "parity ok: loss and gradients match a single-process run (9 quantities"
    )
    header = json.loads((out / fmt.rank_log_name(1)).read_text().splitlines()[0])
    assert (header["framework"], header["framework_version"][:4]) == ("mindspore", "2.10")
    analyzed = subprocess.run(
        [sys.executable, "-m", "pipetrace", "analyze", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert analyzed.returncode == 0, analyzed.stdout[-3000:]
    assert not [f for f in json.loads(analyzed.stdout)["findings"] if f["severity"] == "error"]


def test_crashing_rank_is_diagnosed_and_nothing_is_left_running(tmp_path):
    """Rank 1 raises in 1F1; rank 0, waiting on it, is stopped after the grace; every process
    (scheduler included) is gone; the analyzer names rank 1's exception as the cause."""
    from pipetrace.runtime.mindspore.cluster import launch

    case = dataclasses.replace(BASE, steps=1, check_parity=False)
    result = launch(
        [case],
        make_recorder=Record(str(tmp_path), several=True, backend="mindspore"),
        custom_functions=[(StepKind.F, RaiseAt(1, "1F1"))],
        kill_grace=2.0,
    )
    first, *others = result.failures
    assert (first.rank, first.error) == (1, "RuntimeError: injected failure in 1F1")
    assert "tests/ranks.py" in first.traceback
    assert [(f.rank, f.error) for f in others] == [
        (0, "killed: still running 2 s after rank 1 failed")
    ]
    assert len(result.pids) == 3 and not [pid for pid in result.pids if alive(pid)]
    assert not children_of_this_process()
    analyzed = subprocess.run(
        [sys.executable, "-m", "pipetrace", "analyze", "--json", str(tmp_path / "case-0")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert analyzed.returncode == 1
    first_finding = json.loads(analyzed.stdout)["findings"][0]
    assert (first_finding["kind"], first_finding["severity"], first_finding["ranks"]) == (
        "rank_failed",
        "error",
        [1],
    )
    assert "injected failure in 1F1" in first_finding["message"]


def test_hanging_rank_is_ended_by_the_watchdog_and_diagnosed_as_a_stall(tmp_path):
    from pipetrace.runtime.mindspore.cluster import launch

    case = dataclasses.replace(
        BASE, check_parity=False, timeout=60, stall_timeout=2, abort_timeout=1
    )
    result = launch(
        [case],
        make_recorder=Record(str(tmp_path), 2, 1, several=True, backend="mindspore"),
        custom_functions=[(StepKind.B, BlockAt(1, "1B1", iteration=1))],
        kill_grace=2.0,
    )
    assert not result.ok
    assert not [pid for pid in result.pids if alive(pid)]  # workers and scheduler
    analysis = analyze(load_run(tmp_path / "case-0", workers=0))
    stalled = next(f for f in analysis.findings if f.kind == "rank_stalled")
    assert stalled.severity == "error" and "1B1" in stalled.message
    assert stalled.details["chain"] == [0, 1] and stalled.details["terminal_state"] == "computing"
    assert analysis.run.ranks[1].status.state == "aborted"
