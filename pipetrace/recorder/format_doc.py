"""The field tables of docs/trace-format.md, generated from `pipetrace.recorder.format`.

Each ``<!-- fields:NAME -->`` marker in the doc is followed by a hand-written heading and prose,
then the table of record NAME, which is generated: the declaration is the one place fields are
written down, and tests/recorder/test_trace_format.py fails when the doc lags behind it.

    python -m pipetrace.recorder.format_doc docs/trace-format.md   # rewrite its tables
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from pipetrace.recorder import format as fmt

MARKER = re.compile(r"<!-- fields:(\w+) -->")
RECORDS: dict[str, fmt.Record] = {"meta": fmt.META, "header": fmt.HEADER, **fmt.EVENTS}


def table(record: fmt.Record) -> list[str]:
    """The markdown table of a record's fields (none for a record without fields)."""
    if not record.fields:
        return []
    rows = ["| field | type | presence | meaning |", "|---|---|---|---|"]
    for f in record.fields:
        presence = f.presence.value + (f" since {f.since}" if f.since > 1 else "")
        rows.append(f"| `{f.name}` | {f.type.doc} | {presence} | {f.meaning} |")
    return rows


def with_tables(text: str) -> str:
    """``text`` with the table after each marker replaced by the declared one."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        marker = MARKER.match(lines[i])
        out.append(lines[i])
        i += 1
        if marker is None:
            continue
        record = RECORDS[marker.group(1)]
        while i < len(lines) and lines[i] and not lines[i].startswith("|"):
            out.append(lines[i])  # the heading and prose: hand-written, up to the table
            i += 1
        while i < len(lines) and lines[i].startswith("|"):
            i += 1  # the old table
        out.extend(table(record))
    return "\n".join(out)


def documented(text: str) -> list[str]:
    """The record names the doc has a marker for, in order."""
    return MARKER.findall(text)


def main(argv: list[str]) -> None:
    path = Path(argv[0])
    path.write_text(with_tables(path.read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
