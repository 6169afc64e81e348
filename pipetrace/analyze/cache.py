"""The columnar cache: rank logs' parsed columns kept beside the logs, so that a run is
parsed once and reopened in a fraction of the time.

``<log dir>/.pipetrace-cache/*.cols`` hold what `parse.parse_rank_file` made of the logs (a
`RawRank` each), several logs of one directory per file (a *pack*: the logs one parsing
task read, `store`): a small JSON index (each log's name and key, each array's dtype,
length and offset), then the arrays' bytes, each log's lists and lifecycle events among
them as a JSON array of its own. A reader takes a file in one read and makes every column a
numpy view of it: no parsing, no copy, no pickle (a cache file is data from the run
directory, never code: docs/security.md). One file per log cost a first analysis more
than the bytes it wrote: two parsing workers creating files at once made each creation
~1 ms, and 1024 of them were a third of the workers' time.

A log's part of a pack is used only while its key still describes the log: the cache
format, the log's size and modification time, and a hash of its first and last bytes (a
log that grew, was rewritten or cut gets a new key); the other logs of the pack are not
affected. A log modified in the last `RECENT_NS` is not cached (it may still be written,
and a file system's coarse time stamps could hide a second write). A cache that cannot be
written (a read-only directory) is skipped, and a part that does not read back whole and
consistent is ignored and rebuilt: the cache changes speed, never results.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import stat
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from functools import cache
from operator import itemgetter
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import orjson

from pipetrace import __version__, interning
from pipetrace.analyze import model, parse, reader, templated
from pipetrace.analyze.parse import (
    MEMORY_COLUMNS,
    MEMORY_GRIDS,
    P2P_COLUMNS,
    STEP_COLUMNS,
    RawRank,
    parse_rank_file,
)
from pipetrace.analyze.reader import LogProblems, TraceFormatError, open_regular
from pipetrace.recorder import format as fmt

CACHE_DIR = ".pipetrace-cache"
"""The cache's directory inside a run directory (recording and merging ignore it)."""
CACHE_VERSION = 2
"""Bump when the entry's layout changes (a changed parser makes entries stale by itself)."""
RECENT_NS = 2 * 10**9
_EDGE_BYTES = 4 << 10
_MAGIC = b"PTCOLS\x00\x01"
_ALIGN = 64
_TEXT_PARTS = (np.int8, np.int32, np.int32)  # `parse.parse_texts`: kind, stage, micro-batch
_LOG = logging.getLogger(__name__)
_PARSER_MODULES = (parse, reader, templated, model, interning, fmt, sys.modules[__name__])
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_PROBLEMS = asdict(LogProblems())
_FIELDS = {"fields": np.uint8}
_T = TypeVar("_T")


@dataclass(frozen=True)
class LogKey:
    """What a cache entry was made from: it is used only while the log still has this key."""

    version: str
    size: int
    mtime_ns: int
    ctime_ns: int  # status change: any write moves it, and no one can set it back
    edges: str  # hash of the log's first and last `_EDGE_BYTES`

    @classmethod
    def of(cls, log: Path) -> LogKey:
        """The log's key now (OSError when it cannot be read, TraceFormatError when it is not
        a regular file: a FIFO must not block the load).

        A first analysis takes each log's key four times (the command's lookup of its kept
        output, the load, and the checks that nothing changed before each store): while the
        file's status (`_Identity`) is the one its edges were hashed under and has not changed
        for `RECENT_NS`, they are not read again: a write moves the change time (which, unlike
        the modification time, no one can set back) and a replaced file has another inode."""
        info = os.stat(log)
        known = _EDGES.get(str(log))
        if known is None or known[0] != _Identity.of(info) or not _settled(info):
            with open_regular(log) as handle:
                info = os.fstat(handle.fileno())
                known = _Identity.of(info), _edges(handle, info.st_size)
            _EDGES[str(log)] = known
        return cls(_format_version(), info.st_size, info.st_mtime_ns, info.st_ctime_ns, known[1])


@dataclass(frozen=True)
class _Identity:
    """What a file's status says of its content: any write or replacement changes it."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> _Identity:
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


_EDGES: dict[str, tuple[_Identity, str]] = {}
"""The edge hash of each log whose key this process took, under the status it had then."""


def _settled(info: os.stat_result) -> bool:
    """A regular file whose status last changed `RECENT_NS` ago or more: two writes within
    one tick of the file system's coarse clock could leave its status as it was."""
    return stat.S_ISREG(info.st_mode) and time.time_ns() - info.st_ctime_ns >= RECENT_NS


def _edges(handle: Any, size: int) -> str:
    """A hash of the file's first and last `_EDGE_BYTES` (a log rewritten, grown or cut)."""
    digest = hashlib.blake2b(handle.read(_EDGE_BYTES), digest_size=16)
    if size > _EDGE_BYTES:
        handle.seek(max(_EDGE_BYTES, size - _EDGE_BYTES))
        digest.update(handle.read(_EDGE_BYTES))
    return digest.hexdigest()


@cache
def _format_version() -> str:
    """The cache version and a hash of the source of every module that decides what a log
    parses to: any change to the parser (a new pipetrace, or a developer's edit) makes older
    entries stale by itself, so no entry outlives the code that made it."""
    sources = [Path(str(m.__file__)) for m in _PARSER_MODULES]
    return source_digest(f"{CACHE_VERSION}", sources + templated.compiled_sources())


def source_digest(label: str, sources: Iterable[Path]) -> str:
    """A hash of ``label``, pipetrace's version and these source files (a file that cannot
    be read, as in a frozen install, counts by the version alone)."""
    digest = hashlib.blake2b(f"{label}/{__version__}".encode(), digest_size=16)
    for source in sources:
        with contextlib.suppress(OSError):
            digest.update(source.read_bytes())
    return digest.hexdigest()


def load_all(logs: list[Path]) -> dict[Path, RawRank]:
    """The cached columns of each log that has a fresh, whole part in its directory's
    cache (the others are missing from the result)."""
    found: dict[Path, RawRank] = {}
    for directory, members in _by_directory(logs, Path).items():
        keys = {}  # log name -> (log, key now), for every log whose key can be taken
        for log in members:
            with contextlib.suppress(OSError, TraceFormatError):  # the parser says why
                keys[log.name] = (log, asdict(LogKey.of(log)))
        cache_dir = directory / CACHE_DIR
        prune = not cache_dir.is_symlink()  # never delete through a link (writes refuse one)
        for pack in _packs(cache_dir):
            if len(found) == len(logs):
                break
            found.update(_load_pack(pack, keys, found, prune))
    return found


def _by_directory(items: Iterable[_T], log_of: Callable[[_T], Path]) -> dict[Path, list[_T]]:
    """The items grouped by the directory of their log (a run over several directories has
    a cache in each), in their order."""
    grouped: dict[Path, list[_T]] = {}
    for item in items:
        grouped.setdefault(log_of(item).parent, []).append(item)
    return grouped


def _packs(cache_dir: Path) -> list[Path]:
    """The cache's packs, by name (none when there is no cache, or it cannot be listed)."""
    try:
        with os.scandir(cache_dir) as found:
            return sorted(Path(entry.path) for entry in found if entry.name.endswith(".cols"))
    except OSError:
        return []


def _load_pack(
    pack: Path,
    keys: dict[str, tuple[Path, dict[str, Any]]],
    found: dict[Path, RawRank],
    prune: bool,
) -> dict[Path, RawRank]:
    """The logs of ``keys`` not ``found`` yet whose part of this pack is fresh and whole.
    With ``prune``, a pack whose every log is one of ``keys`` and changed since is deleted:
    nothing would read it again (the logs' new parts go to other packs)."""
    try:
        with open_regular(pack) as handle:
            index, start = _read_index(handle)
            members = _fresh_members(index["logs"], keys, found)
            if not members:
                if prune and _all_stale(index["logs"], keys):
                    pack.unlink()
                return {}
            data = _read_whole(handle, start, mapped=False)
        specs = _member_specs(index["arrays"])
    except (FileNotFoundError, TraceFormatError):
        return {}
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        _LOG.debug("%s: cache pack ignored (%s)", pack, exc)
        return {}
    loaded = {}
    for member, log in members:
        try:
            loaded[log] = _member(log, specs[str(member)], data)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            _LOG.debug("%s: %s's part ignored (%s)", pack, log.name, exc)
    return loaded


def _fresh_members(
    logs: Any, keys: dict[str, tuple[Path, dict[str, Any]]], found: dict[Path, RawRank]
) -> list[tuple[int, Path]]:
    """(position in the pack, log) of the pack's logs that are wanted, not found yet, and
    whose key is the log's key now."""
    if type(logs) is not list:
        raise ValueError("bad pack index")
    fresh = []
    for member, (name, key) in enumerate(logs):
        log, now = keys.get(name, (None, None))
        if log is not None and log not in found and key == now:
            fresh.append((member, log))
    return fresh


def _all_stale(logs: list[Any], keys: dict[str, tuple[Path, dict[str, Any]]]) -> bool:
    """Is every log of the pack one of ``keys``, changed since the pack was written?"""
    return all(name in keys and keys[name][1] != key for name, key in logs)


def _member_specs(specs: Any) -> dict[str, list[list[Any]]]:
    """The pack's array specs by log (its position), each array's name without the
    position's prefix."""
    by_member: dict[str, list[list[Any]]] = {}
    for name, *rest in specs:
        member, _, column = name.partition("/")
        by_member.setdefault(member, []).append([column, *rest])
    return by_member


def _member(log: Path, specs: list[list[Any]], data: memoryview) -> RawRank:
    """One log's part of a pack as a `RawRank` (ValueError, KeyError or TypeError unless
    whole and consistent)."""
    fields = entry_arrays({"arrays": [s for s in specs if s[0] == "fields"]}, data, _FIELDS)
    index = {
        "fields": orjson.loads(memoryview(fields["fields"])),
        "arrays": [spec for spec in specs if spec[0] != "fields"],
    }
    return _decode(log, index, data)


def read_entry(
    path: Path, fresh: Callable[[dict[str, Any]], bool], mapped: bool = False
) -> tuple[dict[str, Any], memoryview] | None:
    """An entry's index and its arrays' bytes, read whole in one go (``mapped``: mapped,
    `_mapped`), or None when ``fresh`` says the index's key no longer describes its source
    (checked before the big read). Raises OSError, ValueError (not an entry, cut short) or
    TraceFormatError (not a regular file)."""
    with open_regular(path) as handle:
        index, start = _read_index(handle)
        if not fresh(index):
            return None
        return index, _read_whole(handle, start, mapped)


def _read_whole(handle: Any, start: int, mapped: bool) -> memoryview:
    """The bytes of an open entry's arrays (``start``: where they begin), read in one go
    (``mapped``: mapped, `_mapped`)."""
    info = os.fstat(handle.fileno())
    if mapped:
        buffer: bytearray | mmap.mmap = _mapped(handle.fileno(), info)
    else:
        buffer = bytearray(info.st_size)
        handle.seek(0)
        if handle.readinto(buffer) != info.st_size:
            raise ValueError("short read")
    return memoryview(buffer)[start:]


def _mapped(fd: int, info: os.stat_result) -> mmap.mmap:
    """The file mapped copy-on-write (its arrays writable, the file never written): a run
    entry of 300 MiB is then no read at all, where copying it cost a quarter of a reopen
    (zeroing, page faults, the copy), and its pages are read when a view first touches them.

    A mapped file cut short while mapped kills the process (SIGBUS) when a page past its new
    end is touched. pipetrace never changes an entry in place (`write_entry` renames a new
    file over it, and a deleted or replaced file stays whole for whoever maps it), and the
    arrays' extents are checked against the size mapped (`entry_arrays`); only a file cut in
    place by something else, between this check and a view's use, is not guarded against.
    ValueError when the file changed while it was being mapped."""
    buffer = mmap.mmap(fd, info.st_size, access=mmap.ACCESS_COPY)
    now = os.fstat(fd)
    if (now.st_ino, now.st_size, now.st_mtime_ns) != (info.st_ino, info.st_size, info.st_mtime_ns):
        buffer.close()
        raise ValueError("changed while it was mapped")
    return buffer


def parse_and_store_all(logs: list[Path]) -> list[RawRank]:
    """Parse the logs and cache the results of those that held still while they were read
    (one pack per directory: `store`)."""
    raws, held = [], []
    for log in logs:
        try:
            key = LogKey.of(log)
        except (OSError, TraceFormatError):
            raws.append(parse_rank_file(log))  # the parser says what is wrong with it
            continue
        raw = parse_rank_file(log)
        raws.append(raw)
        if raw.error is None and time.time_ns() - key.mtime_ns >= RECENT_NS:
            with contextlib.suppress(OSError, TraceFormatError):
                if LogKey.of(log) == key:
                    held.append((log, key, raw))
    for members in _by_directory(held, itemgetter(0)).values():
        store(members)
    return raws


def store(members: list[tuple[Path, LogKey, RawRank]]) -> None:
    """Write one pack: parsed logs of one directory, each with its key (`write_entry`). It
    is named after its first log and a digest of the others (the same logs parsed together
    again replace it)."""
    logs = [log for log, _, _ in members]
    name = logs[0].name
    if len(logs) > 1:
        names = "\n".join(log.name for log in logs).encode()
        name += f"+{len(logs) - 1}.{hashlib.blake2b(names, digest_size=4).hexdigest()}"
    arrays: dict[str, Column] = {}
    for member, (_, _, raw) in enumerate(members):
        fields = np.frombuffer(orjson.dumps(_fields(raw)), np.uint8)
        columns = {"fields": fields, **_arrays(raw)}
        arrays |= {f"{member}/{column}": array for column, array in columns.items()}
    index = {"logs": [[log.name, asdict(key)] for log, key, _ in members]}
    write_entry(logs[0].parent / CACHE_DIR / f"{name}.cols", index, arrays)


Column = np.ndarray | list[np.ndarray]
"""An array, or the parts of one (of one dtype) written one after the other: the run-level
entry writes each rank's slice of a column without joining them in memory first."""


def write_entry(target: Path, index: dict[str, Any], arrays: dict[str, Column]) -> None:
    """Write an entry: ``index`` (JSON) with each array's spec added, then the arrays. A new
    temporary file is renamed into place, so readers see all or nothing, and no planted
    link is followed; a directory that cannot be written is skipped with a debug note."""
    columns = {name: a if isinstance(a, list) else [a] for name, a in arrays.items()}
    specs, offset = [], 0
    for name, parts in columns.items():
        specs.append([name, parts[0].dtype.str, sum(map(len, parts)), offset])
        offset += -(-sum(part.nbytes for part in parts) // _ALIGN) * _ALIGN
    try:
        head = orjson.dumps({**index, "arrays": specs})
    except orjson.JSONEncodeError as exc:  # cannot happen for decoded JSON; never fail a load
        _LOG.debug("%s: not cached (%s)", target, exc)
        return
    start = _data_start(len(head))
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(exist_ok=True)
        if target.parent.is_symlink():
            raise OSError(f"{target.parent} is a symbolic link")
        fd = os.open(temporary, _NEW_FILE, 0o644)
        try:
            _write_all(fd, _pieces(_MAGIC + len(head).to_bytes(8, "little") + head, start, columns))
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except OSError as exc:
        _LOG.debug("%s: not cached (%s)", target, exc)
        with contextlib.suppress(OSError):
            temporary.unlink()


def _pieces(head: bytes, start: int, columns: dict[str, list[np.ndarray]]) -> list[Any]:
    """An entry's bytes as buffers in file order: the head, then each column's parts, each
    column starting at an `_ALIGN` boundary (zeros between)."""
    pieces: list[Any] = [head, bytes(start - len(head))]
    for parts in columns.values():
        pieces += [np.ascontiguousarray(part).data.cast("B") for part in parts]
        pad = -sum(part.nbytes for part in parts) % _ALIGN
        if pad:
            pieces.append(bytes(pad))
    return pieces


def _write_all(fd: int, pieces: list[Any]) -> None:
    """Write the buffers with as few system calls as the kernel allows (``writev``: the
    entries' 30 to 30,000 column parts cost ~25 µs a call when written one by one)."""
    batch = 512  # below every system's IOV_MAX
    for first in range(0, len(pieces), batch):
        views = [memoryview(p) for p in pieces[first : first + batch] if len(p)]
        while views:
            written = os.writev(fd, views)
            while views and written >= len(views[0]):
                written -= len(views.pop(0))
            if views:
                views[0] = views[0][written:]


def _arrays(raw: RawRank) -> dict[str, np.ndarray]:
    return {
        **{f"steps.{name}": raw.steps[name] for name in STEP_COLUMNS},
        **{f"p2p.{name}": raw.p2p[name] for name in P2P_COLUMNS},
        **{f"text_parts.{i}": part for i, part in enumerate(raw.text_parts)},
        "plan_index": raw.plan_index,
        **{f"memory.{name}": column.reshape(-1) for name, column in raw.memory.items()},
    }


def _fields(raw: RawRank) -> dict[str, Any]:
    """Everything but the arrays, as JSON values (`device` is joined into the columns)."""
    return {
        "header": raw.header,
        "problems": asdict(raw.problems),
        "events": raw.events,
        "unknown_events": raw.unknown_events,
        "texts": raw.texts,
        "threads": raw.threads,
        "shapes": raw.shapes,
        "dtypes": raw.dtypes,
        "iterations": [[it, *row] for it, row in raw.iterations.items()],
        "lifecycle": raw.lifecycle,
        "run_start": raw.run_start,
    }


def _data_start(index_bytes: int) -> int:
    """Where the arrays begin: after the magic, the index's length and the index, aligned."""
    return -(-(len(_MAGIC) + 8 + index_bytes) // _ALIGN) * _ALIGN


def _read_index(handle: Any) -> tuple[dict[str, Any], int]:
    """The entry's index and where its arrays begin."""
    head = handle.read(len(_MAGIC) + 8)
    if len(head) != len(_MAGIC) + 8 or not head.startswith(_MAGIC):
        raise ValueError("not a pipetrace cache file")
    length = int.from_bytes(head[len(_MAGIC) :], "little")
    index = orjson.loads(handle.read(length))
    if not isinstance(index, dict):
        raise ValueError("bad index")
    return index, _data_start(length)


def _decode(log: Path, index: dict[str, Any], data_bytes: memoryview) -> RawRank:
    """The entry as a `RawRank` whose columns are views of ``data_bytes``; ValueError (or
    KeyError, TypeError) unless every part has the shape and type the parser gives it."""
    data = index["fields"]
    if not _valid_fields(data):
        raise ValueError("bad fields")
    expected = {
        **{f"steps.{name}": dtype for name, dtype in STEP_COLUMNS.items()},
        **{f"p2p.{name}": dtype for name, dtype in P2P_COLUMNS.items()},
        **{f"text_parts.{i}": dtype for i, dtype in enumerate(_TEXT_PARTS)},
        "plan_index": np.int32,
        **{f"memory.{name}": np.int64 for name in (*MEMORY_COLUMNS, *MEMORY_GRIDS)},
    }
    arrays = entry_arrays(index, data_bytes, expected)
    raw = RawRank(
        str(log),
        header=data["header"],
        problems=LogProblems(**data["problems"]),
        events=data["events"],
        unknown_events=data["unknown_events"],
        texts=data["texts"],
        threads=data["threads"],
        shapes=[tuple(shape) for shape in data["shapes"]],
        dtypes=data["dtypes"],
        text_parts=tuple(arrays[f"text_parts.{i}"] for i in range(len(_TEXT_PARTS))),
        plan_index=arrays["plan_index"],
        steps={name: arrays[f"steps.{name}"] for name in STEP_COLUMNS},
        p2p={name: arrays[f"p2p.{name}"] for name in P2P_COLUMNS},
        iterations={it: row for it, *row in data["iterations"]},
        lifecycle=[(e, t, f) for e, t, f in data["lifecycle"]],
        run_start=data["run_start"],
        memory=_memory(arrays, data["run_start"]),
    )
    _check_columns(raw)
    return raw


def entry_arrays(
    index: dict[str, Any], data_bytes: memoryview, expected: dict[str, Any]
) -> dict[str, np.ndarray]:
    """The entry's arrays as writable views of ``data_bytes``, by name; ValueError unless
    they are exactly ``expected`` (name -> dtype) and inside the entry."""
    arrays = {}
    for name, dtype, count, offset in index["arrays"]:
        want = np.dtype(expected[name])
        if dtype != want.str or count < 0 or offset < 0:
            raise ValueError(f"bad array {name}")
        if offset + count * want.itemsize > len(data_bytes):
            raise ValueError("cut short")
        arrays[name] = np.frombuffer(data_bytes, want, count, offset)
    if arrays.keys() != expected.keys():
        raise ValueError("missing arrays")
    return arrays


def _memory(arrays: dict[str, np.ndarray], run_start: Any) -> dict[str, np.ndarray]:
    """The memory columns, per-stage grids given back their shape (ValueError if the sizes
    do not fit the rank's stages)."""
    stages = len((run_start or {}).get("stages") or ())
    count = len(arrays["memory.t"])
    memory = {name: arrays[f"memory.{name}"] for name in MEMORY_COLUMNS}
    for name in MEMORY_GRIDS:
        memory[name] = arrays[f"memory.{name}"].reshape(count, stages)
    if len({len(column) for column in memory.values()}) > 1:
        raise ValueError("memory columns of unequal length")
    return memory


def _is_int(value: Any) -> bool:
    return type(value) is int


def _strings(value: Any) -> bool:
    return type(value) is list and set(map(type, value)) <= {str}


def _ints(value: Any) -> bool:
    return type(value) is list and set(map(type, value)) <= {int}


def _rows(value: Any, *checks: Any) -> bool:
    """A list of lists, each of ``len(checks)`` values passing their checks."""
    return type(value) is list and all(
        type(row) is list and len(row) == len(checks) and all(c(v) for c, v in zip(checks, row))
        for row in value
    )


def _valid_fields(data: Any) -> bool:
    def is_dict(value: Any) -> bool:
        return type(value) is dict

    def moment(value: Any) -> bool:  # a time, or OPEN
        return type(value) is int and value >= -1

    def loss(value: Any) -> bool:
        return value is None or type(value) is float

    checks = {
        "header": is_dict,
        "problems": _valid_problems,
        "events": _is_int,
        "unknown_events": _is_int,
        "texts": _strings,
        "threads": _strings,
        "shapes": lambda v: type(v) is list and all(_ints(shape) for shape in v),
        "dtypes": _strings,
        "iterations": lambda v: _rows(v, _is_int, moment, moment, loss),
        "lifecycle": lambda v: _rows(v, lambda e: type(e) is str, _is_int, is_dict),
        "run_start": lambda v: v is None or is_dict(v),
    }
    return (
        type(data) is dict
        and data.keys() == checks.keys()
        and all(check(data[name]) for name, check in checks.items())
    )


def _valid_problems(value: Any) -> bool:
    """The fields of `LogProblems`, each of its default's type (an int or None for the
    first corrupt line)."""
    default = _PROBLEMS
    if type(value) is not dict or value.keys() != default.keys():
        return False
    for name, given in value.items():
        if name == "first_corrupt_line":
            if given is not None and type(given) is not int:
                return False
        elif type(given) is not type(default[name]) or (
            type(given) is list and not _strings(given)
        ):
            return False
    return True


def _check_columns(raw: RawRank) -> None:
    """Equal lengths within a table, and every code inside the list it indexes."""
    lists = {
        "code": len(raw.texts),
        "thread": len(raw.threads),
        "shape": len(raw.shapes),
        "dtype": len(raw.dtypes),
    }
    for table in (raw.steps, raw.p2p):
        if len({len(column) for column in table.values()}) > 1:
            raise ValueError("columns of unequal length")
        for name, size in lists.items():
            column = table.get(name)
            if column is not None and len(column) and not 0 <= column.min() <= column.max() < size:
                raise ValueError(f"{name} out of range")
    if {len(part) for part in raw.text_parts} != {len(raw.texts)}:
        raise ValueError("text parts do not match the texts")
    _check_plan_index(raw)


def _check_plan_index(raw: RawRank) -> None:
    """Each text of the rank's plan that the index places among its texts is that text (a
    -1 only costs the loader a look-up)."""
    plan, index = (raw.run_start or {}).get("plan") or [], raw.plan_index
    if len(index) != len(plan):
        raise ValueError("plan index of another length than the plan")
    if len(index) and not -1 <= index.min() <= index.max() < len(raw.texts):
        raise ValueError("plan index out of range")
    known = np.flatnonzero(index >= 0).tolist()
    texts = map(raw.texts.__getitem__, index[known].tolist())
    if list(texts) != list(map(plan.__getitem__, known)):
        raise ValueError("plan index does not match the texts")
