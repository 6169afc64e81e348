"""Reading a chunk of recorder-written lines by template matching instead of JSON decoding.

The recorder writes its four frequent event types from byte templates
(`pipetrace.recorder.format.template_parts`); decoding those lines as JSON and then picking
their fields apart was most of the first analysis's time. Here a small C helper
(`_linescan.c`, built with the package) matches each line against the same templates and
writes its values straight into arrays; only the lines that match no template (iteration,
clock and failure events, or any line written differently: another key order, spaces,
escapes) are decoded with orjson. A line that matches is exactly the JSON object its
template describes, so the columns are the ones the general path (`parse._fast_batch`)
makes of the chunk; a chunk holding anything that path would treat specially (a frequent
event that matches no template, an undecodable line, a time before the epoch) is left to it.
Without the compiled helper (a source tree used without installing it) every chunk takes
the general path: slower, same result.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from pipetrace.analyze import reader
from pipetrace.interning import Interner
from pipetrace.recorder import format as fmt

try:
    from pipetrace.analyze import _linescan
except ImportError:  # not built: see `available`
    _linescan = None

_KINDS = {fmt.INT: 0, fmt.STR: 1, fmt.OP: 1, fmt.INTS: 2}
"""`_linescan`'s value kinds: an int, a string (offset, length), a list of ints (its text)."""
_STEP_BEGIN, _P2P_POST, _ENDS = range(3)
_TEMPLATES = (
    (_STEP_BEGIN, fmt.STEP_BEGIN, ()),
    (_P2P_POST, fmt.P2P_POST, ()),
    (_ENDS, fmt.STEP_END, ()),
    (_ENDS, fmt.STEP_END, ("bytes",)),  # a swap launch's
    (_ENDS, fmt.P2P_DONE, ()),
)
_GENERAL = frozenset({fmt.STEP_BEGIN, fmt.P2P_POST, fmt.STEP_END, fmt.P2P_DONE})
"""Event types a line that matched no template must not have (the general path reads them)."""
_I64 = np.int64
CHUNK_BYTES = 1 << 20
"""Bytes read per chunk: matching holds no Python object per line, so bigger chunks than
the JSON path's only spread the per-chunk work thinner (1 MiB: 0.6-0.9x the time per log of
128 KiB chunks, measured on bench_analyze's logs)."""


def available() -> bool:
    """Is the compiled helper there (else every chunk is decoded as JSON)?"""
    return _linescan is not None


def chunk_bytes() -> int:
    """The chunk size of every parse in this process, whichever path reads each chunk (a new
    text's code depends on where chunks end): `CHUNK_BYTES` with the helper."""
    return CHUNK_BYTES if available() else reader.CHUNK_BYTES


def compiled_sources() -> list[Path]:
    """The helper's C source and built library, for the parser's cache key."""
    built = [Path(_linescan.__file__)] if _linescan is not None else []
    return [Path(__file__).with_name("_linescan.c"), *built]


def _layout() -> tuple[list, list[int], list[dict[str, int]]]:
    """The templates as `_linescan.scan` takes them, each group's width, and the column of
    each field name in each group's rows (the same in every template of a group)."""
    templates, widths, columns = [], [0, 0, 0], [{}, {}, {}]
    for group, name, optional in _TEMPLATES:
        parts, tail = fmt.template_parts(fmt.EVENTS[name], optional)
        names = ["t"] + [text.split(b'"')[-2].decode() for text, _ in parts[1:]]
        templates.append((group, tuple((text, _KINDS[kind]) for text, kind in parts), tail))
        column = 0
        for field, (_, kind) in zip(names, parts):
            if columns[group].setdefault(field, column) != column:
                raise ValueError(f"{name}.{field}: in another column than in its group")
            column += 1 if kind is fmt.INT else 2
        widths[group] = max(widths[group], column)
    return templates, widths, columns


_SCAN, _WIDTHS, _COLUMNS = _layout()


class TemplatedChunks:
    """One log's chunks read by template matching; codes come from the log's interners.

    Each string field has a dict of the raw bytes of the values seen with their codes (a
    value met earlier in the same chunk costs not even that: `_linescan.codes`), and a
    function that interns a value not seen before."""

    def __init__(self, interners: tuple[Interner, ...]) -> None:
        texts, threads, shapes, dtypes = interners
        self._texts = ({}, lambda raw: texts.get(raw.decode()))
        self._threads = ({}, lambda raw: threads.get(raw.decode()))
        self._shapes = ({}, lambda raw: shapes.get(tuple(orjson.loads(raw))))
        self._dtypes = ({}, lambda raw: dtypes.get(raw.decode()))
        self._ops = _enumeration(fmt.OPS)
        self._channels = _enumeration(fmt.CHANNELS)

    def columns(self, chunk: bytes, lines: int) -> tuple | None:
        """`parse._fast_batch`'s columns of a chunk of ``lines`` whole lines (joined by
        newlines, without the last one); None when the general path must read it."""
        groups = [np.empty((lines, width), _I64) for width in _WIDTHS]
        counts, times = np.empty(len(groups), _I64), np.empty(lines, _I64)
        other = np.empty((lines, 3), _I64)
        scanned, n_other = _linescan.scan(chunk, _SCAN, groups, counts, times, other)
        if scanned != lines:
            return None
        others = _decode_others(chunk, other[:n_other], times)
        if others is None or (lines and times.min() < 0):
            return None
        sb, pp, en = (g[:n] for g, n in zip(groups, counts.tolist()))
        ops = self._codes(chunk, pp, _P2P_POST, "op", self._ops)
        channels = self._codes(chunk, pp, _P2P_POST, "ch", self._channels)
        if ops is None or channels is None:
            return None
        # interned in the general path's order (steps' texts, then ops'): the same codes
        step_cols = {
            **_ints(sb, _STEP_BEGIN, ("t", "id", "it", "pos")),
            "code": self._codes(chunk, sb, _STEP_BEGIN, "step", self._texts),
            "thread": self._codes(chunk, sb, _STEP_BEGIN, "th", self._threads),
        }
        p2p_cols = {
            **_ints(pp, _P2P_POST, ("t", "id", "it", "peer", "seq")),
            "op": ops.astype(np.int8),
            "ch": channels.astype(np.int8),
            "nbytes": pp[:, _COLUMNS[_P2P_POST]["bytes"]].copy(),
            "shape": self._codes(chunk, pp, _P2P_POST, "shape", self._shapes),
            "dtype": self._codes(chunk, pp, _P2P_POST, "dtype", self._dtypes),
            "code": self._codes(chunk, pp, _P2P_POST, "step", self._texts),
        }
        return step_cols, p2p_cols, _ints(en, _ENDS, ("id", "t")), others, times

    @staticmethod
    def _codes(chunk: bytes, rows: np.ndarray, group: int, field: str, coder: tuple):
        """The codes of a string field of ``rows``; None when the coder refused a value."""
        out = np.empty(len(rows), np.int32)
        known, on_miss = coder
        ok = _linescan.codes(chunk, rows, _COLUMNS[group][field], known, on_miss, out)
        return out if ok else None


def _enumeration(names: tuple[str, ...]) -> tuple[dict[bytes, int], Callable[[bytes], int]]:
    """Codes of a closed set of values: another value sends the chunk to the general path
    (which keeps or counts it as it always did)."""
    return {name.encode(): code for code, name in enumerate(names)}, lambda raw: -1


def _ints(rows: np.ndarray, group: int, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {field: rows[:, _COLUMNS[group][field]].copy() for field in fields}


def _decode_others(chunk: bytes, other: np.ndarray, times: np.ndarray) -> list[Any] | None:
    """The lines that matched no template, decoded (their times written into ``times``);
    None when one would make the general path act differently from a plain event."""
    if not len(other):
        return []
    starts, ends = other[:, 1].tolist(), other[:, 2].tolist()
    try:
        items = orjson.loads(
            b"[" + b",".join(map(chunk.__getitem__, map(slice, starts, ends))) + b"]"
        )
        if len(items) != len(other) or any(d["e"] in _GENERAL for d in items):
            return None
        times[other[:, 0]] = np.fromiter(map(itemgetter("t"), items), _I64, len(items))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError):
        return None
    return items
