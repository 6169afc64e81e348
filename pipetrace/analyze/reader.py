"""Low-level reading of a run directory: meta.json and the per-rank event logs.

It checks formats and versions and tolerates what a crash leaves behind (a torn last line,
corrupt lines), reporting each problem instead of failing. It builds no model: the loader
turns these raw events into the run model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import orjson

from pipetrace.errors import PipetraceError
from pipetrace.recorder import format as fmt


class TraceFormatError(PipetraceError):
    """A run directory or log that cannot be used (exit code 2)."""


@dataclass
class LogProblems:
    """What was wrong with one rank's log, for warnings in reports."""

    torn_last_line: bool = False
    corrupt_lines: int = 0
    first_corrupt_line: int | None = None  # 1-based line number
    notes: list[str] = field(default_factory=list)

    def note_corrupt(self, line_number: int) -> None:
        self.corrupt_lines += 1
        if self.first_corrupt_line is None:
            self.first_corrupt_line = line_number


def check_version(data: dict[str, Any], expected_format: str, source: str) -> int:
    if data.get("format") != expected_format:
        raise TraceFormatError(
            f"{source}: does not look like a pipetrace {'run' if expected_format == fmt.META_FORMAT else 'event log'} "
            f"(format is {data.get('format')!r}, expected {expected_format!r})"
        )
    version = data.get("schema_version")
    if not isinstance(version, int) or version < 1:
        raise TraceFormatError(f"{source}: missing or invalid schema_version {version!r}")
    if version > fmt.SCHEMA_VERSION:
        raise TraceFormatError(
            f"{source}: written with trace schema version {version}, newer than this pipetrace "
            f"understands ({fmt.SCHEMA_VERSION}); upgrade pipetrace to read it"
        )
    return version


def read_meta(run_dir: str | Path) -> dict[str, Any]:
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise TraceFormatError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise TraceFormatError(f"{run_dir}: not a directory (expected a pipetrace run directory)")
    path = run_dir / fmt.META_FILE
    try:
        data = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        raise TraceFormatError(
            f"{run_dir}: no {fmt.META_FILE}; is this a pipetrace run directory?"
        ) from None
    except orjson.JSONDecodeError as exc:
        raise TraceFormatError(f"{path}: corrupt JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TraceFormatError(f"{path}: corrupt (not a JSON object)")
    check_version(data, fmt.META_FORMAT, str(path))
    return data


def read_log(path: str | Path) -> tuple[dict[str, Any], Iterator[dict[str, Any]], LogProblems]:
    """Open one rank's log: its header, a lazy iterator over its events, and its problems.

    The iterator streams the file line by line; corrupt lines are skipped and counted in the
    returned `LogProblems` as they are met, a torn (unterminated, unparsable) last line too.
    """
    path = Path(path)
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: missing event log") from None
    first = handle.readline()
    if not first:
        handle.close()
        raise TraceFormatError(f"{path}: empty event log (the rank never started recording)")
    try:
        header = orjson.loads(first)
    except orjson.JSONDecodeError:
        handle.close()
        raise TraceFormatError(f"{path}: line 1 is not a pipetrace header") from None
    if not isinstance(header, dict):
        handle.close()
        raise TraceFormatError(f"{path}: line 1 is not a pipetrace header")
    check_version(header, fmt.LOG_FORMAT, str(path))
    problems = LogProblems()
    return header, _events(handle, problems), problems


def _events(handle: Any, problems: LogProblems) -> Iterator[dict[str, Any]]:
    loads = orjson.loads
    with handle:
        line_number = 1
        for line in handle:
            line_number += 1
            try:
                event = loads(line)
            except orjson.JSONDecodeError:
                if not line.endswith(b"\n"):
                    problems.torn_last_line = True
                else:
                    problems.note_corrupt(line_number)
                continue
            if type(event) is not dict or "e" not in event or "t" not in event:
                problems.note_corrupt(line_number)
                continue
            yield event
