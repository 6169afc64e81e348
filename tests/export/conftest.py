from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.findings import Finding
from pipetrace.analyze.load import load_run
from pipetrace.analyze.model import Run
from pipetrace.export.chrome_json import write_chrome_json
from pipetrace.export.layout import Layout, build_layout
from pipetrace.export.perfetto import write_perfetto
from pipetrace.runtime.faults import Crash, DropSend, Hang
from pipetrace.testing.cluster import FakeCluster
from pipetrace.testing.synthetic import write_synthetic_run

from .decode import Decoded, JsonTrace, decode_chrome_json, decode_perfetto


@dataclass
class Exported:
    path: Path
    run: Run
    findings: list[Finding]
    layout: Layout
    trace: Decoded
    json: JsonTrace


def export(path: Path) -> Exported:
    run = load_run(path, workers=0)
    findings = analyze(run).findings
    layout = build_layout(run, findings)
    proto, js = io.BytesIO(), io.BytesIO()
    write_perfetto(layout, proto)
    write_chrome_json(layout, js)
    return Exported(
        path,
        run,
        findings,
        layout,
        decode_perfetto(proto.getvalue()),
        decode_chrome_json(js.getvalue()),
    )


# Runs of the fake cluster (real Recorders, virtual time), shared by the tests (read-only);
# ``overlap``: every recv posted at the iteration's start, sends drained at its end.
RUNS = {
    "clean-1f1b": dict(schedule="1f1b", ranks=3),
    "overlap-dualpipev": dict(schedule="dualpipev", overlap=True),
    "overlap-zbv": dict(schedule="zbv", iterations=1, overlap=True),
    # in the last iteration rank 0 never posts 0SEND_F1: rank 1 blocks in 1RECV_F1, and rank 0
    # later in 0RECV_B0, waiting for rank 1
    "deadlock": dict(faults=[DropSend(rank=0, step=1, microbatch=1, channel="F")]),
    # in the last iteration rank 1 never returns from its first backward; rank 0 waits for it
    "stuck": dict(faults=[Hang(rank=1, step=1, microbatch=0, phase="B")]),
    "crash": dict(
        iterations=1, overlap=True, faults=[Crash(rank=1, step=0, microbatch=0, phase="B")]
    ),
}


@pytest.fixture(scope="session")
def recorded(tmp_path_factory):
    cache: dict[str, Exported] = {}

    def get(name: str) -> Exported:
        if name not in cache:
            path = tmp_path_factory.mktemp(name) / "run"
            if name.startswith("synthetic-"):
                schedule = name.split("-", 1)[1]
                write_synthetic_run(
                    path,
                    schedule=schedule,
                    num_ranks=4,
                    num_microbatches=8,
                    iterations=2,
                    stages_per_rank=2 if schedule == "interleaved-1f1b" else None,
                )
            else:
                FakeCluster.of(**{"ranks": 2, **RUNS[name]}).record(path)
            cache[name] = export(path)
        return cache[name]

    return get
