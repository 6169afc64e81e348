from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.findings import Finding
from pipetrace.analyze.load import load_run
from pipetrace.analyze.model import Run
from pipetrace.testing.synthetic import write_synthetic_run
from pipetrace.export.chrome_json import write_chrome_json
from pipetrace.export.layout import Layout, build_layout
from pipetrace.export.perfetto import write_perfetto

from .decode import Decoded, JsonTrace, decode_chrome_json, decode_perfetto
from .recording import record_run


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


# Runs recorded through the real Recorder, shared by the tests (read-only).
RUNS = {
    "clean-1f1b": dict(schedule="1f1b", ranks=3, microbatches=4, iterations=2),
    "overlap-dualpipev": dict(
        schedule="dualpipev", ranks=2, microbatches=4, iterations=2, overlap=True
    ),
    "overlap-zbv": dict(schedule="zbv", ranks=2, microbatches=4, iterations=1, overlap=True),
    "deadlock": dict(schedule="1f1b", scenario="deadlock", iterations=2),
    "stuck": dict(schedule="1f1b", scenario="stuck", iterations=2),
    "crash": dict(schedule="1f1b", scenario="crash", iterations=1, overlap=True),
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
                record_run(path, wait_s=0.5, **RUNS[name])
            cache[name] = export(path)
        return cache[name]

    return get
