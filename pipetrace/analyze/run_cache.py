"""The run-level cache entry: the assembled `Run`, after matching and clock alignment, so
that a second `analyze`, `tui` or `export` of an unchanged run is a read.

The per-log entries (`analyze.cache`) spare the parsing; what is left of a reopen without
this entry is the model's assembly, the same for every reopen: interning every rank's step
texts into one catalog, send/recv matching, clock alignment, putting every time on rank 0's
clock. ``<meta.json's dir>/.pipetrace-cache/run.model`` (``run-<ranks hash>.model`` for a
``--ranks``/``--replica`` selection) holds its result in the per-log entries' layout (a JSON
index, then aligned raw columns: `cache.write_entry`): each table's column concatenated over
the ranks, each rank's row counts and other fields in the index.

The entry is used only while its key holds: every loaded log's `cache.LogKey` (or its
absence), meta.json's content, the selection, and a hash of every analyze module's source
(any code change rebuilds it). A run with a log written in the last `cache.RECENT_NS` is not
stored, nor one whose logs changed while it was loaded; an entry that does not read back
whole and consistent is ignored (the load then proceeds as without it).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Collection
from dataclasses import fields
from functools import cache as memoize
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from pipetrace.analyze import cache as column_cache
from pipetrace.analyze import kept_analysis, model
from pipetrace.analyze.pipelines import Pipelines
from pipetrace.analyze.reader import TraceFormatError
from pipetrace.analyze.source import RunSource
from pipetrace.schedule.ir import Plan

RUN_CACHE_VERSION = 2
"""Bump when the entry's layout changes (changed analyze sources make entries stale anyway)."""
_TABLES: dict[str, Any] = {
    "steps": model.StepTable.empty(),
    "p2p": model.P2PTable.empty(),
    "iterations": model.IterationTable.empty(),
}
_MEMORY = model.MemoryTable.empty()
"""Its columns are kept flat (a per-stage grid's rows one after the other) with each rank's
shapes in its record."""
_CATALOG = {"catalog.kind": np.int8, "catalog.stage": np.int32, "catalog.microbatch": np.int32}
_RANK_KEYS = (
    *("rank", "present", "status", "clock", "header", "stages", "config"),
    *("lifecycle", "events", "path", "rows", "memory"),
)
_LOG = logging.getLogger(__name__)


@memoize
def _code_version() -> str:
    """A hash of pipetrace's every module: the model and the reports depend on many (the
    loader, the analyzers, the schedule simulator, the commands' output), and reading them
    all costs a few milliseconds."""
    package = Path(__file__).parents[1]
    return column_cache.source_digest(f"run/{RUN_CACHE_VERSION}", sorted(package.rglob("*.py")))


def run_key(source: RunSource, wanted: Collection[int], selection: str | None) -> str | None:
    """The key of the run as it is now, None when it must not be cached: a log written in
    the last seconds (it may still grow), or one that is not a regular file."""
    logs = []
    now = time.time_ns()
    for rank in sorted(wanted):
        try:
            key = column_cache.LogKey.of(source.logs[rank])
        except FileNotFoundError:
            logs.append([rank, str(source.logs[rank]), None])
            continue
        except (OSError, TraceFormatError):
            return None
        if now - key.mtime_ns < column_cache.RECENT_NS:
            return None
        logs.append([rank, str(source.logs[rank]), key])  # orjson writes a dataclass as a dict
    whole = {
        "code": _code_version(),
        "meta": orjson.dumps(source.meta, option=orjson.OPT_SORT_KEYS).decode(),
        "directories": [str(d) for d in source.directories],
        "selection": selection,
        "logs": logs,
    }
    return hashlib.blake2b(orjson.dumps(whole), digest_size=20).hexdigest()


def entry_path(source: RunSource, wanted: Collection[int]) -> Path:
    """One entry per selection of ranks (the whole run: ``run.model``)."""
    directory = source.meta_dir / column_cache.CACHE_DIR
    if len(wanted) == source.world_size:
        return directory / "run.model"
    ranks = orjson.dumps(sorted(wanted))
    return directory / f"run-{hashlib.blake2b(ranks, digest_size=8).hexdigest()}.model"


class RunEntry:
    """The entry of a run (a selection of its ranks) as its files are now. ``selection``
    says how the ranks were chosen (the ranks left out are marked with it): a selection of
    every rank is the whole run."""

    def __init__(self, source: RunSource, wanted: Collection[int], selection: str | None) -> None:
        self.source, self.wanted = source, wanted
        self.selection = selection if len(wanted) < source.world_size else None
        self.path = entry_path(source, wanted)
        self.key = run_key(source, wanted, self.selection)

    def load(self) -> model.Run | None:
        """The cached run, or None when there is no fresh, whole entry."""
        return None if self.key is None else load(self.path, self.key, self.source)

    def store(self, run: model.Run, problems_from: int, planned: list[np.ndarray]) -> bool:
        """Cache ``run`` when the logs held still while it was loaded (`store`); says
        whether they did (``run`` is then the model of this entry's key)."""
        still = self._still()
        if still:
            store(self.path, self.key, run, problems_from, planned)
        return still

    def analysis(self) -> kept_analysis.Parts | None:
        """The analysis kept under this entry's key (`kept_analysis`), or None."""
        return None if self.key is None else kept_analysis.read(self._analysis_path(), self.key)

    def keep_analysis(self, parts: kept_analysis.Parts) -> None:
        """Keep the analysis of this entry's run (`kept_analysis`)."""
        if self.key is not None:
            kept_analysis.write(self._analysis_path(), self.key, parts)

    def report(self, variant: str) -> tuple[int, str] | None:
        """A command's output made before from this run, and its exit code (``variant``:
        which output: the command and its output options), or None."""
        if self.key is None:
            return None
        path = self._report_path(variant)
        try:
            found = column_cache.read_entry(path, lambda index: index["key"] == self.key)
            if found is None:
                return None
            code, text = found[0]["exit"], found[0]["text"]
            if type(code) is not int or type(text) is not str:
                raise ValueError("bad report")
            return code, text
        except (FileNotFoundError, TraceFormatError):
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            _LOG.debug("%s: report ignored (%s)", path, exc)
            return None

    def store_report(self, variant: str, code: int, text: str) -> None:
        """Keep a command's output (`report`) when the logs held still while it was made."""
        if self._still():
            index = {"key": self.key, "exit": code, "text": text}
            column_cache.write_entry(self._report_path(variant), index, {})

    def _still(self) -> bool:
        """Does the key still describe the run (no log changed since it was taken)?"""
        return (
            self.key is not None and run_key(self.source, self.wanted, self.selection) == self.key
        )

    def _report_path(self, variant: str) -> Path:
        return self.path.with_suffix(f".{variant}.report")

    def _analysis_path(self) -> Path:
        return self.path.with_suffix(".analysis")


def store(
    path: Path, key: str, run: model.Run, problems_from: int, planned: list[np.ndarray]
) -> None:
    """Write the run's entry; ``problems_from``: the first of ``run.problems`` found while
    loading (the ones before come from the source, gathered again on every load);
    ``planned``: the codes of each row of meta.json's plan, bubbles left out, as the loader
    read it (`Run.plan`)."""
    ranks = run.ranks
    arrays: dict[str, column_cache.Column] = {
        f"{table}.{name}": [
            getattr(getattr(r, table), name).astype(getattr(empty, name).dtype, copy=False)
            for r in ranks
        ]
        for table, empty in _TABLES.items()
        for name in _columns(empty)
    }
    arrays["plan_codes"] = [r.plan_codes.astype(np.int32, copy=False) for r in ranks]
    rows = None if run.plan is None else _meta_rows(run.meta, planned)
    arrays["meta_plan"] = np.concatenate([np.empty(0, np.int32), *(rows or ())])
    for name in _columns(_MEMORY):
        arrays[f"memory.{name}"] = [
            getattr(r.memory, name).astype(np.int64, copy=False).ravel() for r in ranks
        ]
    catalog = run.catalog
    arrays |= dict(zip(_CATALOG, (catalog.kind, catalog.stage, catalog.microbatch)))
    index = {
        "key": key,
        "t0_ns": run.t0_ns,
        "clock_quality": run.clock_quality,
        "pipelines": run.pipelines.groups,
        "problems": [
            [p.severity, p.message, p.rank, p.damage] for p in run.problems[problems_from:]
        ],
        "texts": catalog.texts,
        "threads": run.threads,
        "shapes": run.shapes,
        "dtypes": run.dtypes,
        "ranks": [_rank_fields(r) for r in ranks],
        "meta_plan": None if rows is None else list(map(len, rows)),
    }
    _write_behind(path, index, arrays)


_WRITING: dict[Path, threading.Thread] = {}
"""Run entries being written, by path (`_write_behind`)."""


def _write_behind(path: Path, index: dict[str, Any], arrays: dict[str, Any]) -> None:
    """Write the entry in a thread while the command goes on to analyze the run: writing
    300 MiB was ~0.7 s of a 10 M-event first analysis, on the loading process's critical
    path, and nothing in the command reads the file. The thread is not a daemon: the
    interpreter waits for it at exit, so a command's end never cuts an entry (readers see
    all of one or none: `write_entry` renames a whole file into place). Nothing changes the
    run's arrays after loading."""
    wait_for_writes(path)
    thread = threading.Thread(
        target=column_cache.write_entry, args=(path, index, arrays), name="pipetrace-run-entry"
    )
    _WRITING[path] = thread
    thread.start()


def wait_for_writes(path: Path | None = None) -> None:
    """Wait until the run entries being written (only ``path``'s, if given) are on disk."""
    for target in [path] if path is not None else list(_WRITING):
        thread = _WRITING.pop(target, None)
        if thread is not None:
            thread.join()


def _meta_rows(meta: dict[str, Any], planned: list[np.ndarray]) -> list[np.ndarray]:
    """meta.json's plan (that read as a `Plan`) as codes into the catalog, -1 a bubble:
    its rows' codes without bubbles (``planned``) put in place."""
    rows = []
    for row, codes in zip(meta["plan"], planned, strict=True):
        full = np.full(len(row), -1, np.int32)
        full[np.fromiter(map(bool, row), bool, len(row))] = codes
        rows.append(full)
    return rows


def _columns(table: Any) -> list[str]:
    return [f.name for f in fields(table)]


def _rank_fields(rank: model.RankTimeline) -> dict[str, Any]:
    """A rank's fields other than its columns (its plan is its plan codes' texts)."""
    status = rank.status
    return {
        "rank": rank.rank,
        "present": rank.present,
        "status": [status.state, status.detail, status.last_step, status.last_iteration]
        + [status.error],
        "clock": rank.clock.to_json(),
        "header": rank.header,
        "stages": rank.stages,
        "config": rank.config,
        "lifecycle": [[ev.e, ev.t, ev.fields] for ev in rank.lifecycle],
        "events": rank.events,
        "path": None if rank.path is None else str(rank.path),
        "rows": [len(rank.steps), len(rank.p2p), len(rank.iterations), len(rank.plan_codes)],
        "memory": [list(getattr(rank.memory, name).shape) for name in _columns(_MEMORY)],
    }


def load(path: Path, key: str, source: RunSource) -> model.Run | None:
    """The cached run, or None when there is no fresh, whole entry under ``key``."""
    wait_for_writes(path)
    try:
        found = column_cache.read_entry(path, lambda index: index["key"] == key, mapped=True)
        return None if found is None else _decode(*found, source)
    except (FileNotFoundError, TraceFormatError):
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        _LOG.debug("%s: run cache entry ignored (%s)", path, exc)
        return None


def _decode(index: dict[str, Any], data: memoryview, source: RunSource) -> model.Run:
    expected = {
        f"{table}.{name}": getattr(empty, name).dtype
        for table, empty in _TABLES.items()
        for name in _columns(empty)
    }
    memory = {f"memory.{name}": np.int64 for name in _columns(_MEMORY)}
    arrays = column_cache.entry_arrays(
        index,
        data,
        {**expected, "plan_codes": np.int32, "meta_plan": np.int32, **_CATALOG, **memory},
    )
    texts = index["texts"]
    if type(texts) is not list or not set(map(type, texts)) <= {str}:
        raise ValueError("bad texts")
    catalog = model.StepCatalog(texts, *(arrays[name] for name in _CATALOG))
    lists = {"threads": index["threads"], "shapes": index["shapes"], "dtypes": index["dtypes"]}
    _check_codes(arrays, len(texts), {k: len(v) for k, v in lists.items()}, source.world_size)
    ranks = _ranks(index["ranks"], arrays, texts, source.world_size)
    return model.Run(
        path=source.path,
        directories=source.directories,
        meta=source.meta,
        plan=_plan(source.meta, catalog, arrays["meta_plan"], index["meta_plan"]),
        world_size=source.world_size,
        ranks=ranks,
        catalog=catalog,
        shapes=[tuple(shape) for shape in lists["shapes"]],
        dtypes=lists["dtypes"],
        threads=lists["threads"],
        t0_ns=int(index["t0_ns"]),
        problems=[*source.problems, *(model.InputProblem(*p) for p in index["problems"])],
        clock_quality=dict(index["clock_quality"]),
        pipelines=Pipelines(tuple(map(tuple, index["pipelines"]))),
    )


def _plan(
    meta: dict[str, Any], catalog: model.StepCatalog, codes: np.ndarray, lengths: Any
) -> model.Later | None:
    """meta.json's plan, made when first read (`model.LazyField`) from its rows' codes (None:
    it did not read when the entry was made, and meta.json is the same)."""
    if lengths is None:
        return None
    if sum(_counts(lengths)) != len(codes):
        raise ValueError("plan rows do not add up")
    if len(codes) and not -1 <= codes.min() <= codes.max() < len(catalog.texts):
        raise ValueError("meta_plan out of range")
    if (catalog.kind[codes[codes >= 0]] < 0).any():
        raise ValueError("a planned step that does not parse")  # the plan read when stored
    return model.Later(partial(_plan_of_codes, meta, catalog, codes, lengths))


def _plan_of_codes(
    meta: dict[str, Any], catalog: model.StepCatalog, codes: np.ndarray, lengths: list[int]
) -> Plan:
    """The plan's rows of Steps, each one the catalog's own (as when meta.json is read)."""
    steps = [*catalog.steps, None]  # a bubble's code, -1, reads the last
    flat = list(map(steps.__getitem__, codes.tolist()))
    ends = np.cumsum(lengths).tolist()
    return model.plan_from_meta(meta, [flat[end - n : end] for n, end in zip(lengths, ends)])


def _check_codes(
    arrays: dict[str, np.ndarray], texts: int, lists: dict[str, int], world_size: int
) -> None:
    """Every code inside the list it indexes (ValueError otherwise)."""
    bounds = {
        "steps.code": (0, texts),
        "p2p.code": (0, texts),
        "plan_codes": (0, texts),
        "steps.thread": (0, lists["threads"]),
        "p2p.shape": (0, lists["shapes"]),
        "p2p.dtype": (0, lists["dtypes"]),
        "p2p.match_rank": (-1, world_size),
    }
    for name, (low, high) in bounds.items():
        column = arrays[name]
        if len(column) and not low <= column.min() <= column.max() < high:
            raise ValueError(f"{name} out of range")
    if {len(arrays[name]) for name in _CATALOG} != {texts}:
        raise ValueError("catalog columns do not match the texts")


def _ranks(
    records: list[dict[str, Any]],
    arrays: dict[str, np.ndarray],
    texts: list[str],
    world_size: int,
) -> list[model.RankTimeline]:
    """Each rank's timeline, its columns slices of the entry's."""
    if type(records) is not list or len(records) != world_size:
        raise ValueError("not one record per rank")
    tables = [
        (table, type(empty), [arrays[f"{table}.{name}"] for name in _columns(empty)])
        for table, empty in _TABLES.items()
    ]
    memory = {name: arrays[f"memory.{name}"] for name in _columns(_MEMORY)}
    starts, memory_at = [0] * 4, dict.fromkeys(memory, 0)
    ranks = []
    for number, record in enumerate(records):
        if type(record) is not dict or tuple(record) != _RANK_KEYS or record["rank"] != number:
            raise ValueError("bad rank record")
        ends = [start + rows for start, rows in zip(starts, _counts(record["rows"], 4))]
        timeline = {
            table: kind(*(column[start:end] for column in columns))
            for (table, kind, columns), start, end in zip(tables, starts, ends)
        }
        timeline["memory"] = _memory(record["memory"], memory, memory_at)
        codes = arrays["plan_codes"][starts[3] : ends[3]]
        ranks.append(_rank(record, timeline, codes, texts))
        starts = ends
    if starts != [len(columns[0]) for _, _, columns in tables] + [len(arrays["plan_codes"])]:
        raise ValueError("row counts do not add up")
    if any(at != len(memory[name]) for name, at in memory_at.items()):
        raise ValueError("memory row counts do not add up")
    match, widest = arrays["p2p.match_index"], max(len(rank.p2p) for rank in ranks)
    if len(match) and not -1 <= match.min() <= match.max() < widest:
        raise ValueError("p2p.match_index out of range")  # a row of the matched rank's ops
    return ranks


def _counts(value: Any, size: int | None = None) -> list[int]:
    """``value`` when it is a list of ints >= 0 (``size`` of them, when given), else
    ValueError."""
    if type(value) is not list or size not in (None, len(value)):
        raise ValueError("bad counts")
    if not all(type(n) is int and n >= 0 for n in value):
        raise ValueError("bad counts")
    return value


def _memory(
    shapes: list[list[int]], columns: dict[str, np.ndarray], at: dict[str, int]
) -> model.MemoryTable:
    """A rank's memory samples, each column given back its shape (``at``: where the rank's
    part of each flat column begins; moved past it)."""
    table = {}
    for (name, column), shape in zip(columns.items(), shapes, strict=True):
        size = math.prod(_counts(shape))
        table[name] = column[at[name] : at[name] + size].reshape(shape)
        at[name] += size
    return model.MemoryTable(**table)


def _rank(
    record: dict[str, Any], tables: dict[str, Any], codes: np.ndarray, texts: list[str]
) -> model.RankTimeline:
    path = record["path"]
    return model.RankTimeline(
        rank=record["rank"],
        present=bool(record["present"]),
        steps=tables["steps"],
        p2p=tables["p2p"],
        iterations=tables["iterations"],
        status=model.RankStatus(*record["status"]),
        clock=model.ClockInfo(**record["clock"]),
        header=record["header"],
        plan=list(map(texts.__getitem__, codes.tolist())),
        plan_codes=codes,
        stages=record["stages"],
        config=record["config"],
        lifecycle=[model.LifecycleEvent(e, t, f) for e, t, f in record["lifecycle"]],
        events=record["events"],
        path=None if path is None else Path(path),
        memory=tables["memory"],
    )
