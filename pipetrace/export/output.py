"""Writing an export's output file: only regular files that pipetrace creates itself.

``-o`` may name anything: a device node (``/dev/full``), a symbolic link planted by someone
else, a FIFO. Writing to the name directly, or renaming a finished file onto it, would
replace the device, follow the link to its target or block on the FIFO. So the target is
checked without following a link at its last component (an existing *regular* file is
replaced, anything else refused), the trace is written to a new temporary file created
exclusively in the same directory, and that file is renamed over the target at the end (a
rename replaces a name, never what a link points to).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

from pipetrace.errors import PipetraceError


def check_output(out: Path) -> None:
    """Refuse an output path that is not, or would not become, a regular file of ours."""
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise PipetraceError(f"cannot write {out}: {exc.strerror}") from None
    if mode is not None and stat.S_ISLNK(mode):
        raise PipetraceError(
            f"cannot write {out}: it is a symbolic link (pipetrace does not write through "
            "links); remove it or pass another -o"
        )
    if mode is not None and not stat.S_ISREG(mode):
        raise PipetraceError(
            f"cannot write {out}: not a regular file (a directory, device, FIFO or socket); "
            "pass a file name with -o"
        )
    if not out.parent.is_dir():
        raise PipetraceError(f"cannot write {out}: no directory {out.parent}")


def check_not_the_run(out: Path, directories: Sequence[Path]) -> None:
    """Refuse an output that is one of the run's own files, or would pass for one: a name
    the trace format gives its files (meta.json, run-id, a rank log) in a run directory."""
    from pipetrace.recorder import format as fmt

    reserved = out.name in (fmt.META_FILE, fmt.RUN_ID_FILE) or fmt.is_rank_log_name(out.name)
    parent = out.parent.resolve()
    if reserved and any(parent == d.resolve() for d in directories):
        raise PipetraceError(
            f"cannot write {out}: in the run's directory that name is the run's own "
            "(meta.json, run-id, rank-*.ndjson), which the export would replace or pass for; "
            "pass another -o"
        )


def write_file(out: Path, write: Callable[[BinaryIO], int]) -> int:
    """Write ``out`` through ``write`` (which returns the bytes it wrote) into a fresh
    temporary file beside it, then rename that onto ``out``; returns ``write``'s result."""
    check_output(out)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as exc:
        raise PipetraceError(f"cannot write {out}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            size = write(f)
        os.chmod(tmp, 0o644 & ~_umask())
        check_output(out)  # nothing was planted at the name while the trace was written
        os.replace(tmp, out)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise PipetraceError(f"cannot write {out}: {exc.strerror or exc}") from None
        raise
    return size


def _umask() -> int:
    """The process's umask (read by setting it, then restored)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
