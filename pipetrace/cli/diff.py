"""`pipetrace diff RUN_A RUN_B`: two recorded runs side by side."""

from __future__ import annotations

import sys

import click

from pipetrace.cli.run_args import NamedPath
from pipetrace.errors import PipetraceError


@click.command()
@click.argument("runs", metavar="[RUN_A RUN_B]", nargs=-1, type=NamedPath(path_type=str))
@click.option(
    "-a",
    "run_a_dirs",
    multiple=True,
    metavar="DIR",
    type=NamedPath(path_type=str),
    help="A directory (or glob) of run A; repeat it for a run spread over several.",
)
@click.option(
    "-b",
    "run_b_dirs",
    multiple=True,
    metavar="DIR",
    type=NamedPath(path_type=str),
    help="A directory (or glob) of run B; repeat it for a run spread over several.",
)
@click.option("--json", "as_json", is_flag=True, help="The comparison as JSON (docs/analyze.md).")
def diff(
    runs: tuple[str, ...], run_a_dirs: tuple[str, ...], run_b_dirs: tuple[str, ...], as_json: bool
) -> int:
    """Compare two recorded runs: per-stage step times, bubbles and iteration time, with
    the change from A to B. Exit code 0, or 2 when a run cannot be read; damage in a run
    that can be read (input warnings, as analyze reports them) is said on stderr.

    Give the two runs either as RUN_A RUN_B (one directory or quoted glob each), or, for
    runs spread over several directories (one per node), as -a DIR... -b DIR...

    \b
    Examples:
      pipetrace diff runs/plain runs/overlap
      pipetrace diff runs/a runs/b --json
      pipetrace diff 'runs/a/node*' 'runs/b/node*'
      pipetrace diff -a runs/a/node0 -a runs/a/node1 -b runs/b/node0 -b runs/b/node1
    """
    from pipetrace.analyze.analysis import analyze_cached
    from pipetrace.analyze.diff import diff_runs, render
    from pipetrace.analyze.load import load_run
    from pipetrace.cli.schedule import echo_json

    loaded = [load_run(dirs) for dirs in _two_runs(runs, run_a_dirs, run_b_dirs)]
    for label, run in zip("AB", loaded):
        for problem in run.problems:
            if problem.severity == "warning":  # damage the comparison must not hide
                click.echo(
                    f"pipetrace diff: run {label}: input warning: {problem.message}", err=True
                )
    result = diff_runs(*map(analyze_cached, loaded))
    if as_json:
        echo_json(result)
    else:
        render(result, sys.stdout)
    return 0


def _two_runs(
    runs: tuple[str, ...], a: tuple[str, ...], b: tuple[str, ...]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Each run's directories, from RUN_A RUN_B or from -a/-b (never both)."""
    if a or b:
        if runs or not (a and b):
            raise PipetraceError(
                "give the runs as RUN_A RUN_B, or as -a DIR... -b DIR... (both -a and -b, "
                "and no RUN_A RUN_B with them)"
            )
        return a, b
    if len(runs) != 2:
        raise PipetraceError(
            f"give two runs (RUN_A RUN_B, or -a DIR... -b DIR...), not {len(runs)} path(s)"
        )
    return (runs[0],), (runs[1],)
