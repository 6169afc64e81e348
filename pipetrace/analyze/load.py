"""Run directory (or several) -> `Run`: parallel per-rank parsing, validation, clock
alignment, matching.

    from pipetrace.analyze.load import load_run
    run = load_run("runs/demo")                # raises TraceFormatError when unusable
    run = load_run(["runs/node0", "runs/node1"])   # one run, a directory per node (source.py)
    run.ranks[1].steps.begin                    # ns since run.t0_ns, on rank 0's clock

Each rank's log is parsed in a worker process (`parse.parse_rank_file`, streaming) once the
run is big enough to repay the processes; the parent only holds the compact columns, and
assembles each rank as its log arrives (in rank order) while the workers parse the next.
Problems the analysis can work around (a torn last line, corrupt lines, a missing or empty
log, a log from another run, a newer schema on one rank) become `Run.problems`; only an
unusable run (no meta.json, a newer meta schema, no usable log at all) raises.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import compress, count, filterfalse
from pathlib import Path
from typing import Any

import numpy as np

from pipetrace.analyze import cache as column_cache
from pipetrace.analyze import clocks, run_cache
from pipetrace.analyze.host_clocks import align_hosts, host_groups, one_host
from pipetrace.analyze.live import still_recording
from pipetrace.analyze.matching import match_messages
from pipetrace.analyze.model import (
    FROM_ANOTHER_RUN,
    OPEN,
    ClockInfo,
    InputProblem,
    IterationTable,
    LifecycleEvent,
    MemoryTable,
    P2PTable,
    RankState,
    RankStatus,
    RankTimeline,
    Run,
    StepCatalog,
    StepTable,
    plan_from_meta,
    steps_of,
)
from pipetrace.analyze.parse import RawRank, parse_rank_file
from pipetrace.analyze.pipelines import pipelines_of
from pipetrace.analyze.reader import TraceFormatError, read_run_id
from pipetrace.analyze.selection import RankSelection, format_rank_list
from pipetrace.analyze.source import RunPaths, RunSource, open_source
from pipetrace.analyze.workers import start_worker, stop_workers, worker_count
from pipetrace.errors import PipetraceError
from pipetrace.gc_pause import gc_paused
from pipetrace.recorder import format as fmt
from pipetrace.schedule.ir import Plan, Step

Progress = Callable[[int, int], None]
"""Called as ``progress(files_done, files_total)`` while logs are parsed."""

SAME_RUN_WINDOW_NS = 600 * 10**9
"""A log whose clock anchor (header ``t0``) is further than this from meta.json's ``created``
was written by another run (e.g. left over in a reused directory) and is set aside."""
_PARALLEL_MIN_BYTES = 16 << 20


def load_run(
    path: RunPaths | RunSource,
    *,
    progress: Progress | None = None,
    workers: int | None = None,
    cache: bool = True,
    select: RankSelection | None = None,
) -> Run:
    """Load a run: one directory, several (one per node) or a glob (`source.open_source`).

    ``workers``: processes for parsing (None: automatic, 0: parse in this process).
    ``cache``: read and write the columnar cache beside the logs (`analyze.cache`).
    ``select``: load only these ranks; the others stand as `RankState.NOT_LOADED`.
    """
    source = path if isinstance(path, RunSource) else open_source(path)
    problems = list(source.problems)
    wanted = _selected(select, source.meta, source.world_size, problems)
    # Loading makes a million small acyclic objects for a big run (unpickled results, texts,
    # plan Steps): the cyclic collector would walk them again and again for nothing.
    with gc_paused():
        entry = (
            run_cache.RunEntry(source, wanted, select.describe() if select else None)
            if cache
            else None
        )
        run = entry.load() if entry else None
        if run is None:
            logs = [source.logs[r] for r in sorted(wanted)]  # in rank order, as assembled
            with _Parsing(logs, progress, workers, cache) as parsing:
                run, planned = _assemble(source, wanted, problems, select, parsing)
            if entry and not entry.store(run, len(source.problems), [c for _, c in planned]):
                entry = None  # the logs moved: ``run`` is not the model of its key
        run.entry = entry
        live = still_recording(run)  # never cached: it changes with no log written
        run.problems.extend(live)
        run.recording = bool(live)
        return run


def _assemble(
    source: RunSource,
    wanted: frozenset[int] | range,
    problems: list[InputProblem],
    select: RankSelection | None,
    parsing: _Parsing,
) -> tuple[Run, list[PlannedRow]]:
    """The run model, each wanted rank assembled as its parsed log arrives, and the rows of
    meta.json's plan as codes (`_meta_plan`)."""
    assembly = _Assembly(source.meta, source.world_size, problems, len(source.directories))
    parsed = parsing.in_rank_order()
    for rank, log in enumerate(source.logs):
        if rank in wanted:
            assembly.add(rank, next(parsed))
        else:
            assembly.ranks.append(_not_loaded(rank, log, select))
    return assembly.finish(source)


def run_entry(source: RunSource, select: RankSelection | None) -> run_cache.RunEntry:
    """The cache entry of the run (of the ranks ``select`` picks) as its files are now: a
    command keeps its output there (`RunEntry.report`)."""
    wanted = select.resolve(source.meta, source.world_size) if select else range(source.world_size)
    return run_cache.RunEntry(source, wanted, select.describe() if select else None)


def _selected(
    select: RankSelection | None,
    meta: dict[str, Any],
    world_size: int,
    problems: list[InputProblem],
) -> frozenset[int] | range:
    """The ranks to load (all without ``select``); notes the restriction when there is one."""
    if select is None:
        return range(world_size)
    wanted = select.resolve(meta, world_size)
    if len(wanted) < world_size:
        problems.append(
            InputProblem(
                "info",
                f"only rank(s) {format_rank_list(wanted)} of {world_size} loaded "
                f"({select.describe()}): what the others did is unknown",
            )
        )
    return wanted


# -- parsing -------------------------------------------------------------------------------


class _Parsing:
    """The rank logs parsed in worker processes (or in this one for a small run), handed
    over in rank order so that the caller assembles rank r while the workers parse the next
    ones. With ``cache``, the logs whose cache entries are fresh are read from them here,
    first, and only the others go to the workers (which cache what they parse)."""

    def __init__(
        self, paths: list[Path], progress: Progress | None, workers: int | None, cache: bool
    ) -> None:
        self.paths, self.progress = paths, progress
        self.read = column_cache.parse_and_store_all if cache else _parse_each
        self.cached = column_cache.load_all(paths) if cache else {}
        self.stale = [p for p in paths if p not in self.cached]
        if workers is None:
            size = sum(p.stat().st_size for p in self.stale if p.exists())
            workers = len(self.stale) if size >= _PARALLEL_MIN_BYTES else 0
        self.workers = worker_count(workers, len(self.stale))
        self._pool: ProcessPoolExecutor | None = None
        self._futures: dict[Path, tuple[Future[list[RawRank | None]], int]] = {}

    def __enter__(self) -> _Parsing:
        if self.workers > 1:
            # fork is cheapest, but forking a process that runs other threads (a TUI) can deadlock.
            fork = (
                threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods()
            )
            context = multiprocessing.get_context("fork" if fork else "spawn")
            self._pool = ProcessPoolExecutor(
                self.workers,
                mp_context=context,
                initializer=start_worker,
                initargs=(os.getpid(),),
            )
            size = _batch_size(len(self.stale), self.workers)
            for start in range(0, len(self.stale), size):
                batch = self.stale[start : start + size]
                future = self._pool.submit(self.read, batch)
                self._futures.update((path, (future, i)) for i, path in enumerate(batch))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if self._pool is None:
            return
        if exc_type is None:
            self._pool.shutdown(cancel_futures=True)
        else:  # interrupted (Ctrl-C, SIGTERM turned into an exception) or failed
            stop_workers(self._pool)

    def in_rank_order(self) -> Iterator[RawRank]:
        for done, path in enumerate(self.paths, 1):
            if path in self.cached:
                yield self.cached.pop(path)
            else:
                yield self._result(path) if path in self._futures else self.read([path])[0]
            if self.progress:
                self.progress(done, len(self.paths))

    def _result(self, path: Path) -> RawRank:
        future, index = self._futures.pop(path)
        try:
            batch = future.result()
        except BrokenProcessPool:  # every pending log fails with it: which one killed it is unknown
            raise PipetraceError(
                f"a process parsing the logs died (out of memory?) before {path.name} "
                "was read; try again with --workers 0 to parse in one process"
            ) from None
        raw, batch[index] = batch[index], None  # the batch must not keep it alive
        assert raw is not None
        return raw


def _batch_size(logs: int, workers: int) -> int:
    """Logs per task: a few per task cost the pool's hand-over (a worker that finished waits
    for the loading process's queue thread to send it more, and that thread waits for the
    interpreter lock) once per few logs instead of once per log, while still ~8 tasks per
    worker balance the load. 16 at most: a task's results wait in memory until assembled."""
    return max(1, min(16, logs // (8 * workers)))


def _parse_each(paths: list[Path]) -> list[RawRank]:
    """Several logs parsed, without the cache (a pool task: `_Parsing`)."""
    return [parse_rank_file(path) for path in paths]


def _check_raw(
    raw: RawRank,
    rank: int,
    meta: dict[str, Any],
    world_size: int,
    problems: list[InputProblem],
    directory_run_id: str | None = None,
) -> bool:
    """Is this log usable as rank ``rank`` of this run? Notes every problem.
    ``directory_run_id``: the run id of the directory the log lies in (its ``run-id``)."""
    name = Path(raw.path).name
    if raw.error is not None:
        problems.append(InputProblem("warning", _short(raw.error, raw.path), rank))
        return False
    reasons = _from_another_run(raw, rank, meta, world_size, directory_run_id)
    if reasons:
        raw.error = f"{FROM_ANOTHER_RUN}: {'; '.join(reasons)}"  # the rank's status says why
        problems.append(
            InputProblem(
                "warning",
                f"{name} is from another run ({'; '.join(reasons)}); treated as missing",
                rank,
            )
        )
        return False
    if not raw.events:  # a rank that recorded nothing is told as a missing one
        raw.error = f"{name}: no events after its header (nothing recorded)"
        problems.append(InputProblem("warning", raw.error, rank))
        return False
    problems += [InputProblem(severity, f"{name}: {text}", rank) for severity, text in _notes(raw)]
    config = (raw.run_start or {}).get("config")
    if config is not None and isinstance(meta.get("config"), dict) and config != meta["config"]:
        problems.append(  # one run by its id, so the rank was started with other settings
            InputProblem(
                "warning",
                f"{name}: its run configuration differs from meta.json's (rank 0's): this rank "
                "was started with other settings",
                rank,
                damage=False,
            )
        )
    return True


def _from_another_run(
    raw: RawRank, rank: int, meta: dict[str, Any], world_size: int, directory_run_id: str | None
) -> list[str]:
    """Why the log belongs to another run than meta.json's (empty: it is this run's). Every
    process recording into a directory claims it with one run id, so a header's other id
    (older logs have none) was written elsewhere: e.g. copied in from an earlier run."""
    header = raw.header
    reasons = []
    run_id = header.get("run_id")
    if isinstance(run_id, str) and directory_run_id is not None and run_id != directory_run_id:
        reasons.append(f"its run id {run_id!r} is not its directory's ({directory_run_id!r})")
    for name in ("rank", "world_size"):
        if name not in header:
            reasons.append(f"its header has no {name}, a required field")
    if "rank" in header and header["rank"] != rank:
        reasons.append(f"its header says rank {header['rank']!r}")
    if "world_size" in header and header["world_size"] != world_size:
        reasons.append(f"world size {header['world_size']!r}, not {world_size}")
    if isinstance(run_id, str) and run_id == directory_run_id:
        return reasons  # this run's by its id: a late start or other settings are its own
    t0, created = header.get("t0"), meta.get("created")
    if isinstance(t0, int) and isinstance(created, int):
        t0 -= _recorded_offset(raw)  # on rank 0's clock, as meta.json's creation is
        if abs(t0 - created) > SAME_RUN_WINDOW_NS:
            away = abs(t0 - created) / 1e9
            reasons.append(f"it started {away:.0f} s away from meta.json's creation")
    config = (raw.run_start or {}).get("config")
    if config is not None and isinstance(meta.get("config"), dict) and config != meta["config"]:
        reasons.append("its run configuration differs from meta.json's")
    return reasons


def _recorded_offset(raw: RawRank) -> int:
    """The rank's clock minus rank 0's, as its first `clock` event measured it (0: none)."""
    for e, _, fields in raw.lifecycle:
        if e == fmt.CLOCK and fmt.is_int64(fields.get("offset_ns")):
            return fields["offset_ns"]
    return 0


def _notes(raw: RawRank) -> list[tuple[str, str]]:
    """(severity, text) of what the parse found wrong or missing in a usable log."""
    p = raw.problems
    notes = []
    if p.torn_last_line:
        notes.append(("info", "torn last line skipped (the process was killed while writing)"))
    if p.corrupt_lines:
        where = f", first at line {p.first_corrupt_line}" if p.first_corrupt_line else ""
        notes.append(("warning", f"{p.corrupt_lines} corrupt line(s) skipped{where}"))
    notes += [("warning", note) for note in [*p.damage(), *p.notes]]
    if raw.unknown_events:
        notes.append(
            (
                "info",
                f"{raw.unknown_events} event(s) of unknown type ignored "
                "(written by a newer pipetrace?)",
            )
        )
    if raw.run_start is None:
        notes.append(("warning", "no run_start event; the rank's plan is taken from meta.json"))
    device = raw.header.get("device")
    timing = device.get("timing") if isinstance(device, dict) else None
    if device is not None and not (fmt.is_int64(timing) and timing >= 1):
        notes.append(("warning", f"header field device is not as documented: {device!r}"))
    elif device is not None and timing > fmt.DEVICE_TIMING_VERSION:
        notes.append(
            (
                "warning",
                f"device timing version {timing}, newer than this pipetrace reads "
                f"({fmt.DEVICE_TIMING_VERSION}): its device fields are read as version "
                f"{fmt.DEVICE_TIMING_VERSION}'s; upgrade pipetrace",
            )
        )
    return notes


def _short(message: str, path: str) -> str:
    return message.replace(str(Path(path).parent) + os.sep, "")


PlannedRow = tuple[list[str], np.ndarray]
"""A row of meta.json's plan without its bubbles: its step texts and their codes."""


def _meta_plan(
    meta: dict[str, Any],
    catalog: StepCatalog,
    problems: list[InputProblem],
    known: dict[int, np.ndarray],
) -> tuple[Plan | None, list[PlannedRow]]:
    """meta.json's plan, its steps taken from the catalog (each distinct text parsed once, by
    the workers), and its rows' texts and codes: a rank's own plan is usually its row, whose
    codes are then not looked up again (a big plan has a few hundred thousand steps).
    ``known``: the codes of the rows a rank ran (`_Assembly._rows_ran`), not looked up."""
    try:
        code_of, parsed = catalog.text_codes.__getitem__, catalog.steps
        rows, planned = [], []
        for number, row in enumerate(meta["plan"]):
            texts = [text for text in row if text]
            codes = known.get(number)
            if codes is None:
                codes = np.fromiter(map(code_of, texts), np.int32, len(texts))
            bad = np.flatnonzero(catalog.kind[codes] < 0)  # the texts that do not parse
            if len(bad):
                raise ValueError(f"bad action {texts[bad[0]]!r}")
            next_step = map(parsed.__getitem__, codes.tolist()).__next__
            rows.append([next_step() if text else None for text in row])
            planned.append((texts, codes))
        return plan_from_meta(meta, rows), planned
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        problems.append(
            InputProblem(
                "warning",
                f"meta.json: the plan cannot be read ({exc}); "
                "plan checks and the ideal timeline are skipped",
            )
        )
        return None, []


# -- assembly ------------------------------------------------------------------------------


class _Interned:
    """Values of several ranks' lists interned into one code space, in first-seen order (so
    codes are deterministic and ``values`` is the merged list)."""

    def __init__(self, first: Iterable = ()) -> None:
        self.codes: dict[Any, int] = {}
        for value in first:
            self.add(value)

    def add(self, value: Any) -> int:
        return self.codes.setdefault(value, len(self.codes))

    def remap(self, values: list) -> np.ndarray:
        """The codes of a rank's values (its list index -> the merged code). No Python-level
        loop: a big run has a few hundred thousand distinct step texts."""
        self.extend(values)
        return np.fromiter(map(self.codes.__getitem__, values), np.int32, len(values))

    def extend(self, values: Iterable) -> None:
        """Intern values, giving codes only to the ones not yet known, in their order (a
        C-level filter and update; the filter sees each value the update has just added,
        so a repeated value gets one code)."""
        codes = self.codes
        codes.update(zip(filterfalse(codes.__contains__, values), count(len(codes))))

    @property
    def values(self) -> list:
        return list(self.codes)


class _Assembly:
    """The run model built one rank at a time, as parsed logs arrive in rank order, then
    finished once all are in: the step catalog, plan codes, message matching, clocks."""

    def __init__(
        self,
        meta: dict[str, Any],
        world_size: int,
        problems: list[InputProblem],
        directories: int = 1,
    ) -> None:
        self.meta, self.world_size, self.problems = meta, world_size, problems
        self.directories = directories  # how many the run was gathered from
        self.texts, self.shapes, self.dtypes = _Interned(), _Interned(), _Interned()
        self.threads = _Interned(["main"])
        self.text_parts: list[
            tuple[np.ndarray, ...]
        ] = []  # (kind, stage, mb) of each new text, in code order
        self.steps: list[Step | None] = []  # the Step of each text, in code order
        self.plan_codes: dict[int, np.ndarray] = {}  # of each rank's plan, -1: no event's text
        self.ranks: list[RankTimeline] = []
        self.models: dict[int, dict[str, clocks.OffsetFn]] = {}
        self.run_ids: dict[Path, str | None] = {}  # of each directory a log was read from

    def add(self, rank: int, raw: RawRank) -> None:
        directory = Path(raw.path).parent
        if directory not in self.run_ids:
            self.run_ids[directory] = read_run_id(directory)
        run_id = self.run_ids[directory]
        if self.directories > 1 and _absent_log(raw):  # `source` named every such rank at once
            self.ranks.append(_missing(rank, raw, self.directories))
            return
        if not _check_raw(raw, rank, self.meta, self.world_size, self.problems, run_id):
            self.ranks.append(_missing(rank, raw, self.directories))
            return
        known = len(self.texts.codes)
        remap = self.texts.remap(raw.texts)
        new = remap >= known  # the rank's texts no earlier rank had: the next codes, in its order
        parts = tuple(part[new] for part in raw.text_parts)  # parsed by the worker
        self.text_parts.append(parts)
        self.steps += steps_of(list(compress(raw.texts, new.tolist())), *parts)
        index = raw.plan_index
        self.plan_codes[rank] = np.where(index >= 0, remap[index] if len(remap) else index, -1)
        timeline, self.models[rank] = _timeline(
            rank,
            raw,
            remap,
            self.shapes.remap(raw.shapes),
            self.dtypes.remap(raw.dtypes),
            self.threads.remap(raw.threads),
        )
        self.ranks.append(timeline)

    def finish(self, source: RunSource) -> tuple[Run, list[PlannedRow]]:
        if not any(r.present for r in self.ranks):
            raise TraceFormatError(
                f"{source.path}: no usable event log ("
                + "; ".join(p.message for p in self.problems if p.rank is not None)[:400]
                + ")"
            )
        pipelines, problem = pipelines_of(
            self.meta, (r.header for r in self.ranks if r.present), self.world_size
        )
        if problem is not None:
            self.problems.append(InputProblem("warning", problem))
        row_of = pipelines.pipeline_rank  # every replica runs the plan's rows
        ran, known = self._rows_ran(row_of)
        catalog = self._catalog(ran, known)
        plan, planned = _meta_plan(self.meta, catalog, self.problems, known)
        for rank in self.ranks:
            if rank.present:
                index = row_of(rank.rank)
                rank.plan_codes = (
                    planned[index][1]
                    if rank.rank in ran and index < len(planned)
                    else catalog.codes(rank.plan)
                )
        match_messages(self.ranks)
        present = [r for r in self.ranks if r.present]
        if len(host_groups(present)) > 1:  # one clock per host: align hosts
            offsets, quality = align_hosts(present, self.models)
        else:
            offsets, quality = clocks.align(present, self.world_size, self.models)
            quality["hosts"] = one_host(present)
        t0 = _shift_times(self.ranks, offsets)
        for rank in self.ranks:
            if rank.present:
                rank.status = _status(rank, catalog)
        _note_clock_problems(self.ranks, quality, self.problems)
        _note_cut_logs(self.ranks, self.problems)
        return Run(
            path=source.path,
            directories=source.directories,
            meta=self.meta,
            plan=plan,
            world_size=self.world_size,
            ranks=self.ranks,
            catalog=catalog,
            shapes=self.shapes.values,
            dtypes=self.dtypes.values,
            threads=self.threads.values,
            t0_ns=t0,
            problems=self.problems,
            clock_quality=quality,
            pipelines=pipelines,
        ), planned

    def _rows_ran(self, row_of: Callable[[int], int]) -> tuple[set[int], dict[int, np.ndarray]]:
        """The ranks whose plan is their row of meta.json's plan (usually all), and the codes
        of each row such a rank ran whose texts its events all used: those come from the
        rank's codes (`RawRank.plan_index`), where looking a few hundred thousand planned
        texts up in the catalog, each a cache miss, was a tenth of the work after parsing."""
        rows = self.meta.get("plan")
        rows = rows if isinstance(rows, list) else []
        ran, known = set(), {}
        for rank in self.ranks:
            index = row_of(rank.rank)
            if not rank.present or index >= len(rows) or not isinstance(rows[index], list):
                continue
            if rank.plan == [t for t in rows[index] if t]:
                ran.add(rank.rank)
                codes = self.plan_codes[rank.rank]
                if index not in known and (codes >= 0).all():
                    known[index] = codes
        return ran, known

    def _catalog(self, ran: set[int], known: dict[int, np.ndarray]) -> StepCatalog:
        """Every step text of the run: the ranks' texts, then the plans' (a planned step that
        no rank ran still gets a code). ``ran``, ``known``: `_rows_ran` (the texts of those
        rows and plans have their codes already)."""
        rows = self.meta.get("plan")
        rows = rows if isinstance(rows, list) else []
        extra = []
        for rank in self.ranks:
            if rank.present and rank.rank not in ran:
                extra.extend(rank.plan)
        extra += [
            t
            for number, row in enumerate(rows)
            if number not in known and isinstance(row, list)
            for t in row
            if isinstance(t, str) and t
        ]
        self.texts.extend(extra)
        texts = self.texts.values
        # the ranks' texts come parsed by the workers; the plans' extra ones are parsed by
        # build (-2)
        kind = np.full(len(texts), -2, np.int32)
        stage, mb = np.full(len(texts), -1, np.int32), np.full(len(texts), -1, np.int32)
        for column, parts in zip((kind, stage, mb), zip(*self.text_parts)):
            done = np.concatenate(parts)
            column[: len(done)] = done
        return StepCatalog.build(texts, (kind, stage, mb), self.texts.codes, self.steps)


def _ran_plan(raw: RawRank) -> list[str]:
    """The plan the rank ran (run_start's, bubbles removed), empty without a run_start."""
    return [] if raw.run_start is None else list(map(str, raw.run_start.get("plan") or ()))


def _timeline(
    rank: int,
    raw: RawRank,
    remap: np.ndarray,
    shape_map: np.ndarray,
    dtype_map: np.ndarray,
    thread_map: np.ndarray,
) -> tuple[RankTimeline, dict[str, clocks.OffsetFn]]:
    """The rank's timeline, times still on its own clock and its plan not yet coded (both
    need every rank)."""
    lifecycle = [LifecycleEvent(e, t, f) for e, t, f in raw.lifecycle]
    info, models = clocks.offset_models(clocks.clock_events(lifecycle))
    start = raw.run_start or {}
    stages = start.get("stages")
    return RankTimeline(
        rank=rank,
        present=True,
        steps=_step_table(raw.steps, remap, thread_map),
        p2p=_p2p_table(raw.p2p, remap, shape_map, dtype_map),
        iterations=_iteration_table(raw.iterations),
        status=RankStatus(RankState.ENDED, ""),
        clock=info,
        header=raw.header,
        plan=_ran_plan(raw),
        stages=[int(x) for x in stages]
        if isinstance(stages, list) and all(isinstance(x, int) for x in stages)
        else [],
        config=start.get("config") if isinstance(start.get("config"), dict) else None,
        lifecycle=lifecycle,
        events=raw.events,
        path=Path(raw.path),
        memory=MemoryTable(**raw.memory) if raw.memory else MemoryTable.empty(),
    ), models


def _mapped(table: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """The rank's own codes as the run's (``table``: the run's code of each; empty: the
    same)."""
    return table[codes] if len(table) else codes


def _step_table(s: dict[str, np.ndarray], remap: np.ndarray, thread_map: np.ndarray) -> StepTable:
    thread = thread_map[s["thread"]].astype(np.int8) if len(thread_map) else s["thread"]
    return StepTable(
        s["begin"],
        s["end"],
        s["it"],
        s["pos"],
        _mapped(remap, s["code"]),
        thread,
        s["dbegin"],
        s["dend"],
    )


def _p2p_table(
    p: dict[str, np.ndarray], remap: np.ndarray, shape_map: np.ndarray, dtype_map: np.ndarray
) -> P2PTable:
    empty = np.empty(0, np.int32)
    return P2PTable(
        p["post"],
        p["done"],
        p["it"],
        p["op"],
        p["peer"],
        p["ch"],
        p["seq"],
        p["nbytes"],
        _mapped(shape_map, p["shape"]),
        _mapped(dtype_map, p["dtype"]),
        _mapped(remap, p["code"]),
        empty,
        empty.astype(np.int64),
        p["dbegin"],
        p["dend"],
    )


def _iteration_table(iterations: dict[int, list]) -> IterationTable:
    its = sorted(iterations)
    rows = [iterations[i] for i in its]
    return IterationTable(
        np.array(its, np.int32),
        np.array([r[0] for r in rows], np.int64),
        np.array([r[1] for r in rows], np.int64),
        np.array([np.nan if r[2] is None else r[2] for r in rows], np.float64),
    )


def _absent_log(raw: RawRank) -> bool:
    return (raw.error or "").endswith(": missing event log") and not os.path.lexists(raw.path)


def _missing(rank: int, raw: RawRank, directories: int = 1) -> RankTimeline:
    why = raw.error or "no usable log"
    path = Path(raw.path)
    if directories > 1 and not path.exists() and why.endswith(": missing event log"):
        why = f"{path.name}: in none of the {directories} directories"  # not meta.json's alone
    return _absent(rank, path, RankStatus(RankState.MISSING, why))


def _not_loaded(rank: int, path: Path, select: RankSelection | None) -> RankTimeline:
    why = f"left out by {select.describe()}" if select else "not loaded"
    return _absent(rank, path, RankStatus(RankState.NOT_LOADED, why))


def _absent(rank: int, path: Path, status: RankStatus) -> RankTimeline:
    """A rank without a timeline: no usable log, or not loaded."""
    return RankTimeline(
        rank=rank,
        present=False,
        steps=StepTable.empty(),
        p2p=P2PTable.empty(),
        iterations=IterationTable.empty(),
        status=status,
        clock=ClockInfo(None, None, None, 0),
        path=path,
    )


def _shift_times(ranks: list[RankTimeline], offsets: dict[int, clocks.OffsetFn]) -> int:
    """Put every time on rank 0's clock (chosen offset, then correction) and make it
    relative to the earliest event; returns that event's time (t0, epoch ns). A rank whose
    offset is a constant (`clocks.ConstantOffset`, most ranks) has each column moved once,
    by that shift less t0, instead of shifted and then moved again: at 10 M events the two
    passes over every time column were a fifth of finishing the model."""
    present = [r for r in ranks if r.present]
    pending: dict[int, int] = {}  # rank -> its constant shift, applied with t0
    for rank in present:
        fn = offsets[rank.rank]
        correction = rank.clock.correction_ns
        if isinstance(fn, clocks.ConstantOffset) and _moves_cleanly(rank, correction - fn.value):
            pending[rank.rank] = correction - fn.value
        else:
            for arr in rank.time_columns():
                ended = arr != OPEN
                if ended.all():
                    arr += correction - fn(arr)
                else:
                    arr[ended] += correction - fn(arr[ended])
        if rank.lifecycle:
            times = np.array([ev.t for ev in rank.lifecycle], np.int64)
            for ev, t in zip(rank.lifecycle, (times - fn(times) + correction).tolist()):
                ev.t = t
    firsts = []
    for rank in present:
        shift = pending.get(rank.rank, 0)
        for arr in (rank.steps.begin, rank.p2p.post, rank.iterations.begin):
            valid = arr[arr != OPEN]
            if len(valid):
                firsts.append(int(valid.min()) + shift)
        firsts.extend(ev.t for ev in rank.lifecycle)
    t0 = min(firsts) if firsts else 0
    for rank in present:
        move = pending.get(rank.rank, 0) - t0
        for arr in rank.time_columns():
            ended = arr != OPEN
            if ended.all():
                arr += move
            else:
                np.add(arr, move, out=arr, where=ended)
        for ev in rank.lifecycle:
            ev.t -= t0
    return t0


def _moves_cleanly(rank: RankTimeline, shift: int) -> bool:
    """Does adding ``shift`` to the rank's recorded times leave each at 0 or later (so none
    becomes OPEN, which shifting then moving by t0 would have left out of the move)? Times
    since the epoch always do; this is checked, whatever the input, except where it cannot
    fail: no shift, or a forward one of times that are all 0 or later."""
    if shift == 0:
        return True
    for column in rank.time_columns():
        if not len(column):
            continue
        low = int(column.min())
        if low >= OPEN and shift > 0:
            continue
        if low == OPEN:
            low = int(column.min(where=column != OPEN, initial=np.iinfo(np.int64).max))
        if low + shift < 0:
            return False
    return True


def _status(rank: RankTimeline, catalog: StepCatalog) -> RankStatus:
    steps = rank.steps
    last_step = catalog.texts[int(steps.code[-1])] if len(steps) else None
    last_it = int(rank.iterations.it[-1]) if len(rank.iterations) else None
    exc = rank.last_of(fmt.EXCEPTION)
    if exc is not None:
        # one line: torch's pipelining wraps a stage's error in an indented multi-line text
        message = " ".join(str(exc.fields.get("message", "")).split())
        error = f"{exc.fields.get('type', 'Exception')}: {message}"
        return RankStatus(RankState.FAILED, f"raised {error}", last_step, last_it, error)
    sig = rank.last_of(fmt.SIGNAL)
    if sig is not None:
        name = str(sig.fields.get("signal", "a signal"))
        return RankStatus(RankState.SIGNALED, f"ended by {name}", last_step, last_it, name)
    abort = rank.last_of(fmt.ABORT)
    if abort is not None:
        message = str(abort.fields.get("message", "watchdog abort"))
        return RankStatus(
            RankState.ABORTED, "ended by its watchdog after a stall", last_step, last_it, message
        )
    if rank.last_of(fmt.RUN_END) is not None:
        return RankStatus(RankState.FINISHED, "finished cleanly", last_step, last_it)
    if any(ev.fields.get("phase") == "end" for ev in rank.events_of(fmt.CLOCK)):
        # only a rank that ends cleanly records the end-of-run clock exchange: its run_end was
        # lost after it (a torn last line, a kill during the last write)
        return RankStatus(
            RankState.FINISHED,
            "finished (its end-of-run clock exchange completed; run_end lost)",
            last_step,
            last_it,
        )
    if rank.final_stall() is not None:  # one it recovered from says nothing of its end
        return RankStatus(
            RankState.STALLED, "stalled (watchdog) and the log ends there", last_step, last_it
        )
    return RankStatus(
        RankState.ENDED,
        "the log ends without run_end (killed, or still running)",
        last_step,
        last_it,
    )


def _note_clock_problems(
    ranks: list[RankTimeline], quality: dict[str, Any], problems: list[InputProblem]
) -> None:
    if not quality.get("feasible", True):
        problems.append(
            InputProblem(
                "warning",
                "clocks: no per-rank correction makes every message "
                "arrive after it was sent; recorded offsets kept",
            )
        )
    elif quality.get("model") not in (None, "recorded"):
        why = (
            "the recorded offsets are inconsistent with the messages"
            if quality.get("offsets_recorded", True)
            else "no rank recorded a clock offset"
        )
        problems.append(InputProblem("info", f"clocks: {why}; aligned with {quality['model']}"))
    if quality.get("refined") and len(quality["hosts"]) > 1:
        _note_moved_hosts(ranks, quality["hosts"], problems)
    elif quality.get("refined"):
        for rank in ranks:
            u = rank.clock.uncertainty_ns
            if u is not None and abs(rank.clock.correction_ns) > 2 * u + 100_000:
                problems.append(
                    InputProblem(
                        "info",
                        f"clocks: rank {rank.rank} moved {rank.clock.correction_ns / 1e3:+.0f} us, "
                        f"beyond its recorded uncertainty (+-{u / 1e3:.0f} us)",
                        rank.rank,
                    )
                )


def _note_moved_hosts(
    ranks: list[RankTimeline], hosts: list[dict[str, Any]], problems: list[InputProblem]
) -> None:
    """A host whose correction goes beyond its recorded uncertainty: its exchange was off."""
    by_rank = {r.rank: r for r in ranks}
    for host in hosts:
        u = by_rank[host["ranks"][0]].clock.uncertainty_ns
        moved = host["correction_ns"]
        if u is not None and abs(moved) > 2 * u + 100_000:
            left = host["uncertainty_ns"]
            problems.append(
                InputProblem(
                    "info",
                    f"clocks: host {host['host']} ({len(host['ranks'])} ranks) moved "
                    f"{moved / 1e3:+.0f} us, beyond its recorded uncertainty (+-{u / 1e3:.0f} "
                    "us); "
                    + ("now +-?" if left is None else f"now +-{left / 1e3:.0f} us")
                    + " from the messages' order",
                )
            )


def _note_cut_logs(ranks: list[RankTimeline], problems: list[InputProblem]) -> None:
    """A log that just stops (no run_end, no failure recorded) while its peers record on was
    cut: the rank was killed, or the file truncated."""
    present = [r for r in ranks if r.present]
    last = [r.last_time() for r in present]
    latest = max(last, default=0)
    for rank, t in zip(present, last):
        if rank.status.state == RankState.ENDED and t < latest:
            problems.append(
                InputProblem(
                    "warning",
                    f"{rank.path.name} ends at {t / 1e9:.3f} s without run_end or a recorded "
                    f"failure while its peers record until {latest / 1e9:.3f} s (killed, cut, "
                    "or still running: hung)",
                    rank.rank,
                )
            )
