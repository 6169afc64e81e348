"""`pipetrace diff RUN_A RUN_B`: two recorded runs side by side."""

from __future__ import annotations

import sys

import click


@click.command()
@click.argument("run_a", type=click.Path(file_okay=False, path_type=str))
@click.argument("run_b", type=click.Path(file_okay=False, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="The comparison as JSON (docs/analyze.md).")
def diff(run_a: str, run_b: str, as_json: bool) -> int:
    """Compare two recorded runs: per-stage step times, bubbles and iteration time, with
    the change from A to B. Exit code 0, or 2 when a run cannot be read.

    \b
    Examples:
      pipetrace diff runs/plain runs/overlap
      pipetrace diff runs/a runs/b --json
    """
    from pipetrace.analyze.analysis import analyze
    from pipetrace.analyze.diff import diff_runs, render
    from pipetrace.analyze.load import load_run
    from pipetrace.cli.schedule import echo_json

    result = diff_runs(analyze(load_run(run_a)), analyze(load_run(run_b)))
    if as_json:
        echo_json(result)
    else:
        render(result, sys.stdout)
    return 0
