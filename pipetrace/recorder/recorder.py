"""The recorder: turns runtime hooks into a per-rank event log (see docs/trace-format.md).

The hot path (`begin_step`, `end_step`, `p2p_posted`, `p2p_completed`) takes one monotonic
clock reading (from the injected `Clock`, bound once) and appends a tuple; encoding to JSON
happens on the writer's flush thread.
Each hook also notes progress for the watchdog and keeps the set of open steps and in-flight
P2P ops, which is what a stall dump reports.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from pipetrace import __version__
from pipetrace.recorder import format as fmt
from pipetrace.recorder.clock import SYSTEM_CLOCK, Clock, RecvInts, SendInts, align_clocks
from pipetrace.recorder.writer import EventWriter
from pipetrace.schedule.ir import Plan, Step, format_step

RECORD_MODES = ("off", "steps", "full")

# Tuple tags on the hot path; `_encode` turns each into its documented JSON event.
_STEP_BEGIN, _STEP_END, _P2P_POST, _P2P_DONE, _OTHER = range(5)


class ProfilerRanges(Protocol):
    """A framework's profiler range API (see `pipetrace.recorder.profiler`)."""

    def active(self) -> bool: ...

    def begin(self, name: str) -> Any: ...

    def end(self, handle: Any) -> None: ...


@dataclass
class RecorderConfig:
    run_dir: Path
    """Where meta.json and the per-rank logs go; created if missing."""
    mode: str = "steps"
    """"steps": steps, P2P ops and lifecycle; "full": also the Python stack of each P2P post."""
    flush_interval: float = 0.2
    """Seconds between background flushes: the most a killed process can lose."""
    capacity: int = 200_000
    """Pending events before the recording thread flushes them itself (bounds memory)."""
    stall_timeout: float = 30.0
    """Seconds without progress inside an iteration before a stall event (0 = no watchdog)."""
    abort_timeout: float = 30.0
    """Further seconds after a stall before the watchdog ends the process (0 = never)."""

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        if self.mode not in RECORD_MODES[1:]:
            raise ValueError(f"record mode must be 'steps' or 'full', got {self.mode!r}")


class Recorder:
    """Implements `pipetrace.recorder.hooks.RecorderHooks` for one rank."""

    def __init__(
        self,
        config: RecorderConfig,
        *,
        framework: str = "torch",
        framework_version: str = "",
        profiler: ProfilerRanges | None = None,
        clock_exchange: tuple[SendInts, RecvInts] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.config = config
        self.clock = clock
        # Bound once: the hot path calls it without an attribute lookup on the Clock.
        self._monotonic_ns = clock.monotonic_ns
        self._stacks = config.mode == "full"  # read on every P2P post: decide once
        self.framework = framework
        self.framework_version = framework_version
        self.rank = -1
        self._profiler = profiler
        self._clock_exchange = clock_exchange
        self.world_size = 1
        self._writer: EventWriter | None = None
        self._ids = itertools.count()
        self._iteration = -1
        self._in_iteration = False
        self.waiting_in: str | None = None
        """A collective wait outside iterations that the watchdog must watch."""
        self._epoch_anchor = clock.wall_ns()
        self._perf_anchor = clock.monotonic_ns()
        self.last_progress = self._perf_anchor
        self.open_steps: dict[int, tuple[str, int, Step, int]] = {}  # id -> (thread, pos, step, it)
        self.inflight: dict[int, tuple] = {}  # id -> the p2p_post record
        self._texts: dict[int, bytes] = {}
        self._literals = _JsonLiterals()
        self._watchdog = None

    # -- lifecycle -------------------------------------------------------------------------

    def begin_run(self, *, rank: int, world_size: int, plan: Plan, config: dict[str, Any]) -> None:
        self.rank = rank
        self.world_size = world_size
        run_dir = self.config.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        header = fmt.HEADER.build(
            format=fmt.LOG_FORMAT,
            schema_version=fmt.SCHEMA_VERSION,
            rank=rank,
            world_size=world_size,
            pid=os.getpid(),
            host=socket.gethostname(),
            pipetrace_version=__version__,
            framework=self.framework,
            framework_version=self.framework_version,
            record_mode=self.config.mode,
            t0=self._epoch_anchor,
        )
        self._writer = EventWriter(
            fmt.rank_log_path(run_dir, rank),
            header,
            self._encode,
            flush_interval=self.config.flush_interval,
            capacity=self.config.capacity,
        )
        if rank == 0:
            write_meta(
                run_dir,
                plan=plan,
                world_size=world_size,
                config=config,
                framework=self.framework,
                framework_version=self.framework_version,
                created_ns=self.now_ns(),
            )
        steps = [format_step(s) for s in plan.steps(rank)]
        self._other(fmt.RUN_START, config=config, plan=steps, stages=plan.stages_of(rank))
        self._align_clock("start")
        if self.config.stall_timeout > 0:
            from pipetrace.recorder.watchdog import Watchdog

            self._watchdog = Watchdog(self)
            self._watchdog.start()

    def end_run(self) -> None:
        # A peer that never gets here (hung between iterations, or killed) leaves this rank
        # waiting in the exchange: the watchdog watches that wait like an iteration.
        self.waiting_in = "the end-of-run clock exchange"
        self.last_progress = self._monotonic_ns()
        self._align_clock("end")
        self.waiting_in = None
        self._other(fmt.RUN_END)
        self.close()

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def _align_clock(self, phase: str) -> None:
        """Collective over the process group: all ranks call it at start and at a clean end."""
        if self._clock_exchange is None or self.world_size < 2:
            return
        send_ints, recv_ints = self._clock_exchange
        offset = align_clocks(
            rank=self.rank,
            world_size=self.world_size,
            now_ns=self.now_ns,
            send_ints=send_ints,
            recv_ints=recv_ints,
        )
        self.record_event(
            fmt.CLOCK,
            phase=phase,
            offset_ns=offset.offset_ns,
            uncertainty_ns=offset.uncertainty_ns,
            reference_rank=0,
        )

    # -- iterations ------------------------------------------------------------------------

    def begin_iteration(self, iteration: int) -> None:
        self._iteration = iteration
        self._other(fmt.ITER_BEGIN, it=iteration)
        self._in_iteration = True

    def end_iteration(self, iteration: int, loss: float | None) -> None:
        self._in_iteration = False
        self._other(fmt.ITER_END, it=iteration, loss=loss)
        if self._writer is not None:
            self._writer.request_flush()

    @property
    def watched(self) -> bool:
        """Whether a lack of progress now is a stall: in an iteration or a collective wait
        (between iterations, user code may legitimately take long)."""
        return self._in_iteration or self.waiting_in is not None

    # -- the hot path ----------------------------------------------------------------------

    def begin_step(self, position: int, step: Step, thread: str = "main") -> Any:
        t = self._monotonic_ns()
        self.last_progress = t
        sid = next(self._ids)
        self.open_steps[sid] = (thread, position, step, self._iteration)
        self._writer.append((_STEP_BEGIN, t, sid, self._iteration, position, step, thread))
        profiler = self._profiler
        if profiler is not None and profiler.active():
            return (sid, profiler.begin("pipetrace/" + format_step(step)))
        return sid

    def end_step(self, token: Any) -> None:
        t = self._monotonic_ns()
        self.last_progress = t
        if type(token) is tuple:
            token, handle = token
            self._profiler.end(handle)
        self.open_steps.pop(token, None)
        self._writer.append((_STEP_END, t, token))

    def p2p_posted(
        self,
        *,
        op: str,
        step: Step,
        peer: int,
        channel: str,
        seq: int,
        nbytes: int,
        shape: tuple[int, ...],
        dtype: str,
    ) -> Any:
        t = self._monotonic_ns()
        self.last_progress = t
        pid = next(self._ids)
        stack = _short_stack() if self._stacks else None
        record = (
            _P2P_POST,
            t,
            pid,
            self._iteration,
            op,
            step,
            peer,
            channel,
            seq,
            nbytes,
            shape,
            dtype,
            stack,
        )
        self.inflight[pid] = record
        self._writer.append(record)
        return pid

    def p2p_completed(self, token: Any) -> None:
        t = self._monotonic_ns()
        self.last_progress = t
        self.inflight.pop(token, None)
        self._writer.append((_P2P_DONE, t, token))

    # -- failures --------------------------------------------------------------------------

    def exception(self, exc: BaseException) -> None:
        if self._writer is None:
            return
        self._other(
            fmt.EXCEPTION,
            type=type(exc).__name__,
            message=str(exc),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            open_steps=self.describe_open_steps(),
        )
        self.flush()

    def record_event(self, event: str, **fields: Any) -> None:
        """Record a lifecycle event (watchdog, signals, clock) and flush it at once."""
        if self._writer is None:
            return
        self._other(event, progress=False, **fields)
        self.flush()

    def describe_open_steps(self) -> list[dict[str, Any]]:
        return [
            {"id": sid, "thread": thread, "pos": pos, "step": format_step(step), "it": it}
            for sid, (thread, pos, step, it) in list(self.open_steps.items())
        ]

    def describe_inflight(self) -> list[dict[str, Any]]:
        return [orjson.loads(self._encode(record)) for record in list(self.inflight.values())]

    def now_ns(self) -> int:
        """Wall-clock nanoseconds on this rank's event clock."""
        return self._epoch_anchor + (self._monotonic_ns() - self._perf_anchor)

    # -- encoding (flush thread) -----------------------------------------------------------

    def _other(self, event: str, *, progress: bool = True, **fields: Any) -> None:
        t = self._monotonic_ns()
        if progress:  # the watchdog's own events must not count as progress
            self.last_progress = t
        if self._writer is not None:
            self._writer.append((_OTHER, t, event, fields))

    def _text(self, step: Step) -> bytes:
        """The step's text as a JSON string literal, computed once per step."""
        key = id(step)
        text = self._texts.get(key)
        if text is None:
            # Plans keep their Step objects alive for the whole run, so ids stay unique.
            text = self._texts[key] = orjson.dumps(format_step(step))
        return text

    def _encode(self, record: tuple) -> bytes:
        """One event line. The hot event types are formatted from the byte templates that
        `fmt.line_template` derives from their declarations (about 3x cheaper than building a
        dict for orjson, measured in bench/bench_recorder.py); their strings go in as cached
        JSON literals, so the output is the JSON orjson would write."""
        tag = record[0]
        t = self._epoch_anchor + (record[1] - self._perf_anchor)
        if tag == _STEP_BEGIN:
            _, _, sid, it, pos, step, thread = record
            return _STEP_BEGIN_LINE % (t, sid, it, pos, self._text(step), self._literals[thread])
        if tag == _STEP_END:
            return _STEP_END_LINE % (t, record[2])
        if tag == _P2P_DONE:
            return _P2P_DONE_LINE % (t, record[2])
        if tag == _P2P_POST:
            _, _, pid, it, op, step, peer, channel, seq, nbytes, shape, dtype, stack = record
            literal = self._literals
            line = _P2P_POST_LINE % (
                t,
                pid,
                it,
                literal[op],
                self._text(step),
                peer,
                literal[channel],
                seq,
                nbytes,
                literal[tuple(shape)],
                literal[dtype],
            )
            if stack is None:
                return line
            return line[:-2] + b',"stack":' + orjson.dumps(stack) + b"}\n"
        _, _, event_name, fields = record
        return orjson.dumps({"e": event_name, "t": t, **fields}, option=_DUMP_OPTIONS)


_STEP_BEGIN_LINE = fmt.line_template(fmt.EVENTS[fmt.STEP_BEGIN])
_STEP_END_LINE = fmt.line_template(fmt.EVENTS[fmt.STEP_END])
_P2P_DONE_LINE = fmt.line_template(fmt.EVENTS[fmt.P2P_DONE])
_P2P_POST_LINE = fmt.line_template(fmt.EVENTS[fmt.P2P_POST])  # without the optional stack
_DUMP_OPTIONS = orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


class _JsonLiterals(dict[str | tuple[int, ...], bytes]):
    """Thread names, ops, channels, dtypes and shapes as JSON bytes, encoded once per value
    (a run has few distinct ones); a hit is a plain dict lookup, cheaper than ``str.encode``."""

    def __missing__(self, value: str | tuple[int, ...]) -> bytes:
        literal = self[value] = orjson.dumps(value)
        return literal


def _short_stack(limit: int = 8) -> list[str]:
    frames = traceback.extract_stack(sys._getframe(2), limit=limit)
    return [f"{f.filename}:{f.lineno} in {f.name}" for f in frames]


def write_meta(
    run_dir: Path,
    *,
    plan: Plan,
    world_size: int,
    config: dict[str, Any],
    framework: str,
    framework_version: str,
    created_ns: int,
) -> None:
    """meta.json: what was run. Written once by rank 0, atomically (write then rename).
    ``created_ns`` is rank 0's wall-clock time (its recorder's clock, virtual in fakes)."""
    meta = fmt.META.build(
        format=fmt.META_FORMAT,
        schema_version=fmt.SCHEMA_VERSION,
        pipetrace_version=__version__,
        framework=framework,
        framework_version=framework_version,
        python_version=sys.version.split()[0],
        world_size=world_size,
        created=created_ns,
        schedule={"name": plan.name, "params": plan.params},
        num_microbatches=plan.num_microbatches,
        placement=list(plan.placement),
        plan=plan.to_json()["ranks"],
        hosts=config.get("hosts", [socket.gethostname()]),
        config=config,
    )
    tmp = run_dir / (fmt.META_FILE + ".tmp")
    tmp.write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    os.replace(tmp, run_dir / fmt.META_FILE)
