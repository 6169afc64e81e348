"""One rank's event log -> raw columns (the loader's per-file work; runs in worker processes).

The file is streamed in chunks of whole lines (`reader.line_chunks`). A chunk of lines the
recorder wrote from its templates is read by template matching (`templated`); any other is
decoded by one `orjson.loads` and turned into numpy columns by list comprehensions, so no
Python object per event outlives its chunk. A chunk whose values do not have the documented
types falls back to a checked, event-by-event path that drops (and counts) the bad lines.
Times stay on the rank's own clock here; the loader aligns them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from itertools import repeat
from operator import index, itemgetter
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from pipetrace.analyze.model import CHANNELS, OPEN, OPS, parse_texts
from pipetrace.analyze.reader import (
    ORDER_TOLERANCE_NS,
    SKIP,
    LogProblems,
    TraceFormatError,
    decode_chunk,
    line_chunks,
    open_log,
)
from pipetrace.analyze.templated import TemplatedChunks, available, chunk_bytes
from pipetrace.gc_pause import gc_paused
from pipetrace.interning import Interner
from pipetrace.recorder import format as fmt

_END_EVENTS = frozenset({fmt.STEP_END, fmt.P2P_DONE})
_COLUMN_EVENTS = {fmt.STEP_BEGIN, fmt.P2P_POST, *_END_EVENTS}
_LIFECYCLE = frozenset(fmt.EVENT_TYPES) - {*_COLUMN_EVENTS, fmt.ITER_BEGIN, fmt.ITER_END}
"""Events kept with their fields (`RawRank.lifecycle`); the others become columns."""
NONFINITE = ("nan", "inf", "-inf")
"""The values of ``iter_end.nonfinite``."""
CLOCK_PHASES = ("start", "end")
"""The values of a clock event's ``phase`` (docs/trace-format.md)."""
_OPS = {name: code for code, name in enumerate(OPS)}
_CHANNELS = {name: code for code, name in enumerate(CHANNELS)}
_I64 = np.int64
STEP_COLUMNS: dict[str, type[np.integer]] = {
    **dict.fromkeys(("begin", "end"), _I64),
    **dict.fromkeys(("it", "pos", "code"), np.int32),
    "thread": np.int8,
    **dict.fromkeys(("dbegin", "dend"), _I64),
}
"""`RawRank.steps`: each column and its dtype (codes index the rank's own lists)."""
P2P_COLUMNS: dict[str, type[np.integer]] = {
    **dict.fromkeys(("post", "done"), _I64),
    "it": np.int32,
    "op": np.int8,
    "peer": np.int32,
    "ch": np.int8,
    **dict.fromkeys(("seq", "nbytes"), _I64),
    **dict.fromkeys(("shape", "dtype", "code"), np.int32),
    **dict.fromkeys(("dbegin", "dend"), _I64),
}
"""`RawRank.p2p`: each column and its dtype."""
MEMORY_COLUMNS = ("t", "step", "allocated", "reserved")
MEMORY_GRIDS = ("saved", "inflight", "swapped")
"""`RawRank.memory` (`pipetrace.analyze.model.MemoryTable`), all int64: one value per
sample, and one row per sample with one column per stage of the rank."""


@dataclass
class RawRank:
    """What one rank's log holds, as columns; ``error`` set when the log is unusable."""

    path: str
    header: dict[str, Any] = field(default_factory=dict)
    problems: LogProblems = field(default_factory=LogProblems)
    error: str | None = None
    events: int = 0
    unknown_events: int = 0
    texts: list[str] = field(default_factory=list)
    threads: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    text_parts: tuple[np.ndarray, ...] = ()  # (kind, stage, microbatch) of each text
    plan_index: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    """int32, one per text of run_start's plan: its index in ``texts``, -1 where no event
    used it (the loader codes the rank's plan from it, without looking its texts up)."""
    steps: dict[str, np.ndarray] = field(default_factory=dict)  # STEP_COLUMNS
    p2p: dict[str, np.ndarray] = field(default_factory=dict)  # P2P_COLUMNS
    iterations: dict[int, list] = field(default_factory=dict)  # it -> [begin, end, loss]
    lifecycle: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    run_start: dict[str, Any] | None = None
    device: list[tuple[int, int, int, int]] = field(default_factory=list)  # (id, db, de, unc)
    memory_events: list[tuple] = field(default_factory=list)  # (t, id, saved, inflight, a, r, s)
    memory: dict[str, np.ndarray] = field(default_factory=dict)  # MEMORY_COLUMNS + _GRIDS


class _Columns:
    """Per-chunk column arrays collected until the end of the file."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.parts: dict[str, list[np.ndarray]] = {n: [] for n in names}

    def add(self, columns: dict[str, np.ndarray]) -> None:
        for name in self.names:
            self.parts[name].append(columns[name])

    def result(self) -> dict[str, np.ndarray]:
        return {
            n: np.concatenate(p).astype(_dtype(n), copy=False) if p else np.empty(0, _dtype(n))
            for n, p in self.parts.items()
        }


_STEP_COLS = ("t", "id", "it", "pos", "code", "thread")
_P2P_COLS = ("t", "id", "it", "op", "peer", "ch", "seq", "nbytes", "shape", "dtype", "code")
_END_COLS = ("id", "t")
_NARROW = {
    **dict.fromkeys(("code", "thread", "shape", "dtype"), np.int32),
    **dict.fromkeys(("op", "ch"), np.int8),
}


def _dtype(column: str) -> Any:
    """The dtype of a column: interned codes and enumerations narrow, the rest int64."""
    return _NARROW.get(column, _I64)


def parse_rank_file(path: str | Path, *, matching: bool = True) -> RawRank:
    """Parse one rank log; never raises for bad content (``error`` says why it is unusable).
    ``matching``: read the recorder's templated lines by matching when the compiled helper
    is there (`templated`); False decodes every line as JSON, in the same chunks (the same
    result, for comparing)."""
    with gc_paused():  # a chunk is tens of thousands of fresh dicts, none in a cycle
        return _parse(path, matching and available())


def _parse(path: str | Path, matching: bool) -> RawRank:
    raw = RawRank(str(path))
    try:
        header, handle, _ = open_log(path)
    except TraceFormatError as exc:
        raw.error = str(exc)
        return raw
    raw.header = header
    texts, threads = Interner(raw.texts), Interner(raw.threads)
    threads.get("main")
    shapes, dtypes = Interner(raw.shapes), Interner(raw.dtypes)
    steps, p2p, ends = _Columns(_STEP_COLS), _Columns(_P2P_COLS), _Columns(_END_COLS)
    interners = (texts, threads, shapes, dtypes)
    templated = TemplatedChunks(interners) if matching else None
    last_t = header["t0"] if fmt.is_int64(header.get("t0")) else None
    try:
        chunks = line_chunks(handle, raw.problems, chunk_bytes=chunk_bytes())
        for chunk, first_line, lines in chunks:
            columns = templated.columns(chunk, lines) if templated and lines else None
            if columns is None:
                items = decode_chunk(chunk, first_line, lines, raw.problems)
                columns = _decoded_columns(items, first_line, raw, interners)
                lines = len(items)
            sb, pp, en, other, times = columns
            last_t = _check_order(times, last_t, raw.problems)
            steps.add(sb)
            p2p.add(pp)
            ends.add(en)
            raw.events += lines
            for event in other:
                if not _lifecycle(event, raw):
                    raw.problems.note_corrupt(_line_of(event, chunk, first_line))
    except OSError as exc:
        raw.problems.notes.append(f"read error: {exc}")
    _finish(raw, steps, p2p, ends)
    return raw


def _decoded_columns(items: list, first_line: int, raw: RawRank, interners: tuple[Interner, ...]):
    """Columns of a chunk decoded as JSON: trusting the types, or event by event when a
    value does not have its documented type."""
    marks = [len(i.values) for i in interners]
    try:
        columns = _fast_batch(items, raw, interners)
        _check_new_values(interners, marks)
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError):
        for interner, mark in zip(interners, marks):
            interner.truncate(mark)
        columns = _slow_batch(items, first_line, raw, interners)
    return columns


def _check_order(times: np.ndarray, last_t: int | None, problems: LogProblems) -> int | None:
    """Count the lines whose time goes back from the line before (the header's ``t0`` for
    the first) by more than `ORDER_TOLERANCE_NS`; returns the chunk's last time."""
    if not len(times):
        return last_t
    steps = np.diff(times, prepend=times[0] if last_t is None else last_t)
    problems.time_reversals += int(np.count_nonzero(steps < -ORDER_TOLERANCE_NS))
    return int(times[-1])


def _check_new_values(interners: tuple[Interner, ...], marks: list[int]) -> None:
    texts, threads, shapes, dtypes = interners
    for interner, mark in ((texts, marks[0]), (threads, marks[1]), (dtypes, marks[3])):
        for value in interner.values[mark:]:
            if type(value) is not str:
                raise TypeError
    for shape in shapes.values[marks[2] :]:
        for dim in shape:
            if type(dim) is not int:
                raise TypeError


def _codes(interner: Interner, values: Any, count: int) -> np.ndarray:
    """Intern an iterable of hashable values; returns their codes."""
    values = list(values)
    codes = interner.codes
    try:  # after the first chunk nearly every value is known: skip building a set
        return np.fromiter(map(codes.__getitem__, values), np.int32, count)
    except KeyError:
        for value in dict.fromkeys(values):
            interner.get(value)
        return np.fromiter(map(codes.__getitem__, values), np.int32, count)


def _fast_batch(items: list, raw: RawRank, interners: tuple[Interner, ...]):
    """Columns of one chunk, trusting types (any surprise raises; the caller falls back)."""
    texts, threads, shapes, dtypes = interners
    sb: list = []
    pp: list = []
    en: list = []
    other: list = []
    sb_add, pp_add, en_add, other_add = sb.append, pp.append, en.append, other.append
    step_begin, p2p_post, ends = fmt.STEP_BEGIN, fmt.P2P_POST, _END_EVENTS
    for d in items:
        e = d["e"]
        if e in ends:
            en_add(d)
        elif e == step_begin:
            sb_add(d)
        elif e == p2p_post:
            pp_add(d)
        else:
            other_add(d)
    # every line's time in file order, for the order check; their types are checked with
    # their columns (steps, ops, ends) or by `_lifecycle` (the others)
    times = np.fromiter(map(itemgetter("t"), items), _I64, len(items))
    if len(times) and times.min() < 0:
        raise ValueError
    n_sb, n_pp, n_en = len(sb), len(pp), len(en)

    step_cols = {
        "t": _strict_ints(sb, "t", n_sb),
        "id": _strict_ints(sb, "id", n_sb),
        "it": _strict_ints(sb, "it", n_sb),
        "pos": _strict_ints(sb, "pos", n_sb),
        "code": _codes(texts, map(itemgetter("step"), sb), n_sb),
        "thread": _codes(threads, map(itemgetter("th"), sb), n_sb),
    }
    p2p_cols = {
        "t": _strict_ints(pp, "t", n_pp),
        "id": _strict_ints(pp, "id", n_pp),
        "it": _strict_ints(pp, "it", n_pp),
        "op": np.fromiter(map(_OPS.__getitem__, map(itemgetter("op"), pp)), np.int8, n_pp),
        "peer": _strict_ints(pp, "peer", n_pp),
        "ch": np.fromiter(map(_CHANNELS.__getitem__, map(itemgetter("ch"), pp)), np.int8, n_pp),
        "seq": _strict_ints(pp, "seq", n_pp),
        "nbytes": _strict_ints(pp, "bytes", n_pp),
        "shape": _codes(shapes, map(tuple, map(itemgetter("shape"), pp)), n_pp),
        "dtype": _codes(dtypes, map(itemgetter("dtype"), pp), n_pp),
        "code": _codes(texts, map(itemgetter("step"), pp), n_pp),
    }
    end_cols = {"id": _strict_ints(en, "id", n_en), "t": _strict_ints(en, "t", n_en)}
    return step_cols, p2p_cols, end_cols, other, times


def _strict_ints(rows: list, key: str, count: int) -> np.ndarray:
    """The ``key`` of each row as int64. `operator.index` refuses a string or a float that
    int64 conversion would take silently (TypeError), and too big a number overflows, so a
    value of another type sends the caller to its event-by-event checks."""
    return np.fromiter(map(index, map(itemgetter(key), rows)), _I64, count)


def _slow_batch(items: list, first_line: int, raw: RawRank, interners: tuple[Interner, ...]):
    """Columns of one chunk, checking every event; invalid events are counted as corrupt."""
    texts, threads, _, _ = interners
    sb: dict[str, list] = {n: [] for n in _STEP_COLS}
    pp: dict[str, list] = {n: [] for n in _P2P_COLS}
    en: dict[str, list] = {n: [] for n in _END_COLS}
    other: list = []
    times: list[int] = []
    checks = _checks(raw.header["schema_version"])
    for offset, d in enumerate(items):
        if d is SKIP:
            continue
        if not _valid(d, checks):
            raw.problems.note_corrupt(first_line + offset)
            continue
        times.append(d["t"])
        e = d["e"]
        if e in _END_EVENTS:
            en["id"].append(d["id"])
            en["t"].append(d["t"])
        elif e == fmt.STEP_BEGIN:
            values = (
                d["t"],
                d["id"],
                d["it"],
                d["pos"],
                texts.get(d["step"]),
                threads.get(d["th"]),
            )
            for name, value in zip(_STEP_COLS, values):
                sb[name].append(value)
        elif e == fmt.P2P_POST:
            values = _p2p_values(d, interners)
            for name, value in zip(_P2P_COLS, values):
                pp[name].append(value)
        else:
            other.append(d)

    def arrays(cols: dict[str, list]) -> dict[str, np.ndarray]:
        return {n: np.array(v, _dtype(n)) for n, v in cols.items()}

    return arrays(sb), arrays(pp), arrays(en), other, np.array(times, _I64)


def _p2p_values(d: dict[str, Any], interners: tuple[Interner, ...]) -> tuple:
    texts, _, shapes, dtypes = interners
    return (
        d["t"],
        d["id"],
        d["it"],
        _OPS[d["op"]],
        d["peer"],
        _CHANNELS.get(d["ch"], -1),
        d["seq"],
        d["bytes"],
        shapes.get(tuple(d["shape"])),
        dtypes.get(d["dtype"]),
        texts.get(d["step"]),
    )


Checks = dict[str, tuple[tuple[str, Callable[[Any], bool]], ...]]


@cache
def _checks(version: int) -> Checks:
    """{event type: ((field, type check), ...)} for the required fields of a schema version."""
    return {
        name: tuple((f.name, f.type.check) for f in event.required(version))
        for name, event in fmt.EVENTS.items()
    }


@cache
def _always(event: str) -> tuple[tuple[str, Callable[[Any], bool]], ...]:
    """(field, type check) of the fields the recorder always writes on an event type but
    that readers can do without."""
    record = fmt.EVENTS.get(event)
    fields = () if record is None else record.fields
    return tuple((f.name, f.type.check) for f in fields if f.presence is fmt.Presence.ALWAYS)


@cache
def _sometimes(event: str) -> tuple[tuple[str, Callable[[Any], bool]], ...]:
    """(field, type check) of the fields the recorder writes on an event type only at times
    (`device_pending`): checked where present."""
    record = fmt.EVENTS.get(event)
    fields = () if record is None else record.fields
    return tuple((f.name, f.type.check) for f in fields if f.presence is fmt.Presence.SOMETIMES)


def _outside_its_set(e: str, d: dict[str, Any]) -> bool:
    """A lifecycle event with a value its field does not allow (its types are right)."""
    return (
        (e == fmt.CLOCK and d["phase"] not in CLOCK_PHASES)
        or ("nonfinite" in d and d["nonfinite"] not in NONFINITE)
        or not all(map(fmt.is_pending_entry, d.get("device_pending", ())))
    )


def _valid(d: Any, checks: Checks) -> bool:
    """An event whose type and time are usable and whose required fields have their types."""
    if type(d) is not dict or type(d.get("e")) is not str or not fmt.is_int64(d.get("t")):
        return False
    if d["t"] < 0:  # nanoseconds since the epoch
        return False
    return all(check(d.get(name)) for name, check in checks.get(d["e"], ()))


def _line_of(event: dict[str, Any], chunk: bytes, first_line: int) -> int:
    """The line number of ``event`` in ``chunk`` (its first line's number ``first_line``),
    found again by decoding: only for the rare corrupt lifecycle event, whose line the
    column paths do not keep."""
    for k, line in enumerate(chunk.split(b"\n")):
        try:
            if orjson.loads(line) == event:
                return first_line + k
        except orjson.JSONDecodeError:
            continue
    return first_line


def _lifecycle(d: dict[str, Any], raw: RawRank) -> bool:
    """Iteration, clock and failure events (few per rank), checked one by one; False for
    one that is corrupt (kept nowhere)."""
    if not _valid(d, _checks(raw.header["schema_version"])):
        return False
    e, t = d["e"], d["t"]
    if not all(name in d and check(d[name]) for name, check in _always(e)) or not all(
        check(d[name]) for name, check in _sometimes(e) if name in d
    ):
        raw.problems.missing_fields += 1
    elif _outside_its_set(e, d):
        raw.problems.bad_values += 1
    if e == fmt.ITER_BEGIN:
        raw.iterations.setdefault(d["it"], [t, OPEN, None])[0] = t
    elif e == fmt.ITER_END:
        row = raw.iterations.setdefault(d["it"], [OPEN, t, None])
        row[1] = t
        loss = d.get("loss")
        row[2] = (
            float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None
        )
        if d.get("nonfinite") in NONFINITE:  # kept whole: `find_nonfinite_loss` reads it
            raw.lifecycle.append((e, t, {k: v for k, v in d.items() if k not in ("e", "t")}))
    elif e == fmt.DEVICE:
        db, de, unc = d["db"], d["de"], d.get("unc")
        if db < 0 or de < db:  # times on the rank's clock, as `t`: a span cannot end first
            return False
        raw.device.append((d["id"], db, de, unc if fmt.is_int64(unc) and unc > 0 else 0))
    elif e == fmt.MEMORY:
        swapped = d.get("swapped")
        sample = (t, d["id"], d["saved"], d["inflight"], d.get("allocated"), d.get("reserved"))
        raw.memory_events.append((*sample, swapped))
    elif e in _LIFECYCLE:
        fields = {k: v for k, v in d.items() if k not in ("e", "t")}
        if e == fmt.RUN_START and raw.run_start is None:
            raw.run_start = fields
        else:
            raw.lifecycle.append((e, t, fields))
    else:
        raw.unknown_events += 1
    return True


def _finish(raw: RawRank, steps: _Columns, p2p: _Columns, ends: _Columns) -> None:
    sb, pp, en = steps.result(), p2p.result(), ends.result()
    _add_listed_open(raw, sb, pp)
    raw.text_parts = parse_texts(raw.texts)  # here, in the worker, not in the loading process
    raw.plan_index = _plan_index(raw)
    _check_texts(raw)
    end_ids, end_t = en["id"], en["t"]
    order = np.argsort(end_ids, kind="stable")
    end_ids, end_t = end_ids[order], end_t[order]
    _check_ids(raw.problems, np.concatenate([sb["id"], pp["id"]]), end_ids)

    def end_of(ids: np.ndarray) -> np.ndarray:
        if not len(end_ids) or not len(ids):
            return np.full(len(ids), OPEN, _I64)
        idx = np.searchsorted(end_ids, ids)
        idx_c = np.minimum(idx, len(end_ids) - 1)
        return np.where(end_ids[idx_c] == ids, end_t[idx_c], OPEN)

    steps = {**sb, "begin": sb["t"], "end": _not_before(raw, sb["t"], end_of(sb["id"]))}
    p2p = {**pp, "post": pp["t"], "done": _not_before(raw, pp["t"], end_of(pp["id"]))}
    device = _device_columns(
        raw, np.concatenate([sb["id"], pp["id"]]), np.concatenate([sb["t"], pp["t"]])
    )
    steps.update({name: column[: len(sb["id"])] for name, column in device.items()})
    p2p.update({name: column[len(sb["id"]) :] for name, column in device.items()})
    raw.steps = {
        name: steps[name].astype(dtype, copy=False) for name, dtype in STEP_COLUMNS.items()
    }
    raw.p2p = {name: p2p[name].astype(dtype, copy=False) for name, dtype in P2P_COLUMNS.items()}
    raw.memory = _memory_columns(raw, sb["id"])


def _not_before(raw: RawRank, begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """``end``, where a row ends before it began (one clock never goes back: a damaged time)
    counted as damage and taken as ending where it began, so no view draws it backwards."""
    early = (end != OPEN) & (end < begin)
    if early.any():
        raw.problems.ended_before_begun += int(np.count_nonzero(early))
        end = np.where(early, begin, end)
    return end


def _rows_of(ids: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """The row of each id in ``wanted`` among the rows ``ids``, -1 where none has it."""
    if not len(ids) or not len(wanted):
        return np.full(len(wanted), -1, _I64)
    order = np.argsort(ids, kind="stable")
    found = np.minimum(np.searchsorted(ids[order], wanted), len(ids) - 1)
    return np.where(ids[order][found] == wanted, order[found], -1)


DEVICE_EARLY_SLACK_NS = 1_000_000
"""How far (beyond the anchor's uncertainty) a device span may seem to begin before the host
launched its step or op: more is impossible, a damaged or misaligned time, and dropped."""


def _device_columns(raw: RawRank, ids: np.ndarray, launched: np.ndarray) -> dict[str, np.ndarray]:
    """``dbegin``/``dend`` of the rows ``ids`` (launched by the host at ``launched``): their
    `device` event's times, joined by id (the event comes later in the log than the row's
    end), OPEN for a row without one. A device event for an id no row has, a second one for
    an id (the first is kept) and a span beginning before its launch are counted as damage."""
    dbegin, dend = np.full(len(ids), OPEN, _I64), np.full(len(ids), OPEN, _I64)
    if not raw.device:
        return {"dbegin": dbegin, "dend": dend}
    events = np.array(raw.device, _I64)
    problems = raw.problems
    problems.duplicate_ids += len(events) - len(np.unique(events[:, 0]))
    rows = _rows_of(ids, events[:, 0])
    hit = rows >= 0
    problems.dangling_ids += int(np.count_nonzero(~hit))
    early = np.zeros(len(events), bool)
    early[hit] = events[hit, 1] < launched[rows[hit]] - events[hit, 3] - DEVICE_EARLY_SLACK_NS
    problems.bad_values += int(np.count_nonzero(early))
    keep = np.flatnonzero(hit & ~early)[::-1]  # assigned last to first: an id's first stays
    dbegin[rows[keep]], dend[rows[keep]] = events[keep, 1], events[keep, 2]
    return {"dbegin": dbegin, "dend": dend}


def _memory_columns(raw: RawRank, ids: np.ndarray) -> dict[str, np.ndarray]:
    """The `memory` samples as columns (see `pipetrace.analyze.model.MemoryTable`), their
    steps joined by id. A sample whose lists do not have one entry per stage of the rank
    counts as a bad value and is dropped (so does a ``swapped`` that is not a list of ints)."""
    stages = len((raw.run_start or {}).get("stages") or ())
    events = raw.memory_events
    nothing = [0] * stages
    kept = [
        e[:6] + (nothing if e[6] is None else e[6],)
        for e in events
        if len(e[2]) == stages
        and len(e[3]) == stages
        and (e[6] is None or (fmt.INTS.check(e[6]) and len(e[6]) == stages))
    ]
    raw.problems.bad_values += len(events) - len(kept)
    raw.memory_events = []

    def ints(column: int) -> np.ndarray:
        return np.array([-1 if e[column] is None else e[column] for e in kept], _I64)

    return {
        "t": ints(0),
        "step": _rows_of(ids, ints(1)),
        "saved": np.array([e[2] for e in kept], _I64).reshape(len(kept), stages),
        "inflight": np.array([e[3] for e in kept], _I64).reshape(len(kept), stages),
        "allocated": ints(4),
        "reserved": ints(5),
        "swapped": np.array([e[6] for e in kept], _I64).reshape(len(kept), stages),
    }


def _check_ids(problems: LogProblems, begun: np.ndarray, ended: np.ndarray) -> None:
    """Count completions of ids never begun and ids begun or completed twice (the format
    pairs each begin with at most one end). ``ended`` is sorted; ``begun`` holds the steps'
    ids then the ops', each in the counter's rising order, so sorting them is a merge."""
    begun = np.sort(begun, kind="stable")
    problems.duplicate_ids += int(np.count_nonzero(np.diff(begun) == 0))
    problems.duplicate_ids += int(np.count_nonzero(np.diff(ended) == 0))
    if len(ended):
        at = np.minimum(np.searchsorted(begun, ended), max(len(begun) - 1, 0))
        known = begun[at] == ended if len(begun) else np.zeros(len(ended), bool)
        problems.dangling_ids += int(np.count_nonzero(~known))


def _plan_index(raw: RawRank) -> np.ndarray:
    """`RawRank.plan_index`: a lookup in this rank's few hundred texts here costs a fraction
    of one in the whole run's catalog (a few hundred thousand texts) in the loading process."""
    plan = (raw.run_start or {}).get("plan") or ()
    index = dict(zip(raw.texts, range(len(raw.texts)))).get
    return np.fromiter(map(index, plan, repeat(-1)), np.int32, len(plan))


def _check_texts(raw: RawRank) -> None:
    """Collect the step texts (of events, and of run_start's plan) that do not parse."""
    problems = raw.problems
    kind = raw.text_parts[0]
    problems.bad_step_texts += [raw.texts[i] for i in np.flatnonzero(kind < 0).tolist()]
    ran = set(raw.texts)
    planned = [t for t in dict.fromkeys((raw.run_start or {}).get("plan") or ()) if t not in ran]
    if planned:  # the plan's texts that no event used: most were parsed with the events'
        problems.bad_step_texts += [
            planned[i] for i in np.flatnonzero(parse_texts(planned)[0] < 0).tolist()
        ]


def _open_iteration(raw: RawRank) -> int:
    """The iteration the rank began last and never ended, -1 if none (for an open step listed
    without its iteration, as logs written before `open_steps` carried `it`)."""
    begun = [it for it, (_, end, _) in raw.iterations.items() if end == OPEN]
    return max(begun, default=-1)


def _add_listed_open(raw: RawRank, sb: dict[str, np.ndarray], pp: dict[str, np.ndarray]) -> None:
    """Steps and ops that the last stall/dump/signal/exception lists as open but whose begin
    is not in the log (lost with a damaged chunk): add them, begun at that event's time."""
    listing = [
        ev for ev in raw.lifecycle if ev[0] in (fmt.STALL, fmt.DUMP, fmt.SIGNAL, fmt.EXCEPTION)
    ]
    if not listing:
        return
    _, t, fields = listing[-1]
    known_steps = set(sb["id"].tolist())
    texts, threads = Interner(raw.texts), Interner(raw.threads)
    add_steps = []
    for item in fmt.listed(fields, "open_steps"):
        if (
            isinstance(item, dict)
            and fmt.is_int64(item.get("id"))
            and item["id"] not in known_steps
            and fmt.is_int64(item.get("pos"))
            and isinstance(item.get("step"), str)
        ):
            thread = item.get("thread") if isinstance(item.get("thread"), str) else "main"
            it = item["it"] if fmt.is_int64(item.get("it")) else _open_iteration(raw)
            add_steps.append(
                (t, item["id"], it, item["pos"], texts.get(item["step"]), threads.get(thread))
            )
    if add_steps:
        for name, values in zip(_STEP_COLS, zip(*add_steps)):
            sb[name] = np.concatenate([sb[name], np.array(values, sb[name].dtype)])
    known_ops = set(pp["id"].tolist())
    shapes, dtypes = Interner(raw.shapes), Interner(raw.dtypes)
    checks = _checks(raw.header["schema_version"])
    add_ops = []
    for item in fmt.listed(fields, "inflight"):
        if (
            isinstance(item, dict)
            and item.get("e") == fmt.P2P_POST
            and _valid(item, checks)
            and item["id"] not in known_ops
        ):
            add_ops.append(_p2p_values(item, (texts, threads, shapes, dtypes)))
    if add_ops:
        for name, values in zip(_P2P_COLS, zip(*add_ops)):
            pp[name] = np.concatenate([pp[name], np.array(values, pp[name].dtype)])
