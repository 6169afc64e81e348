"""Claiming a run directory: the one place that decides whether a recording may go there.

A run directory holds one run. Every process of a run claims the directory before writing
to it, with the run's id (`current_run_id`): the first to claim it writes the id into
``run-id`` (atomically: a hard link of a finished file, so a peer never reads it half
written); the others find the same id and go on. A directory that holds another run (another
id, or a meta.json or rank log without an id) is refused, so two runs never mix and a run is
never overwritten silently; ``pipetrace run --overwrite`` removes the previous run first
(`remove_previous_run`). The directory itself must be a real directory (not a symbolic link)
owned by this user, and every file is created new, never through a link
(`create_new_file`).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from pipetrace.errors import PipetraceError
from pipetrace.recorder import format as fmt

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

RUN_ID_FILE = fmt.RUN_ID_FILE
"""The claim: the id of the run that records into this directory."""
RUN_ID_ENV = "PIPETRACE_RUN_ID"
"""Set by a launcher for its ranks; otherwise `current_run_id` derives the id."""
_RANK_LOG_GLOB = "rank-*.ndjson"  # what `pipetrace.analyze.load` reads as rank logs
_TORCHRUN_UNNAMED = ("", "none")  # torchrun's default --rdzv-id: not unique to a run


class RunDirError(PipetraceError):
    """The run directory cannot be recorded into (exit 2); the message says what to do."""


def current_run_id(environ: Mapping[str, str] = os.environ) -> str:
    """The id that every process of this run shares: ``PIPETRACE_RUN_ID`` when a launcher
    set it, torchrun's ``TORCHELASTIC_RUN_ID`` when the user named the run (``--rdzv-id``;
    ``--standalone`` picks a fresh one), else the parent process (the launcher or torchrun
    agent that started all local ranks): host, pid and start time."""
    given = environ.get(RUN_ID_ENV, "")
    if given:
        return given
    elastic = environ.get("TORCHELASTIC_RUN_ID", "")
    if elastic not in _TORCHRUN_UNNAMED:
        return f"torchrun:{elastic}"
    return process_run_id(os.getppid())


def process_run_id(pid: int) -> str:
    """The run id of the processes that ``pid`` starts (see `current_run_id`)."""
    return fmt.node_run_id(socket.gethostname(), pid, _start_ticks(pid))


def _start_ticks(pid: int) -> str:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[19]


def claim(run_dir: Path, run_id: str) -> None:
    """Make ``run_dir`` this run's directory, or raise `RunDirError` saying why not."""
    check_directory(run_dir, create=True)
    marker = run_dir / RUN_ID_FILE
    if not os.path.lexists(marker):
        previous = previous_run_files(run_dir)
        # A peer rank may claim the directory (marker, then its log) between the two looks:
        # its files are not a previous run's once its marker is there.
        if previous and not os.path.lexists(marker):
            raise RunDirError(
                f"{run_dir} already holds a run ({previous[0].name}): record into a new "
                "directory, or remove that run first (pipetrace run --overwrite does)"
            )
        if not previous:
            _link_new(marker, run_id)
    claimed = _read_marker(marker)
    if claimed != run_id:
        raise RunDirError(
            f"{run_dir} already holds another run (run id {claimed!r}, this run is "
            f"{run_id!r}): record into a new directory, or remove that run first "
            "(pipetrace run --overwrite does)"
        )


def check_directory(run_dir: Path, *, create: bool) -> None:
    """``run_dir`` is (after creating it, with ``create``) a directory, not a symbolic
    link, owned by this user; raise `RunDirError` otherwise."""
    if create and not os.path.lexists(run_dir):
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(f"cannot create run directory {run_dir}: {exc.strerror}") from None
    try:
        info = os.lstat(run_dir)
    except OSError as exc:
        raise RunDirError(f"run directory {run_dir}: {exc.strerror}") from None
    if os.path.islink(run_dir):
        raise RunDirError(f"run directory {run_dir} is a symbolic link: name a real directory")
    if not os.path.isdir(run_dir):
        raise RunDirError(f"run directory {run_dir} is not a directory")
    if info.st_uid != os.getuid():
        raise RunDirError(
            f"run directory {run_dir} belongs to another user (uid {info.st_uid}): "
            "record into a directory of your own"
        )


def previous_run_files(run_dir: Path) -> list[Path]:
    """The files of a run already in ``run_dir`` (its meta.json, rank logs, claim)."""
    names = [fmt.META_FILE, RUN_ID_FILE]
    found = [run_dir / name for name in names if os.path.lexists(run_dir / name)]
    return found + sorted(run_dir.glob(_RANK_LOG_GLOB))


def remove_previous_run(run_dir: Path) -> None:
    """Remove the previous run's files (links themselves, never their targets), unless a
    rank of it still runs here: its logs would go on into deleted files, all lost."""
    files = previous_run_files(run_dir)
    for path in files:
        if path.name.startswith("rank-"):
            header = _header(path)
            if recording_here(header):
                raise RunDirError(
                    f"the run in {run_dir} is still recording (pid {header['pid']} writes "
                    f"{path.name}): stop it first, or record into another directory"
                )
    for path in files:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise RunDirError(f"cannot remove the previous run's {path}: {exc.strerror}") from None


def create_new_file(path: Path, mode: int = 0o644) -> int:
    """A write descriptor of a new regular file at ``path``: never opens an existing file or
    follows a symbolic link (O_EXCL | O_NOFOLLOW), so a planted link's target is untouched."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, mode)
    except FileExistsError:
        raise RunDirError(
            f"{path} already exists: a run never writes over a file it did not create"
        ) from None
    except OSError as exc:  # a read-only directory or file system, a full disk
        raise RunDirError(f"cannot write in {path.parent}: {exc.strerror}") from None


def _link_new(marker: Path, run_id: str) -> None:
    """Write ``run_id`` to a private file and hard-link it as ``marker``; a peer that won
    the race leaves its own marker, which `claim` then compares."""
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.{threading.get_ident()}")
    fd = create_new_file(tmp)
    try:
        os.write(fd, run_id.encode())
        os.link(tmp, marker)
    except FileExistsError:
        pass
    except OSError as exc:  # a full disk
        raise RunDirError(f"cannot write in {marker.parent}: {exc.strerror}") from None
    finally:
        os.close(fd)
        tmp.unlink()


def _read_marker(marker: Path) -> str:
    if os.path.islink(marker) or not marker.is_file():
        raise RunDirError(f"{marker} is not a regular file: remove it")
    fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as handle:
        return handle.read(4096).decode(errors="replace")


def _header(log: Path) -> dict:
    """A rank log's header line, or {} when it cannot be read as one."""
    try:
        with open(log, "rb") as handle:
            header = json.loads(handle.readline(4096) or b"{}")
    except (OSError, ValueError):
        return {}
    return header if isinstance(header, dict) else {}


def recording_here(header: dict) -> bool:
    """Whether the process a rank log's header names (``pid`` on ``host``, writing since
    ``t0``) still runs on this host: not a later process that took over the pid, nor one
    that has ended (a zombie). Linux only (/proc); False elsewhere."""
    pid, t0 = header.get("pid"), header.get("t0")
    if header.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    if not isinstance(t0, int) or not sys.platform.startswith("linux"):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
        with open("/proc/stat", "rb") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith(b"btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    fields = stat.rsplit(b")", 1)[-1].split()  # the name, in parentheses, may hold spaces
    if len(fields) < 20 or fields[0] == b"Z":
        return False
    started_s = boot + int(fields[19]) / _CLOCK_TICKS
    return started_s <= t0 / 1e9 + 2  # btime and the ticks are coarse: a margin
