"""Export a recorded run as a trace for ui.perfetto.dev: native Perfetto protobuf, or Chrome JSON.

    from pipetrace.analyze.load import load_run
    from pipetrace.analyze.analysis import analyze
    from pipetrace.export import export_run
    run = load_run("runs/a")
    summary = export_run(run, "runs/a.pftrace", findings=analyze(run).findings)

`layout.build_layout` decides what the trace shows (docs/export.md); `perfetto` and
`chrome_json` write it; `serve` hands the file to the UI.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipetrace.analyze.findings import Finding
from pipetrace.analyze.model import Run
from pipetrace.errors import PipetraceError
from pipetrace.export.output import write_file

PERFETTO, CHROME_JSON = "perfetto", "chrome-json"
FORMATS = (PERFETTO, CHROME_JSON)
SUFFIXES = {PERFETTO: ".pftrace", CHROME_JSON: ".json"}

Progress = Callable[[str, float | None], None]
"""Called as ``progress(phase, fraction or None)``."""


@dataclass
class ExportSummary:
    path: Path
    format: str
    bytes: int
    tracks: int
    slices: int
    instants: int
    counters: int
    flows: int
    findings: int
    seconds: float

    @property
    def events(self) -> int:
        """Trace events written: a begin and an end per slice, plus instants and counter samples."""
        return 2 * self.slices + self.instants + self.counters


def default_output(run_dir: str | Path, fmt: str = PERFETTO) -> Path:
    """``DIR.pftrace`` (``DIR.json``) next to the run directory."""
    d = Path(run_dir)
    if d.name in ("", ".", ".."):
        d = d.resolve()
    if not d.name:
        raise PipetraceError(f"cannot name an output next to {run_dir}; pass -o FILE")
    return d.with_name(d.name + SUFFIXES[fmt])


def export_run(
    run: Run,
    out: str | Path,
    *,
    fmt: str = PERFETTO,
    findings: list[Finding] | None = None,
    progress: Progress | None = None,
) -> ExportSummary:
    """Write ``run`` to ``out`` (atomically, and only as a regular file: `output.write_file`)."""
    from pipetrace.export.layout import build_layout

    if fmt not in FORMATS:
        raise PipetraceError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    start = time.perf_counter()
    if progress:
        progress("laying out", None)
    layout = build_layout(run, findings)
    if fmt == PERFETTO:
        from pipetrace.export.perfetto import write_perfetto as write
    else:
        from pipetrace.export.chrome_json import write_chrome_json as write
    out = Path(out)
    size = write_file(
        out,
        lambda f: write(
            layout, f, progress=(lambda x: progress("writing", x)) if progress else None
        ),
    )
    return ExportSummary(
        path=out,
        format=fmt,
        bytes=size,
        tracks=len(layout.tracks),
        slices=len(layout.slices),
        instants=len(layout.instants),
        counters=len(layout.counters),
        flows=layout.num_flows,
        findings=len(findings or []),
        seconds=time.perf_counter() - start,
    )
