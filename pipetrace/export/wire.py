"""A columnar protobuf encoder: encode many messages of the same shape at once with numpy.

Encoding TracePackets one by one in Python costs ~3 µs each (measured), too slow for a
million events. Here a message is a list of `Col` parts, each part holding one field's bytes
for every row (event) where that field is present; `assemble` lays the rows out one after
another. Absent fields take no work, so one list of parts describes every event type. Only
the wire format's basics are needed: varints, fixed64 and length-delimited fields.
`tests/export` decodes the output with the real generated protos.
"""

from __future__ import annotations

import numpy as np

VARINT, FIXED64, LEN = 0, 1, 2


def key(number: int, wire_type: int) -> bytes:
    """The encoded tag of a field."""
    return encode_varint((number << 3) | wire_type)


def encode_varint(value: int) -> bytes:
    """One varint (negative values as 64-bit two's complement, as protobuf int64 does)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def frame(packet: bytes) -> bytes:
    """A serialized TracePacket as an element of ``Trace.packet`` (field 1)."""
    return b"\x0a" + encode_varint(len(packet)) + packet


def rows_where(mask: np.ndarray) -> np.ndarray:
    """The rows of a mask, the form every part takes (compute it once, share it)."""
    return np.flatnonzero(mask)


class Col:
    """One part of a message on the rows ``rows`` (ascending): the bytes of the k-th of them
    are ``mat[src[k], :lens[k]]``, where ``src`` is ``idx`` (None: k itself; a constant
    has one ``mat`` row, read by every row)."""

    __slots__ = ("const", "idx", "lens", "mat", "rows")

    def __init__(
        self,
        rows: np.ndarray,
        mat: np.ndarray,
        lens: np.ndarray,
        idx: np.ndarray | None = None,
        const: bool = False,
    ) -> None:
        self.rows = rows
        self.mat = mat
        self.lens = lens
        self.idx = idx
        self.const = const


def const(raw: bytes, rows: np.ndarray) -> Col:
    """The same bytes on every row of ``rows``."""
    mat = np.frombuffer(raw, np.uint8).reshape(1, len(raw))
    return Col(rows, mat, np.full(len(rows), len(raw), np.int64), const=True)


_THRESHOLDS = [np.uint64(1 << (7 * k)) for k in range(1, 10)]


def varint_lengths(v: np.ndarray) -> np.ndarray:
    """Encoded sizes of uint64 values."""
    lens = np.ones(len(v), np.int64)
    for threshold in _THRESHOLDS:
        big = v >= threshold
        if not big.any():
            break
        lens += big
    return lens


def _varints(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    v = values.astype(np.int64).view(np.uint64)
    lens = varint_lengths(v)
    width = int(lens.max()) if len(v) else 1
    mat = np.empty((len(v), width), np.uint8)
    for j in range(width):
        low = (v >> np.uint64(7 * j)).astype(np.uint8) & np.uint8(0x7F)
        mat[:, j] = low | ((lens > j + 1).view(np.uint8) << np.uint8(7))
    return mat, lens


def varint(values: np.ndarray, rows: np.ndarray) -> Col:
    """``values[rows]`` varint-encoded (int64: negatives take 10 bytes, as in protobuf)."""
    return Col(rows, *_varints(np.asarray(values)[rows]))


def fixed64(values: np.ndarray, rows: np.ndarray) -> Col:
    mat = (
        np.ascontiguousarray(np.asarray(values)[rows].astype("<u8"))
        .view(np.uint8)
        .reshape(len(rows), 8)
    )
    return Col(rows, mat, np.full(len(rows), 8, np.int64))


def _table_matrix(entries: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    width = max((len(e) for e in entries), default=0) or 1
    mat = np.zeros((max(len(entries), 1), width), np.uint8)
    sizes = np.zeros(max(len(entries), 1), np.int64)
    for i, e in enumerate(entries):
        mat[i, : len(e)] = np.frombuffer(e, np.uint8)
        sizes[i] = len(e)
    return mat, sizes


def table(index: np.ndarray, entries: list[bytes]) -> Col:
    """Per row, ``entries[index[row]]``; rows with a negative index get nothing."""
    rows = np.flatnonzero(index >= 0)
    return table_rows(rows, index[rows], entries)


def table_rows(rows: np.ndarray, index: np.ndarray, entries: list[bytes]) -> Col:
    """On ``rows``, ``entries[index[k]]`` for the k-th of them."""
    mat, sizes = _table_matrix(entries)
    idx = np.asarray(index, np.int64)
    return Col(rows, mat, sizes[idx], idx=idx)


def total(parts: list[Col], n: int) -> np.ndarray:
    """Per row, the size of ``parts`` together."""
    out = np.zeros(n, np.int64)
    for p in parts:
        if len(p.rows) == n:  # on every row (rows are ascending and unique)
            out += p.lens
        else:
            out[p.rows] += p.lens
    return out


def field_varint(number: int, values: np.ndarray, rows: np.ndarray) -> list[Col]:
    return [const(key(number, VARINT), rows), varint(values, rows)]


def field_fixed64(number: int, values: np.ndarray, rows: np.ndarray) -> list[Col]:
    return [const(key(number, FIXED64), rows), fixed64(values, rows)]


def field_message(number: int, parts: list[Col], rows: np.ndarray, n: int) -> list[Col]:
    """A length-delimited field around ``parts`` on ``rows``; parts lie within those rows."""
    if all(p.rows is rows for p in parts):
        size = np.zeros(len(rows), np.int64)
        for p in parts:
            size += p.lens
    else:
        size = total(parts, n)[rows]
    return [const(key(number, LEN), rows), Col(rows, *_varints(size)), *parts]


def assemble(parts: list[Col], n: int) -> bytes:
    """Row 0's parts in order, then row 1's, ...: the concatenated messages.

    Each part is scattered into the output one byte column at a time over the rows where it
    is present (and, for varints, long enough): the work follows the bytes written.
    """
    row_len = total(parts, n)
    cursor = np.cumsum(row_len) - row_len
    out = np.empty(int(row_len.sum()), np.uint8)
    for p in parts:
        if not len(p.rows):
            continue
        at = cursor[p.rows]
        cursor[p.rows] = at + p.lens
        if p.const:
            w = p.mat.shape[1]
            if w == 1:
                out[at] = p.mat[0, 0]
            else:
                out[(at[:, None] + np.arange(w)).ravel()] = np.tile(p.mat[0], len(at))
            continue
        src = p.idx if p.idx is not None else np.arange(len(p.rows))
        lens = p.lens
        if len(src) * 8 < p.mat.shape[1]:  # a few long entries: copy row by row
            for a, s, m in zip(at.tolist(), src.tolist(), lens.tolist()):
                out[a : a + m] = p.mat[s, :m]
            continue
        for j in range(int(lens.max())):
            keep = lens > j
            if not keep.all():
                at, src, lens = at[keep], src[keep], lens[keep]
            out[at + j] = p.mat[src, j]
    return out.tobytes()
