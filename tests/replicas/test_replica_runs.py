"""Every replica recorded, for real: `pipetrace run --data-parallel 2 --fsdp`, and a 2-"node"
job (two torchrun launches on 127.0.0.1 with a common c10d rendezvous, each node with its own
PIPETRACE_DIR), pipeline degree 2 x data parallel 2, clean and with a hang on one rank of
replica 1, analyzed as `pipetrace analyze node0/ node1/`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipetrace
from pipetrace.analyze import findings as fk
from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.load import load_run
from pipetrace.export.layout import process_name
from pipetrace.recorder import format as fmt
from pipetrace.runtime.launch import free_port
from pipetrace.tui.describe import describe
from pipetrace.tui.lanes import COMM
from pipetrace.tui.session import open_session
from tests.analyze.conftest import untimed_problems

pytestmark = pytest.mark.multiproc

REPO = Path(pipetrace.__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
JOB = ["--schedule", "1f1b", "--ranks", "2", "--data-parallel", "2", "--fsdp"]
JOB += ["--microbatches", "4", "--steps", "2"]


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


def pipetrace_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pipetrace", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=_env())


def two_node_job(root: Path, *worker_args: str) -> list[Path]:
    """Both nodes' launches, at once; returns each node's directory."""
    port, launches = free_port(), []
    root.mkdir()
    for node in (0, 1):
        command = [str(TORCHRUN), "--nnodes", "2", "--node-rank", str(node)]
        command += ["--nproc-per-node", "2", "--rdzv-backend", "c10d"]
        command += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "replicas-test"]
        command += ["-m", "pipetrace.runtime.worker", *JOB, "--timeout", "20", *worker_args]
        env = _env(
            PIPETRACE_DIR=str(root / f"node{node}"),
            PIPETRACE_STALL_TIMEOUT="3",
            PIPETRACE_ABORT_TIMEOUT="2",
        )
        with (root / f"node{node}.log").open("w") as log:  # the child keeps its own copy
            launches.append(
                subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            )
    try:
        for launch in launches:
            launch.wait(timeout=240)
    finally:
        for launch in launches:
            if launch.poll() is None:
                launch.kill()
                launch.wait()
    return [root / "node0", root / "node1"]


def test_pipetrace_run_records_every_replica(tmp_path):
    """Replica 1's stage 0 is slow: with FSDP the replicas meet at every all-gather, so their
    last ranks arrive together at the end; the one the others wait for is still named."""
    out = tmp_path / "run"
    slow = "straggler:rank=0,replica=1,factor=8"
    done = pipetrace_cli("run", *JOB, "--inject", slow, "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.glob("rank-*")) == [fmt.rank_log_name(r) for r in range(4)]
    report = pipetrace_cli("analyze", str(out))
    assert "ERROR" not in report.stdout, report.stdout + report.stderr
    assert "slowest: replica 1" in report.stdout, report.stdout
    assert "Replicas (2 pipelines)" in report.stdout
    assert "replica 0 (global ranks 0-1)" in report.stdout
    assert "replica 1 (global ranks 2-3)" in report.stdout
    assert "gradient reduction waited" in report.stdout
    one = pipetrace_cli("analyze", str(out), "--replica", "1", "--json", "--no-cache")
    times = {r["replica"]: r["mean_ns"] for r in json.loads(one.stdout)["replicas"]["replicas"]}
    assert times[0] is None and times[1] > 0  # the loaded replica is measured, alone


def test_two_nodes_clean_then_a_hang_confined_to_replica_1(tmp_path):
    nodes = two_node_job(tmp_path / "clean")
    assert not (nodes[1] / fmt.META_FILE).exists()  # meta.json is where global rank 0 ran
    clean = analyze(load_run(nodes, workers=0))
    run = clean.run
    assert [r.header.get("replica") for r in run.ranks] == [0, 0, 1, 1]
    assert run.pipelines.groups == ((0, 1), (2, 3))
    assert {r.status.state for r in run.ranks} == {"finished"}
    for rank in run.ranks:  # every message of a replica stays in its pipeline, and matched
        assert set(rank.p2p.peer.tolist()) <= set(run.pipelines.members(rank.header["replica"]))
        assert (rank.p2p.match_rank >= 0).all()
    assert untimed_problems(clean.findings) == []
    assert clean.replicas is not None and len(clean.replicas.skew) == 2
    names = [process_name(run, rank) for rank in run.ranks]  # the export's process tracks
    assert names[3] == "replica 1, stage 1, global rank 3"
    session = open_session(nodes, workers=0)
    assert session.run.rank_name(2) == "replica 1, stage 0, global rank 2"
    op = describe(session, session.index.lane_of(3, COMM), 0)  # the TUI's details of an op
    assert op.title.startswith("replica 1, stage 1, global rank 3 · recv of 1RECV_F0")
    assert dict(op.rows)["recv"].startswith("from replica 1, stage 0, global rank 2, channel F")

    nodes = two_node_job(tmp_path / "hang", "--inject", "hang:rank=1,replica=1")
    report = pipetrace_cli("analyze", "--json", *map(str, nodes))
    assert report.returncode == 1, report.stderr
    (finding,) = [f for f in json.loads(report.stdout)["findings"] if f["severity"] == fk.ERROR]
    assert finding["kind"] == fk.RANK_STALLED and finding["details"]["terminal_rank"] == 3
    message = finding["message"]
    assert "replica 1, stage 1, global rank 3 is still in 1F1" in message
    assert (
        "the hang is confined to replica 1: replica 0 was waiting for it in the gradient "
        "reduction" in message
    )
    assert finding["details"]["replicas"]["hung"] == 1
    assert finding["details"]["replicas"]["waiting"] == [0]


def dp_pipelining(run_dir: Path, **env: str) -> subprocess.CompletedProcess:
    """dp_pipelining.py under torchrun, 4 processes, recorded into ``run_dir``."""
    command = [str(TORCHRUN), "--nproc-per-node", "4", "--master-addr", "127.0.0.1"]
    command += [
        "--master-port",
        str(free_port()),
        str(Path(__file__).with_name("dp_pipelining.py")),
    ]
    env = _env(PIPETRACE_DIR=str(run_dir), **env)
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)


def test_torch_pipelining_groups_record_as_replicas(tmp_path):
    """A torch.distributed.pipelining job of two pipeline groups records like the runtime."""
    run_dir = tmp_path / "run"
    done = dp_pipelining(run_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    analysis = analyze(load_run(run_dir, workers=0))
    run = analysis.run
    assert run.pipelines.groups == ((0, 1), (2, 3))
    assert [r.header["pipeline_rank"] for r in run.ranks] == [0, 1, 0, 1]
    assert {int(p) for p in run.ranks[3].p2p.peer} == {2}
    assert untimed_problems(analysis.findings) == []
    assert analysis.replicas is not None and len(analysis.replicas.skew) == 2


def test_a_hang_in_one_replica_is_the_error_and_the_lost_connections_of_the_other_follow(
    tmp_path,
):
    """Global rank 3 hangs; its pipeline's watchdogs end replica 1, and replica 0's ranks,
    waiting in the script's own all-reduce with them, raise "Connection closed" (or get
    torchrun's SIGTERM first): the hang's consequences, not a root cause listed before it."""
    run_dir = tmp_path / "run"
    done = dp_pipelining(
        run_dir, DP_HANG_RANK="3", PIPETRACE_STALL_TIMEOUT="2", PIPETRACE_ABORT_TIMEOUT="1"
    )
    assert done.returncode != 0
    analysis = analyze(load_run(run_dir, workers=0))
    errors = [f for f in analysis.findings if f.severity == fk.ERROR]
    assert [f.kind for f in errors] == [fk.RANK_STALLED], [f.message for f in errors]
    assert errors[0].details["terminal_rank"] == 3
    # replica 0's ranks lose their connection in the all-reduce, unless torchrun's SIGTERM
    # reaches them first (as the hung replica's ranks exit): either way no error of theirs
    lost = [f for f in analysis.findings if f.kind == fk.RANK_FAILED and "onnection" in f.message]
    assert all("watchdog" in f.cause for f in lost), [f.cause for f in lost]


def test_a_recovered_stall_names_the_paused_rank_not_another_replicas_step(tmp_path):
    """Global rank 3 pauses 3 s in a forward: replica 0 waits in the script's all-reduce,
    outside any step (no stall of its own), so where the time went is looked for in
    replica 1, the stalled ranks' pipeline."""
    run_dir = tmp_path / "run"
    done = dp_pipelining(run_dir, DP_PAUSE_RANK="3", PIPETRACE_STALL_TIMEOUT="1.5")
    assert done.returncode == 0, done.stdout + done.stderr
    analysis = analyze(load_run(run_dir, workers=0))
    (recovered,) = [f for f in analysis.findings if f.kind == fk.STALL_RECOVERED]
    longest = recovered.details["longest"]
    assert longest["rank"] == 3 and longest["duration_ns"] > 2 * 10**9, longest


def test_a_deadlock_in_one_replica_is_confined_while_the_other_waits_in_fsdps_all_gather(
    tmp_path,
):
    """Replica 0's stage-1 rank waits inside 1F0 for FSDP's parameter all-gather, which
    replica 1's rank never joins: a collective wait, not a step that never returns."""
    out = tmp_path / "run"
    done = pipetrace_cli(
        "run", *JOB[:-2], "--steps", "3", "--inject", "deadlock:replica=1", "--out", str(out)
    )
    assert done.returncode == 1, done.stdout + done.stderr
    report = pipetrace_cli("analyze", "--json", str(out))
    errors = [f for f in json.loads(report.stdout)["findings"] if f["severity"] == fk.ERROR]
    assert [f["kind"] for f in errors] == [fk.DEADLOCK], [f["message"] for f in errors]
    confined = "the hang is confined to replica 1: replica 0 was waiting for it in the"
    assert f"{confined} parameter all-gather (1F0)" in errors[0]["message"]
