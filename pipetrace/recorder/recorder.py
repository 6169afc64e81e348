"""The recorder: turns runtime hooks into a per-rank event log (see docs/trace-format.md).

The hot path (`begin_step`, `end_step`, `p2p_posted`, `p2p_completed`, `memory_sample`)
takes one monotonic clock reading (from the injected `Clock`, bound once) and appends the
event to the rank's queue (`pipetrace.recorder.queue`); encoding to JSON happens when the
writer flushes it. Where the C queue is built, the hot calls are its own methods, bound over
the Python ones below on a plain recorder (no device timer, no stacks): they keep events as
cells rather than tuples (`_queue.c`). Either way each hook also notes progress for the
watchdog and keeps the set of open steps and in-flight P2P ops, which is what a stall dump
reports.

On a device with device timing (CUDA: `pipetrace.recorder.setup.torch_recorder` passes its
backend), steps and P2P ops are also timed on the device by a `DeviceTimer`: its spans become
``device`` events, and the work it has not seen complete is listed as ``device_pending`` in
stall dumps, exceptions and ``run_end`` (docs/device-timing.md). Without a device, the hot
path costs one attribute check more in `begin_step` only.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from pipetrace import __version__
from pipetrace.recorder import format as fmt
from pipetrace.recorder import run_dir as run_dir_claim
from pipetrace.recorder.clock import SYSTEM_CLOCK, Clock, RecvInts, SendInts, align_clocks
from pipetrace.recorder.device.anchor import Anchor
from pipetrace.recorder.device.protocol import DeviceBackend
from pipetrace.recorder.device.spans import DeviceSpan, PendingWork
from pipetrace.recorder.device.timer import DeviceTimer, TimerSettings
from pipetrace.recorder.encoding import (
    MEMORY,
    OTHER,
    P2P_DONE,
    P2P_POST,
    STEP_BEGIN,
    STEP_END,
    LineEncoder,
)
from pipetrace.recorder.hooks import Config, Place, sample_counts, watched_counts
from pipetrace.recorder.queue import RecordQueue, new_queue, open_queue
from pipetrace.recorder.run_dir import create_new_file
from pipetrace.recorder.writer import EventWriter
from pipetrace.schedule.ir import Plan, Step, format_step

if TYPE_CHECKING:
    from pipetrace.recorder.setup import RecordSettings

ITERATION_FLUSH_SPACING_NS = 100_000_000
"""An iteration's end writes the log unless the last iteration end that did was less than
this ago (0.1 s): an iteration that long or longer is written as it ends, shorter ones
together (at most 0.1 s of them), which saves a write and its cold encoding per iteration
where iterations take milliseconds (docs/performance.md, "Recorder")."""


class ProfilerRanges(Protocol):
    """A framework's profiler range API (see `pipetrace.recorder.profiler`)."""

    def active(self) -> bool: ...

    def begin(self, name: str) -> Any: ...

    def end(self, handle: Any) -> None: ...


class Recorder:
    """Implements `pipetrace.recorder.hooks.RecorderHooks` for one rank."""

    records_memory = True

    def __init__(
        self,
        config: RecordSettings,
        *,
        framework: str = "torch",
        framework_version: str = "",
        profiler: ProfilerRanges | None = None,
        clock_exchange: tuple[SendInts, RecvInts] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        device: DeviceBackend | None = None,
        device_timing: TimerSettings | None = None,
        compiled: bool = True,
    ) -> None:
        """``device``: time steps and P2P ops on this device too (None: host times only);
        ``device_timing`` tunes its timer (None: the defaults); ``compiled``: use the C
        queue and hot calls where they are built (False: Python only, which they equal)."""
        if not config.enabled:
            raise ValueError("a Recorder needs a run_dir and a record mode other than 'off'")
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
        # The queue's appends, bound once for the hot path (refusing until begin_run).
        self._append: Callable[[tuple], None] = _not_recording
        self._append_unchecked: Callable[[tuple], None] = _not_recording
        self._ids = itertools.count()
        self._iteration = -1
        self._in_iteration = False
        self.waiting_in: str | None = None
        """A collective wait outside iterations that the watchdog must watch."""
        self._epoch_anchor = clock.wall_ns()
        self._perf_anchor = clock.monotonic_ns()
        self._progress = self._perf_anchor  # the Python methods' last progress
        self._open_steps: dict[int, tuple] = {}  # id -> its step_begin record
        self._inflight: dict[int, tuple] = {}  # id -> the p2p_post record
        self._encoder: LineEncoder | None = None  # made in begin_run, when peers are known
        self._watchdog = None
        self._device = device
        device_timing = device_timing or TimerSettings()
        self._device_poller = device_timing.poller
        self._timer = None if device is None else self._device_timer(device, device_timing)
        self._p2p_timings: dict[int, Any] = {}  # P2P id -> its device timing, until enqueued
        self._last_memory: tuple = ()  # the last memory sample written (only changes are)
        self._watched: tuple | None = None  # `memory_watch`'s counts: (held, act, grad)
        self._iteration_flushed = 0  # time.monotonic_ns() of the last iteration end's write
        self._profiling = False  # whether steps get profiler ranges (`_check_profiler`)
        self._queue = new_queue(
            self._monotonic_ns,
            compiled=compiled,
            step_token=self._step_token,
            close_token=self._close_token,
        )
        self._hot = None  # the C queue, when its hot calls are bound over the methods below
        if not isinstance(self._queue, RecordQueue) and self._timer is None and not self._stacks:
            self._hot = self._queue
            self.begin_step = self._hot.begin_step
            self.end_step = self._hot.end_step
            self.p2p_posted = self._hot.p2p_posted
            self.p2p_completed = self._hot.p2p_completed
            self.memory_sample = self._hot.memory_sample
            self.next_step = self._hot.next_step

    @property
    def open_steps(self) -> dict[int, tuple]:
        """Steps begun and not ended: id -> its step_begin record."""
        return self._open_steps if self._hot is None else self._hot.open_steps()

    @property
    def inflight(self) -> dict[int, tuple]:
        """P2P ops posted and not completed: id -> its p2p_post record."""
        return self._inflight if self._hot is None else self._hot.inflight()

    @property
    def last_progress(self) -> int:
        """The monotonic time of the last event that shows the rank moving (the watchdog's)."""
        if self._hot is None:
            return self._progress
        return max(self._progress, self._hot.progress)

    def _device_timer(self, device: DeviceBackend, settings: TimerSettings) -> DeviceTimer:
        return DeviceTimer(
            device,
            now_ns=self.now_ns,
            on_span=self._device_span,
            on_anchor=self._device_anchor,
            settings=settings,
        )

    # -- lifecycle -------------------------------------------------------------------------

    def begin_run(
        self, *, rank: int, world_size: int, plan: Plan, config: Config, place: Place | None = None
    ) -> None:
        """``rank`` is the pipeline rank (its plan row); the log, the header and the clock
        exchange use the global rank ``place`` gives (the same without one)."""
        self.rank = rank if place is None else place.global_rank
        self.world_size = world_size if place is None else place.world_size
        run_dir = self.config.run_dir
        self._run_id = run_dir_claim.current_run_id()
        run_dir_claim.claim(run_dir, self._run_id)
        # Pipeline rank -> global rank when the job has several pipelines: the runtime names
        # peers by pipeline rank, the trace by global rank.
        peers = None if place is None else place.pipeline_ranks
        offset = self._epoch_anchor - self._perf_anchor
        self._encoder = LineEncoder(offset, peers)
        queue = self._queue
        self._writer = EventWriter(
            fmt.rank_log_path(run_dir, self.rank),
            self._header(place),
            queue,
            flush_interval=self.config.flush_interval,
        )
        open_queue(
            queue, self._encoder, capacity=self.config.buffer_events, on_full=self._writer.flush
        )
        self._append = queue.append
        # The C queue checks its bound at every append; the Python one where a step ends.
        self._append_unchecked = getattr(queue, "append_unchecked", queue.append)
        if self.rank == 0:
            write_meta(
                run_dir,
                plan=plan,
                world_size=self.world_size,
                config=config,
                framework=self.framework,
                framework_version=self.framework_version,
                created_ns=self.now_ns(),
                pipelines=None if place is None else place.pipelines,
            )
        self._check_profiler()
        steps = [format_step(s) for s in plan.steps(rank)]
        self._other(fmt.RUN_START, config=config, plan=steps, stages=plan.stages_of(rank))
        self._align_clock("start")
        self._start_device_timer()
        if self.config.stall_timeout > 0:
            from pipetrace.recorder.watchdog import Watchdog

            self._watchdog = Watchdog(self)
            self._watchdog.start()

    def _header(self, place: Place | None) -> dict[str, Any]:
        return fmt.HEADER.build(
            format=fmt.LOG_FORMAT,
            schema_version=fmt.SCHEMA_VERSION,
            rank=self.rank,
            world_size=self.world_size,
            pid=os.getpid(),
            host=self.clock.host(),
            pipetrace_version=__version__,
            framework=self.framework,
            framework_version=self.framework_version,
            record_mode=self.config.mode,
            t0=self._epoch_anchor,
            run_id=self._run_id,
            **self._device_header(),
            **({} if place is None else place.header()),
        )

    def end_run(self) -> None:
        # A peer that never gets here (hung between iterations, or killed) leaves this rank
        # waiting in the exchange: the watchdog watches that wait like an iteration.
        self.waiting_in = "the end-of-run clock exchange"
        self._progress = self._monotonic_ns()
        try:
            self._align_clock("end")
        except BaseException as exc:  # a peer died meanwhile: said, like a step's error
            self.exception(exc)
            self.close()
            raise
        self.waiting_in = None
        if self._timer is not None:
            self._timer.drain()
        self._close_device_timer()
        self._other(fmt.RUN_END, **self.describe_device_pending())
        self.close()

    def close(self) -> None:
        self._close_device_timer()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self._append = self._append_unchecked = _not_recording
            if self._hot is not None:
                self._hot.close()

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
        self._check_profiler()
        if self._hot is not None:
            self._hot.iteration = iteration
        self._other(fmt.ITER_BEGIN, it=iteration)
        self._in_iteration = True

    def _check_profiler(self) -> None:
        """Whether the steps from here on get profiler ranges: asked at each iteration's
        start (and the run's), not at each step. A profiler starts and steps between
        training iterations (`torch.profiler.profile`, its `step()`); asking it cost a call
        into the framework per step (~0.5 µs after the step's work, docs/performance.md)."""
        profiler = self._profiler
        self._profiling = profiler is not None and bool(profiler.active())
        if self._hot is not None:
            self._hot.profiling = self._profiling

    def end_iteration(self, iteration: int, loss: float | None) -> None:
        self._in_iteration = False
        if loss is not None and not math.isfinite(loss):  # JSON would write null
            self._other(fmt.ITER_END, it=iteration, loss=None, nonfinite=str(loss))
        else:
            self._other(fmt.ITER_END, it=iteration, loss=loss)
        if self._timer is not None and not self._device_poller:
            self._timer.poll()
        now = time.monotonic_ns()
        if self._writer is not None and now - self._iteration_flushed >= ITERATION_FLUSH_SPACING_NS:
            self._iteration_flushed = now
            # Here, not on the writer's thread: with the records encoded in C a flush costs
            # less than waking that thread and handing it the interpreter lock, which the
            # training thread then waits to get back (docs/performance.md, "Recorder").
            self._writer.flush()

    @property
    def watched(self) -> bool:
        """Whether a lack of progress now is a stall: in an iteration or a collective wait
        (between iterations, user code may legitimately take long)."""
        return self._in_iteration or self.waiting_in is not None

    # -- the hot path ----------------------------------------------------------------------

    def begin_step(self, position: int, step: Step, thread: str = "main") -> Any:
        return self._begin_at(self._monotonic_ns(), position, step, thread)

    def _begin_at(self, t: int, position: int, step: Step, thread: str) -> Any:
        self._progress = t
        sid = next(self._ids)
        record = (STEP_BEGIN, t, sid, self._iteration, position, step, thread)
        self._open_steps[sid] = record  # the record itself: one tuple per step, not two
        self._append_unchecked(record)  # `end_step` checks the queue's bound
        if self._timer is None and not self._profiling:
            return sid
        return self._step_token(sid, step)

    def _step_token(self, sid: int, step: Step) -> tuple[int, Any, Any]:
        """(id, profiler range or None, device timing or None): the token of a step that
        has a profiler range or a device timing open, so that `end_step` closes them."""
        text = format_step(step)
        handle = None
        if self._profiling:
            handle = self._profiler.begin("pipetrace/" + text)
        timer = self._timer
        timing = None if timer is None else timer.begin(sid, text, self._device.current_stream())
        return (sid, handle, timing)

    def _close_token(self, token: tuple[int, Any, Any]) -> int:
        """Closes what `_step_token` opened; the step's id."""
        sid, handle, timing = token
        if timing is not None:
            self._timer.end(timing)
        if handle is not None:
            self._profiler.end(handle)
        return sid

    def end_step(self, token: Any, nbytes: int | None = None) -> None:
        self._end_at(self._monotonic_ns(), token, nbytes)

    def _end_at(self, t: int, token: Any, nbytes: int | None) -> None:
        self._progress = t
        if type(token) is tuple:
            token = self._close_token(token)
        self._open_steps.pop(token, None)
        if nbytes is None:
            self._append((STEP_END, t, token))
        else:
            self._append((STEP_END, t, token, nbytes))

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
        stream: Any = None,
    ) -> Any:
        """``stream``: the device stream the op is posted from (CUDA: the runtime's P2P
        stream), to time it on the device until `p2p_enqueued`; None: host times only."""
        t = self._monotonic_ns()
        self._progress = t
        pid = next(self._ids)
        if stream is not None and self._timer is not None:
            self._p2p_timings[pid] = self._timer.begin(pid, format_step(step), stream, "p2p")
        stack = _short_stack() if self._stacks else None
        record = (
            P2P_POST,
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
        self._inflight[pid] = record
        self._append_unchecked(record)
        return pid

    def p2p_enqueued(self, token: Any) -> None:
        """The op's wait is enqueued on its stream (CUDA: ``work.wait()`` makes the P2P
        stream wait for NCCL): its device end is marked there. A no-op for an op posted
        without a stream."""
        timing = self._p2p_timings.pop(token, None)
        if timing is not None:
            self._timer.end(timing)

    def p2p_completed(self, token: Any) -> None:
        t = self._monotonic_ns()
        self._progress = t
        self._inflight.pop(token, None)
        self._append_unchecked((P2P_DONE, t, token))

    def memory_sample(
        self,
        token: Any,
        saved: list[int],
        inflight: list[int],
        allocator: tuple[int, int] | None = None,
        swapped: list[int] | None = None,
    ) -> None:
        """A ``memory`` event, when a value differs from the previous sample's. The lists are
        copied: a caller may pass the same ones, changed in place, every time. Appended
        unchecked: it follows its step's `end_step`, which checked the queue's bound."""
        self._sample_at(None, token, saved, inflight, allocator, swapped)

    def _sample_at(
        self,
        t: int | None,  # None: the clock's time, read when the sample is written
        token: Any,
        saved: list[int],
        inflight: list[int],
        allocator: tuple[int, int] | None = None,
        swapped: list[int] | None = None,
    ) -> None:
        if (saved, inflight, allocator, swapped) == self._last_memory:
            return
        saved, inflight = list(saved), list(inflight)
        swapped = None if swapped is None else list(swapped)
        self._last_memory = (saved, inflight, allocator, swapped)
        sid = token[0] if type(token) is tuple else token
        t = self._monotonic_ns() if t is None else t
        self._append_unchecked((MEMORY, t, sid, saved, inflight, allocator, swapped))

    def memory_watch(
        self, held: list[dict[int, int]], act: list[int], grad: list[int]
    ) -> Callable[[Any], None]:
        """What samples these live counts after a step (`RecorderHooks.memory_watch`): the C
        queue reads them itself, without a list made per sample. `next_step` samples them
        too."""
        self._watched = (held, act, grad)
        if self._hot is None:
            return partial(sample_counts, self.memory_sample, held, act, grad)
        self._hot.watch_memory(held, act, grad)
        return self._hot.sample_watched

    def next_step(self, token: Any, sampled: bool, position: int, step: Step) -> Any:
        """`RecorderHooks.next_step`: the step of ``token`` ends (None: none to end), the
        watched counts are sampled after it when ``sampled``, and the step at ``position``
        begins on the main thread, all at one time (one clock reading)."""
        t = self._monotonic_ns()
        if token is not None:
            self._end_at(t, token, None)
            if sampled:
                if self._watched is None:
                    raise RuntimeError("sample_watched: watch_memory first")
                self._sample_at(t, token, *watched_counts(*self._watched))
        return self._begin_at(t, position, step, "main")

    # -- device timing ---------------------------------------------------------------------

    def _device_header(self) -> dict[str, Any]:
        device = self._device
        if device is None:
            return {}
        timing = fmt.DEVICE_TIMING_VERSION
        return {"device": {"kind": device.name, "name": device.description, "timing": timing}}

    def _start_device_timer(self) -> None:
        """After the start clock exchange, before any work of the run is queued: the timer's
        one device-wide sync and first anchor."""
        if self._timer is None:
            return
        self._timer.start()
        if self._device_poller:
            self._timer.start_poller()

    def _close_device_timer(self) -> None:
        """Stop the poller and record what completed; what did not stays pending."""
        if self._timer is not None and self._writer is not None:
            self._timer.close()

    def _device_span(self, span: DeviceSpan) -> None:
        """A step or op the device has run (called on the timer's poller thread)."""
        self._other(
            fmt.DEVICE,
            progress=False,
            id=span.key,
            db=span.device_begin_ns,
            de=span.device_end_ns,
            stream=span.stream,
            unc=span.uncertainty_ns,
        )

    def _device_anchor(self, anchor: Anchor) -> None:
        """An anchor, recorded at its own host time (``t`` is where device times hang)."""
        if self._writer is None:
            return
        fields = {"index": anchor.index, "uncertainty_ns": anchor.uncertainty_ns}
        fields["rate"] = anchor.rate
        monotonic = anchor.host_ns - self._epoch_anchor + self._perf_anchor
        self._append((OTHER, monotonic, fmt.DEVICE_ANCHOR, fields))

    def describe_device_pending(self) -> dict[str, list[dict[str, Any]]]:
        """``{"device_pending": [...]}``: work enqueued and not completed on the device,
        oldest first, for a stall dump, an exception or run_end; ``{}`` without a device."""
        if self._timer is None:
            return {}
        return {"device_pending": [work.to_json() for work in self._timer.pending()]}

    def oldest_device_pending(self) -> PendingWork | None:
        """The oldest work the device has not completed (None without a device or none)."""
        pending = [] if self._timer is None else self._timer.pending()
        return pending[0] if pending else None

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
            **self.describe_device_pending(),
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
            for _, _, sid, it, pos, step, thread in list(self.open_steps.values())
        ]

    def describe_inflight(self) -> list[dict[str, Any]]:
        encoder = self._encoder
        if encoder is None:
            return []
        return [orjson.loads(encoder.lines([record])) for record in list(self.inflight.values())]

    def now_ns(self) -> int:
        """Wall-clock nanoseconds on this rank's event clock."""
        return self._epoch_anchor + (self._monotonic_ns() - self._perf_anchor)

    # -- other events ----------------------------------------------------------------------

    def _other(self, event: str, *, progress: bool = True, **fields: Any) -> None:
        t = self._monotonic_ns()
        if progress:  # the watchdog's own events must not count as progress
            self._progress = t
        if self._writer is not None:
            self._append((OTHER, t, event, fields))


def _not_recording(record: tuple) -> None:
    raise RuntimeError("the recorder is not recording: begin_run first, and not after close")


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
    pipelines: tuple[tuple[int, ...], ...] | None = None,
) -> None:
    """meta.json: what was run. Written once by (global) rank 0, atomically (write then
    rename). ``created_ns`` is rank 0's wall-clock time (its recorder's clock, virtual in
    fakes); ``pipelines``: the global ranks of each replica's pipeline, when there are
    several."""
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
        **({} if pipelines is None else {"pipelines": [list(p) for p in pipelines]}),
    )
    tmp = run_dir / f".{fmt.META_FILE}.{os.getpid()}"
    with os.fdopen(create_new_file(tmp), "wb") as handle:
        handle.write(orjson.dumps(meta, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    os.replace(tmp, run_dir / fmt.META_FILE)  # replaces a planted link, never follows it
