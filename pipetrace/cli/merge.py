"""`pipetrace merge DIR... -o OUT`: a run spread over several directories, as one directory.

The run is gathered as every other command gathers it (`pipetrace.analyze.source`), then its
meta.json, run id and every readable rank log found are copied into OUT. OUT's files are created
new, never through a link (`recorder.run_dir.create_new_file`), in a directory that is neither a
link nor another user's (`check_directory`); a directory that already holds a run is only
replaced with ``--overwrite``, and never when it is one of the inputs. The inputs are only read.

A rank log that cannot be read (not a regular file, a read error) is treated as the analysis
treats it: that rank counts as missing, named with the reason, and the rest is copied. The copy
is made in a private directory inside OUT and moved into place only once all of it is written,
so an error midway (a full disk) leaves OUT as it was, its previous run included, and a retry
is not refused.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import click

from pipetrace.cli.run_args import RUN_DIRS_HELP, NamedPath, run_dirs
from pipetrace.errors import EXIT_OK, EXIT_PROBLEMS, PipetraceError
from pipetrace.printable import printable
from pipetrace.records import JsonRecord

if TYPE_CHECKING:
    from pipetrace.analyze.model import InputProblem
    from pipetrace.analyze.source import RunSource

CHUNK = 1 << 20
STAGING_PREFIX = ".pipetrace-merge-"
"""The private directory inside OUT the copy is written to (hidden: no reader looks at it)."""


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


class UnreadableLog(Exception):
    """A rank log that cannot be read: that rank is missing from the merged run, not the
    whole merge (``reason`` is the message naming it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@click.command(epilog=RUN_DIRS_HELP)
@run_dirs
@click.option(
    "-o",
    "--output",
    required=True,
    type=NamedPath(file_okay=False, path_type=Path),
    help="The run directory to write (created if absent).",
)
@click.option(
    "--overwrite", is_flag=True, help="Replace the run OUTPUT already holds (never an input)."
)
@click.option("--json", "as_json", is_flag=True, help="What was written, as JSON.")
def merge(run_dirs: tuple[str, ...], output: Path, overwrite: bool, as_json: bool) -> int:
    """Write a run recorded into several directories (one per node) as one run directory.

    meta.json comes from whichever directory has it (copies must agree), each rank's log
    from whichever directory holds it; ranks without a readable log anywhere, and empty
    logs, are named. Directories of two different runs are refused. The inputs are not
    changed; OUTPUT is written in full or, on an error, left as it was.

    Exit code 0: every rank's log copied; 1: some ranks have no readable log, a log is
    empty, or a log was found twice with different sizes (the rest is copied); 2: unusable
    input or output.

    \b
    Examples:
      pipetrace merge runs/node0 runs/node1 -o runs/job
      pipetrace merge 'runs/node*' -o runs/job --json
      pipetrace merge 'runs/node*' -o runs/job --overwrite
    """
    from pipetrace.analyze.source import open_source
    from pipetrace.cli.schedule import echo_json

    source = open_source(run_dirs)
    created = _prepare_output(output, source.directories, overwrite)
    summary = _write_run(source, output, created)
    if as_json:
        echo_json(summary.to_json())
    else:
        for problem in summary.problems:
            click.echo(
                f"pipetrace merge: {problem['severity']}: {printable(problem['message'])}",
                err=True,
            )
        click.echo(
            f"wrote {output}: meta.json from {summary.meta_from}, {summary.ranks_copied} rank "
            f"log(s) from {_directories(len(summary.directories))} ({summary.bytes:,} bytes)"
        )
    damaged = any(p["severity"] == "warning" for p in summary.problems)
    return EXIT_PROBLEMS if summary.ranks_missing or damaged else EXIT_OK


def _prepare_output(output: Path, inputs: tuple[Path, ...], overwrite: bool) -> bool:
    """Make OUTPUT a directory of ours that holds no run, or one ``overwrite`` may replace
    (removed only once the new one is written); True when it was created here."""
    from pipetrace.recorder import run_dir

    if any(os.path.lexists(output) and _same(output, d) for d in inputs):
        raise PipetraceError(f"{output} is one of the directories being merged: pass another -o")
    created = not os.path.lexists(output)
    run_dir.check_directory(output, create=True)
    previous = run_dir.previous_run_files(output)
    if previous and not overwrite:
        raise PipetraceError(
            f"{output} already holds a run ({previous[0].name}): pass --overwrite to replace "
            "it, or another -o"
        )
    return created


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _write_run(source: RunSource, output: Path, created: bool) -> MergeSummary:
    """Copy the run into a staging directory inside OUTPUT, then move it into place. An error
    midway removes the staging directory (and OUTPUT, when it was made here and is empty), so
    nothing half written is left for a retry to refuse as "already holds a run", and a run
    ``--overwrite`` would replace is kept."""
    staging = _staging_directory(output)
    try:
        summary = _copy_run(source, staging, output)
        _move_into_place(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                output.rmdir()
        raise
    staging.rmdir()
    return summary


def _staging_directory(output: Path) -> Path:
    """A new private directory inside OUTPUT: the same file system, so moving out is a rename;
    hidden, so no reader takes it for part of the run should the process be killed."""
    try:
        return Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=output))
    except OSError as exc:
        raise PipetraceError(f"cannot write into {output}: {exc.strerror or exc}") from None


def _move_into_place(staging: Path, output: Path) -> None:
    """Replace OUTPUT's previous run (if any: ``--overwrite`` was checked) by the staged one.
    A rename replaces a name (a planted link included) rather than follow it."""
    from pipetrace.recorder import run_dir

    run_dir.remove_previous_run(output)
    for path in sorted(staging.iterdir()):
        try:
            os.rename(path, output / path.name)
        except OSError as exc:
            raise PipetraceError(
                f"cannot move {path.name} into {output}: {exc.strerror or exc}"
            ) from None


def _copy_run(source: RunSource, staging: Path, output: Path) -> MergeSummary:
    """Copy meta.json, the run id and every readable rank log present into STAGING; a rank
    whose log is absent or unreadable is missing, and named."""
    from pipetrace.analyze.model import InputProblem
    from pipetrace.analyze.reader import read_run_id
    from pipetrace.recorder import format as fmt

    problems = list(source.problems)
    try:
        size = _copy(source.meta_dir / fmt.META_FILE, staging, output)
    except UnreadableLog as exc:
        raise PipetraceError(exc.reason) from None
    run_id = source.meta_dir / fmt.RUN_ID_FILE
    # Each log is checked against its directory's run id: node-derived ids that differ
    # between the inputs (one per node) would set the other nodes' logs aside in OUT.
    if os.path.lexists(run_id) and len({read_run_id(d) for d in source.directories}) == 1:
        size += _copy_or_note(run_id, None, staging, output, problems) or 0
    absent = [rank for rank, log in enumerate(source.logs) if not os.path.lexists(log)]
    if absent and len(source.directories) == 1:  # for several, `open_source` names them
        problems.append(_absent_problem(absent, source.directories[0]))
    missing, skip = list(absent), set(absent)
    for rank, log in enumerate(source.logs):
        foreign = None if rank in skip else _foreign_run_id(log)
        if foreign is not None:  # analyze sets it aside: nothing in OUT could tell it then
            problems.append(
                InputProblem(
                    "warning",
                    f"{log} is from another run (its run id {foreign[0]!r} is not its "
                    f"directory's, {foreign[1]!r}); not copied",
                    rank,
                )
            )
            missing.append(rank)
        elif rank not in skip:
            copied = _copy_or_note(log, rank, staging, output, problems)
            if copied is None:
                missing.append(rank)
            size += copied or 0
    return MergeSummary(
        str(output),
        [str(d) for d in source.directories],
        str(source.meta_dir),
        len(source.logs) - len(missing),
        sorted(missing),
        size,
        [p.to_json() for p in problems],
    )


def _foreign_run_id(log: Path) -> tuple[str, str] | None:
    """(its run id, its directory's) when the log's header names another run than the
    directory it lies in was claimed by; None when they agree or either is unknown."""
    from pipetrace.analyze.reader import TraceFormatError, read_log, read_run_id

    claimed = read_run_id(log.parent)
    if claimed is None:
        return None
    try:
        header, events, _ = read_log(log)
    except (OSError, TraceFormatError):
        return None  # the copy names an unreadable log
    getattr(events, "close", lambda: None)()
    run_id = header.get("run_id")
    return (run_id, claimed) if isinstance(run_id, str) and run_id != claimed else None


def _copy_or_note(
    path: Path, rank: int | None, staging: Path, output: Path, problems: list[InputProblem]
) -> int | None:
    """`_copy`, noting an unreadable input (None: not copied) and an empty log rather than
    stopping: as for the analysis, they are the input's problems, and the rest is copied.

    An empty log is copied (the merged run reads as its inputs do) but, with no header, the
    analysis counts that rank as missing, so it is named too."""
    from pipetrace.analyze.model import InputProblem

    try:
        size = _copy(path, staging, output)
    except UnreadableLog as exc:
        problems.append(InputProblem("warning", f"{exc.reason}; not copied", rank))
        return None
    if size == 0 and rank is not None:
        problems.append(
            InputProblem(
                "warning",
                f"{path}: empty event log (the rank never started recording); copied, but "
                "the rank counts as missing",
                rank,
            )
        )
    return size


def _absent_problem(ranks: list[int], directory: Path) -> InputProblem:
    """For one directory, the warning `open_source` gives ranks absent from several: without
    it, the text output would exit 1 without saying why."""
    from pipetrace.analyze.model import InputProblem
    from pipetrace.analyze.selection import format_rank_list

    return InputProblem(
        "warning", f"no log of rank(s) {format_rank_list(ranks, ', ')} in {directory}"
    )


def _copy(path: Path, staging: Path, output: Path) -> int:
    """Copy one file into STAGING as a new file; returns its size. Raises UnreadableLog when
    the input cannot be read (not a regular file: a FIFO never blocks, `open_regular`), and
    PipetraceError when the copy cannot be written (it names OUTPUT's file)."""
    from pipetrace.recorder.run_dir import create_new_file

    src = _open_input(path)
    target = staging / path.name
    try:
        with src, os.fdopen(create_new_file(target), "wb") as dst:
            while chunk := _read(src, path):
                dst.write(chunk)
            return dst.tell()
    except UnreadableLog:
        target.unlink(missing_ok=True)
        raise
    except OSError as exc:
        raise PipetraceError(f"cannot write {output / path.name}: {exc.strerror or exc}") from None


def _open_input(path: Path) -> BinaryIO:
    from pipetrace.analyze.reader import TraceFormatError, open_regular

    try:
        return open_regular(path)
    except TraceFormatError as exc:  # its message starts with the path
        raise UnreadableLog(f"cannot read {exc}") from None
    except OSError as exc:
        raise UnreadableLog(f"cannot read {path}: {exc.strerror or exc}") from None


def _read(src: BinaryIO, path: Path) -> bytes:
    """The next chunk; a read error is the input's (UnreadableLog), not the output's."""
    try:
        return src.read(CHUNK)
    except OSError as exc:
        raise UnreadableLog(f"cannot read {path}: {exc.strerror or exc}") from None


def _directories(n: int) -> str:
    return "1 directory" if n == 1 else f"{n} directories"
