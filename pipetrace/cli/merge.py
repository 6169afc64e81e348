"""`pipetrace merge DIR... -o OUT`: a run spread over several directories, as one directory.

The run is gathered as every other command gathers it (`pipetrace.analyze.source`), then its
meta.json, run id and every rank log found are copied into OUT. OUT's files are created new,
never through a link (`recorder.run_dir.create_new_file`), in a directory that is neither a
link nor another user's (`check_directory`); a directory that already holds a run is only
replaced with ``--overwrite``, and never when it is one of the inputs. The inputs are only read.
"""

from __future__ import annotations

import itertools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipetrace.cli.run_args import RUN_DIRS_HELP, run_dirs
from pipetrace.errors import EXIT_OK, EXIT_PROBLEMS, PipetraceError
from pipetrace.records import JsonRecord

if TYPE_CHECKING:
    from pipetrace.analyze.source import RunSource


@dataclass
class MergeSummary(JsonRecord):
    """What `pipetrace merge` wrote (its --json)."""

    output: str
    directories: list[str]
    meta_from: str
    ranks_copied: int
    ranks_missing: list[int]
    bytes: int
    problems: list[dict]


@click.command(epilog=RUN_DIRS_HELP)
@run_dirs
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The run directory to write (created if absent).",
)
@click.option(
    "--overwrite", is_flag=True, help="Replace the run OUTPUT already holds (never an input)."
)
@click.option("--json", "as_json", is_flag=True, help="What was written, as JSON.")
def merge(run_dirs: tuple[str, ...], output: Path, overwrite: bool, as_json: bool) -> int:
    """Write a run recorded into several directories (one per node) as one run directory.

    meta.json comes from whichever directory has it (copies must agree), each rank's log
    from whichever directory holds it; ranks without a log anywhere are named. Directories of
    two different runs are refused. The inputs are not changed.

    Exit code 0: every rank's log copied; 1: some ranks have no log, or a log was found
    twice with different sizes (the rest is copied); 2: unusable input or output.

    \b
    Examples:
      pipetrace merge runs/node0 runs/node1 -o runs/job
      pipetrace merge 'runs/node*' -o runs/job --json
      pipetrace merge 'runs/node*' -o runs/job --overwrite
    """
    from pipetrace.analyze.source import open_source
    from pipetrace.cli.schedule import echo_json

    source = open_source(run_dirs)
    _prepare_output(output, source.directories, overwrite)
    summary = _copy_run(source, output)
    if as_json:
        echo_json(summary.to_json())
    else:
        for problem in summary.problems:
            click.echo(f"pipetrace merge: {problem['severity']}: {problem['message']}", err=True)
        click.echo(
            f"wrote {output}: meta.json from {summary.meta_from}, {summary.ranks_copied} rank "
            f"log(s) from {len(summary.directories)} directories ({summary.bytes:,} bytes)"
        )
    damaged = any(p["severity"] == "warning" for p in summary.problems)
    return EXIT_PROBLEMS if summary.ranks_missing or damaged else EXIT_OK


def _prepare_output(output: Path, inputs: tuple[Path, ...], overwrite: bool) -> None:
    """Make OUTPUT a directory of ours that holds no run (removing one with ``overwrite``)."""
    from pipetrace.recorder import run_dir

    if any(os.path.lexists(output) and _same(output, d) for d in inputs):
        raise PipetraceError(f"{output} is one of the directories being merged: pass another -o")
    run_dir.check_directory(output, create=True)
    previous = run_dir.previous_run_files(output)
    if previous and not overwrite:
        raise PipetraceError(
            f"{output} already holds a run ({previous[0].name}): pass --overwrite to replace "
            "it, or another -o"
        )
    run_dir.remove_previous_run(output)


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _copy_run(source: RunSource, output: Path) -> MergeSummary:
    """Copy meta.json, the run id and every rank log present into OUTPUT."""
    from pipetrace.recorder import format as fmt

    size = _copy(source.meta_dir / fmt.META_FILE, output)
    if os.path.lexists(source.meta_dir / fmt.RUN_ID_FILE):
        size += _copy(source.meta_dir / fmt.RUN_ID_FILE, output)
    present = [os.path.lexists(log) for log in source.logs]
    for log in itertools.compress(source.logs, present):
        size += _copy(log, output)
    return MergeSummary(
        str(output),
        [str(d) for d in source.directories],
        str(source.meta_dir),
        sum(present),
        [rank for rank, here in enumerate(present) if not here],
        size,
        [p.to_json() for p in source.problems],
    )


def _copy(path: Path, output: Path) -> int:
    """Copy one regular file into OUTPUT as a new file; returns its size."""
    from pipetrace.analyze.reader import open_regular
    from pipetrace.recorder.run_dir import create_new_file

    try:
        with open_regular(path) as src, os.fdopen(create_new_file(output / path.name), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
            return dst.tell()
    except OSError as exc:
        raise PipetraceError(f"cannot copy {path} to {output}: {exc.strerror or exc}") from None
