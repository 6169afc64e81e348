"""`pipetrace export DIR`: a recorded run as a trace file for ui.perfetto.dev."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipetrace.cli.load_options import Loading, load_options
from pipetrace.cli.run_args import RUN_DIRS_HELP, NamedPath, run_dirs
from pipetrace.errors import EXIT_OK
from pipetrace.printable import printable

if TYPE_CHECKING:
    from pipetrace.analyze.findings import Finding
    from pipetrace.analyze.model import Run


class _Progress:
    """One status line on stderr, shown only once the export has taken more than `delay`
    seconds: redrawn in place on a terminal, one line per phase otherwise."""

    def __init__(self, delay: float = 0.7) -> None:
        self.delay = delay
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.phase = ""
        self.said = ""
        self.shown = False

    def __call__(self, phase: str, fraction: float | None = None) -> None:
        self.phase = phase
        if time.monotonic() - self.started < self.delay:
            return
        if self.tty:
            line = f"pipetrace export: {phase}" + (
                f" {fraction:4.0%}" if fraction is not None else ""
            )
            sys.stderr.write("\r" + line + "\x1b[K")
            sys.stderr.flush()
            self.shown = True
        elif phase != self.said:
            self.said = phase
            sys.stderr.write(f"pipetrace export: {phase}...\n")

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


@click.command(epilog=RUN_DIRS_HELP)
@run_dirs
@click.option(
    "-o",
    "--output",
    type=NamedPath(dir_okay=False, path_type=str),
    help="Trace file to write [default: DIR.pftrace, or DIR.json, next to the run directory "
    "(the one holding meta.json)].",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["perfetto", "chrome-json"]),
    default="perfetto",
    show_default=True,
    help="Native Perfetto protobuf, or Chrome JSON for tools that read only that.",
)
@click.option(
    "--open",
    "open_ui",
    is_flag=True,
    help="Then serve the file once on 127.0.0.1 and print the ui.perfetto.dev link that opens it.",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=9001,
    show_default=True,
    help="Port for --open (ui.perfetto.dev only fetches from 9001; 0 picks a free one).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=300.0,
    show_default=True,
    help="Seconds --open waits for the browser to fetch the file.",
)
@click.option("--no-findings", is_flag=True, help="Do not run the analyzers (no findings track).")
@click.option(
    "--workers",
    type=click.IntRange(min=0),
    default=None,
    help="Processes that parse rank logs (default: automatic; 0: none).",
)
@load_options
def export(
    run_dirs: tuple[str, ...],
    output: str | None,
    fmt: str,
    open_ui: bool,
    port: int,
    timeout: float,
    no_findings: bool,
    workers: int | None,
    loading: Loading,
) -> int:
    """Export a recorded run as a trace for ui.perfetto.dev (or chrome://tracing).

    One process per rank with its steps, P2P ops (arrows from each send to its recv's
    completion), bubbles, in-flight counters and the analyzers' findings; runs that hung or
    crashed export too, their open spans marked unfinished. See docs/export.md.

    \b
    Examples:
      pipetrace export runs/a                 # writes runs/a.pftrace
      pipetrace export runs/a --open          # then prints the link that opens it
      pipetrace export runs/a --format chrome-json -o a.json
      pipetrace export 'runs/node*' -o job.pftrace   # one run, a directory per node
    """
    from pipetrace.analyze.load import load_run
    from pipetrace.analyze.source import open_source
    from pipetrace.export import default_output, export_run
    from pipetrace.export.output import check_not_the_run, check_output

    if output:
        check_output(Path(output))  # before the run is read: a bad target fails at once
    source = open_source(run_dirs)
    out = Path(output) if output else default_output(source.path, fmt)
    check_output(out)
    check_not_the_run(out, source.directories)
    progress = _Progress()
    try:
        progress("loading rank logs")
        run = load_run(
            source,
            progress=lambda done, total: progress("loading rank logs", done / total),
            workers=workers,
            **loading.kwargs(),
        )
        findings = None if no_findings else _findings(run, progress)
        summary = export_run(run, out, fmt=fmt, findings=findings, progress=progress)
    finally:
        progress.close()
    for problem in run.problems:
        click.echo(
            f"pipetrace export: input {problem.severity}: {printable(problem.message)}", err=True
        )
    found = (
        "" if findings is None else f", {len(findings)} finding{'s' if len(findings) != 1 else ''}"
    )
    click.echo(
        f"wrote {summary.path} ({_size(summary.bytes)}: {summary.slices:,} slices, "
        f"{summary.flows:,} message arrows{found}) in {summary.seconds:.1f} s"
    )
    if not open_ui:
        click.echo("open it at https://ui.perfetto.dev (Open trace file), or run again with --open")
        return EXIT_OK
    _serve(summary.path, port, timeout)
    return EXIT_OK


def _findings(run: Run, progress: _Progress) -> list[Finding] | None:
    """The analyzers' findings; None (exported without them, with a warning) if they fail:
    a run the analyzers choke on is exactly the one the user wants to look at."""
    from pipetrace.analyze.analysis import analyze_cached

    progress("analyzing")
    try:
        return analyze_cached(run).findings
    except Exception as exc:
        click.echo(
            "pipetrace export: warning: the analyzers failed "
            f"({type(exc).__name__}: {exc}); exporting without findings",
            err=True,
        )
        return None


def _serve(path: Path, port: int, timeout: float) -> None:
    from pipetrace.export.serve import serve_once

    def ready(link: str) -> None:
        click.echo(f"open {link}")
        click.echo(f"serving {path.name} once on 127.0.0.1 (Ctrl-C to stop)", err=True)

    try:
        served = serve_once(path, port=port, timeout=timeout, ready=ready)
    except KeyboardInterrupt:
        click.echo("stopped serving", err=True)
        return
    if not served:
        click.echo(f"nobody fetched the trace within {timeout:g} s; it stays at {path}", err=True)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
