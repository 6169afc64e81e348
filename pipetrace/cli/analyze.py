"""`pipetrace analyze DIR`: what went wrong in a recorded run, and where the time went."""

from __future__ import annotations

import io
import sys
import time
from typing import IO, TYPE_CHECKING

import click

from pipetrace.cli.load_options import Loading, load_options
from pipetrace.cli.run_args import RUN_DIRS_HELP, run_dirs
from pipetrace.errors import EXIT_OK, EXIT_PROBLEMS

if TYPE_CHECKING:
    from pipetrace.analyze.source import RunSource


class _LazyProgress:
    """A rich progress bar on stderr, shown only on a terminal and only once loading has
    taken more than `delay` seconds."""

    def __init__(self, delay: float = 0.5) -> None:
        self.delay = delay
        self.started = time.monotonic()
        self.bar = None
        self.task = None
        self.enabled = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            if time.monotonic() - self.started < self.delay or done >= total:
                return
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self.bar = Progress(
                "loading rank logs",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(file=sys.stderr),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("load", total=total)
        self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@click.command(epilog=RUN_DIRS_HELP)
@run_dirs
@click.option(
    "--json", "as_json", is_flag=True, help="Findings and metrics as JSON (docs/analyze.md)."
)
@click.option(
    "--workers",
    type=click.IntRange(min=0),
    default=None,
    help="Processes that parse rank logs (default: automatic; 0: none).",
)
@click.option(
    "--no-segments", is_flag=True, help="Leave the critical path's segments out of --json."
)
@load_options
def analyze(
    run_dirs: tuple[str, ...],
    as_json: bool,
    workers: int | None,
    no_segments: bool,
    loading: Loading,
) -> int:
    """Diagnose a recorded run: hangs, failures, message problems, plan divergence,
    stragglers, exposed communication; then iteration time, bubbles, per-stage step
    times, the critical path and clock alignment.

    Exit code 0: no errors; 1: a finding of severity error or an input warning (damaged
    or missing files); 2: unusable input.

    \b
    Examples:
      pipetrace run -s 1f1b -p 4 -m 8 --out runs/a && pipetrace analyze runs/a
      pipetrace analyze runs/a --json | jq '.findings[] | select(.severity == "error")'
      pipetrace analyze runs/node0 runs/node1     # one run, a directory per node
      pipetrace analyze 'runs/node*'              # the same, as a glob
      pipetrace analyze runs/big --ranks 0-3,8    # only these ranks
      pipetrace analyze runs/big --replica 1      # only replica 1's pipeline
    """
    from pipetrace.analyze.load import run_entry
    from pipetrace.analyze.source import open_source
    from pipetrace.cli.schedule import use_color

    source = open_source(run_dirs)
    if not as_json and use_color():  # rendered for the terminal, each time
        return _analyze_into(
            sys.stdout, source, workers, loading, as_json, no_segments, color=True
        )[0]
    # the output is kept beside the run's cache entry: analyzing an unchanged run again is a read
    entry = run_entry(source, loading.select) if loading.cache else None
    variant = ("json-no-segments" if no_segments else "json") if as_json else "text"
    kept = entry.report(variant) if entry else None
    if kept is None:
        out = io.StringIO()
        code, live = _analyze_into(out, source, workers, loading, as_json, no_segments)
        kept = code, out.getvalue()
        if entry and not live:  # a run still recording is read afresh each time
            entry.store_report(variant, *kept)
    click.echo(kept[1], nl=False)  # rendered escaped (the key hashes pipetrace's code)
    return kept[0]


def _analyze_into(
    out: IO[str],
    source: RunSource,
    workers: int | None,
    loading: Loading,
    as_json: bool,
    no_segments: bool,
    *,
    color: bool = False,
) -> tuple[int, bool]:
    """Analyze the run, write the report or JSON to ``out``; returns the exit code, and
    whether the run is still being recorded (`analyze.live`)."""
    from pipetrace.analyze.analysis import analyze_cached
    from pipetrace.analyze.load import load_run
    from pipetrace.cli.schedule import json_text

    progress = _LazyProgress()
    try:
        run = load_run(source, progress=progress, workers=workers, **loading.kwargs())
    finally:
        progress.close()
    result = analyze_cached(run)
    if as_json:
        out.write(json_text(result.to_json(segments=not no_segments)) + "\n")
    else:
        from pipetrace.analyze.report import render

        render(result, out, color=color)
    damaged = any(p.severity == "warning" for p in run.problems)  # never a clean exit
    return (EXIT_PROBLEMS if result.has_errors or damaged else EXIT_OK), run.recording
