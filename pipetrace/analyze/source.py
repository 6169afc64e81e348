"""Where a run's files are: one directory, or several (one per node, copied back) or a glob.

A job spread over nodes without a shared file system leaves each node's rank logs in that
node's ``PIPETRACE_DIR``, and ``meta.json`` only where it was written. `open_source` gathers
them into one `RunSource`: meta.json from whichever directory has it (several copies must be
the same run's), every rank's log from whichever directory holds it. Two different runs are
never mixed: directories whose run ids or meta.json copies disagree are refused with one line
naming both. What is missing (a node without meta.json, ranks without a log anywhere) becomes
an `InputProblem` and the rest is analyzed.

    source = open_source(["runs/node0", "runs/node1"])   # or open_source("runs/node*")
    source.logs[14]                                      # rank 14's log (maybe absent)
"""

from __future__ import annotations

import glob
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipetrace.analyze.model import InputProblem
from pipetrace.analyze.reader import TraceFormatError, check_run_dir, read_meta, read_run_id
from pipetrace.analyze.selection import format_rank_list
from pipetrace.limits import check_world_size
from pipetrace.recorder import format as fmt

RunPaths = str | Path | Sequence[str | Path]
"""One run directory, a glob, or several of either (the directories of one run)."""

RANK_LOG_GLOB = "rank-*.ndjson"


@dataclass
class RunSource:
    """The files of one run, gathered from its directories."""

    directories: tuple[Path, ...]
    meta: dict[str, Any]
    meta_dir: Path
    """The directory whose meta.json was read (the run's `path`)."""
    world_size: int
    logs: list[Path]
    """Each rank's log, index = rank; an absent one is named in ``meta_dir`` (it does not exist)."""
    problems: list[InputProblem] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return self.meta_dir


def expand(paths: RunPaths) -> tuple[Path, ...]:
    """The directories named: globs expanded (sorted), duplicates dropped, order kept.

    A pattern that names an existing path is taken literally; else it stands for the
    directories it matches (files beside them, such as an export's ``node0.pftrace``, are
    not run directories), and one that matches none is a TraceFormatError.
    """
    names = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not names:
        raise TraceFormatError("no run directory given")
    found: dict[Path, None] = {}
    for name in map(str, names):
        matches = (
            sorted(filter(os.path.isdir, glob.glob(name)))
            if glob.has_magic(name) and not os.path.lexists(name)
            else [name]
        )
        if not matches:
            raise TraceFormatError(f"{name}: no run directory matches")
        found.update(dict.fromkeys(map(Path, matches)))
    return tuple(found)


def open_source(paths: RunPaths) -> RunSource:
    """Gather a run from its directories (see the module doc); raises TraceFormatError when
    they hold no usable run or two different runs."""
    directories = expand(paths)
    for directory in directories:
        check_run_dir(directory)
    problems: list[InputProblem] = []
    meta_dir, meta = _one_meta(directories, problems)
    world_size = meta.get("world_size")
    if "world_size" not in meta:
        raise TraceFormatError(f"{meta_dir / fmt.META_FILE}: no world_size (a required field)")
    if not isinstance(world_size, int) or world_size < 1:
        raise TraceFormatError(f"{meta_dir / fmt.META_FILE}: invalid world_size {world_size!r}")
    found = gather_logs(directories)
    check_world_size(world_size, len(found), str(meta_dir / fmt.META_FILE))
    logs = _assign(found, world_size, meta_dir, problems)
    if len(directories) > 1:
        _note_absent(directories, logs, problems)
    return RunSource(directories, meta, meta_dir, world_size, logs, problems)


def gather_logs(directories: Sequence[Path]) -> list[Path]:
    """Every rank log file in the directories (by name; sorted within each directory)."""
    return [log for directory in directories for log in sorted(directory.glob(RANK_LOG_GLOB))]


# -- meta.json and run identity ------------------------------------------------------------


def _one_meta(
    directories: tuple[Path, ...], problems: list[InputProblem]
) -> tuple[Path, dict[str, Any]]:
    """meta.json from the first directory that has it, after checking that every directory
    belongs to the same run; a directory without one is noted."""
    if len(directories) == 1:
        return directories[0], read_meta(directories[0])
    metas = {d: read_meta(d) for d in directories if os.path.lexists(d / fmt.META_FILE)}
    if not metas:
        names = ", ".join(map(str, directories))
        raise TraceFormatError(f"none of {names} holds a {fmt.META_FILE}: not a pipetrace run")
    _check_one_run(directories, metas)
    meta_dir = next(iter(metas))
    without = [d for d in directories if d not in metas]
    if without:  # one line, however many nodes: the usual layout of a multi-node job
        named = ", ".join(map(str, without[:3])) + (
            f" and {len(without) - 3} more" if len(without) > 3 else ""
        )
        problems.append(
            InputProblem("info", f"{named}: no {fmt.META_FILE} (the run's is read from {meta_dir})")
        )
    return meta_dir, metas[meta_dir]


_IDENTITY = ("created", "world_size", "schedule")
"""What two copies of one run's meta.json share."""


def _check_one_run(directories: tuple[Path, ...], metas: dict[Path, dict[str, Any]]) -> None:
    """Refuse directories of two different runs: meta.json copies that differ, or run ids
    that differ where one is a name all nodes share (each node derives its own otherwise)."""
    ids = {d: read_run_id(d) for d in directories}

    def label(d: Path) -> str:
        created = metas[d].get("created") if d in metas else None
        return repr(ids[d]) if ids[d] else f"created {created}" if created else "unknown"

    first = next(iter(metas))
    for d, meta in metas.items():
        differ = [k for k in _IDENTITY if meta.get(k) != metas[first].get(k)]
        if differ:
            said = "; ".join(f"{k} {metas[first].get(k)!r} and {meta.get(k)!r}" for k in differ)
            by_id = f"run ids {label(first)} and {label(d)}, " if ids[first] != ids[d] else ""
            raise TraceFormatError(_mixed(first, d, f"{by_id}{fmt.META_FILE} {said}"))
    named = [d for d in directories if ids[d] and not fmt.is_node_run_id(ids[d])]
    for a in named:
        for b in directories:
            if ids[b] and ids[b] != ids[a]:
                raise TraceFormatError(_mixed(a, b, f"run ids {label(a)} and {label(b)}"))


def _mixed(a: Path, b: Path, why: str) -> str:
    return f"{a} and {b} hold two different runs ({why}): give the directories of one run"


# -- rank logs -----------------------------------------------------------------------------


def _assign(
    found: list[Path], world_size: int, meta_dir: Path, problems: list[InputProblem]
) -> list[Path]:
    """Each rank's log among the files found: a name beyond the world size is noted and
    ignored; a rank found in two directories is read from the longer copy (noted)."""
    by_name: dict[str, Path] = {}
    expected = {fmt.rank_log_name(r): r for r in range(world_size)}
    for log in found:
        if log.name not in expected:
            problems.append(
                InputProblem(
                    "warning",
                    f"{log.name} is not a rank of this run (world size {world_size}): "
                    "left over from another run; ignored",
                )
            )
        elif log.name in by_name:
            by_name[log.name] = _pick_copy(by_name[log.name], log, expected[log.name], problems)
        else:
            by_name[log.name] = log
    return [
        by_name.get(fmt.rank_log_name(r), fmt.rank_log_path(meta_dir, r)) for r in range(world_size)
    ]


def _pick_copy(kept: Path, other: Path, rank: int, problems: list[InputProblem]) -> Path:
    sizes = [_size(kept), _size(other)]
    chosen = other if sizes[1] > sizes[0] else kept
    same = sizes[0] == sizes[1]
    problems.append(
        InputProblem(
            "info" if same else "warning",
            f"{kept.name} is in both {kept.parent} and {other.parent}"
            + (" (same size)" if same else f" ({_said(sizes[0])} and {_said(sizes[1])})")
            + f"; read from {chosen.parent}",
            rank,
        )
    )
    return chosen


def _said(size: int) -> str:
    return f"{size:,} bytes" if size >= 0 else "not a readable file"


def _size(path: Path) -> int:
    """A copy's size in bytes; -1 for one that is no regular file (a directory, a FIFO) or
    cannot be read, so that a real log always wins over it."""
    try:
        info = path.stat()
    except OSError:
        return -1
    return info.st_size if stat.S_ISREG(info.st_mode) else -1


def _note_absent(
    directories: tuple[Path, ...], logs: list[Path], problems: list[InputProblem]
) -> None:
    absent = [r for r, log in enumerate(logs) if not os.path.lexists(log)]
    if absent:
        ranks = format_rank_list(absent, ", ")
        problems.append(
            InputProblem(
                "warning",
                f"no log of rank(s) {ranks} in any of the {len(directories)} "
                "directories (a node not copied back?)",
            )
        )
