"""One rank of a fake cluster: its scripted iterations played into a real Recorder.

The cluster (`pipetrace.testing.cluster`) decides on virtual time what every rank does; this
module turns one rank's script into Recorder calls, setting the rank's `VirtualClock` before
each call, so the log is exactly what the recorder writes (same writer, header and encoding)
and no test sleeps. A job is plain data (step texts, times), so that large runs can be
played by a process pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pipetrace.recorder import format as fmt
from pipetrace.recorder.clock import SYSTEM_CLOCK
from pipetrace.recorder.recorder import Recorder
from pipetrace.recorder.setup import RecordSettings
from pipetrace.recorder.watchdog import Watchdog
from pipetrace.schedule.ir import SEND_KINDS, Plan, Step, StepKind, parse_step

T0_NS = 1_700_000_000_000_000_000
"""Rank 0's wall clock when the run starts (virtual time 0)."""
ORIGIN_NS = 100_000
"""Virtual time of the first iteration's start."""
STEP_LEAD_NS = 10
"""From an iteration's start to its first step."""
CLOCK_UNCERTAINTY_NS = 5_000

# How a rank's part of an iteration ends.
FINISHED, BLOCKED, CRASHED, HUNG = "finished", "blocked", "crashed", "hung"

# Wire faults on one comm step (see `IterationScript.wire`); a shape is the third kind.
DROP, EXTRA = "drop", "extra"
WireFault = str | tuple[int, ...]

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8}
_DIRECTION = {StepKind.SEND_F: 1, StepKind.RECV_F: -1, StepKind.SEND_B: -1, StepKind.RECV_B: 1}


@dataclass
class VirtualClock:
    """A rank's `pipetrace.recorder.clock.Clock` on virtual time: it reads whatever the
    cluster set last (``now``, the true time); its wall clock is off rank 0's by
    ``offset_ns`` at time 0 and runs ``skew`` (e.g. 20e-6 for 20 ppm) fast, as a host's
    oscillator does; ``host_name`` is the host it belongs to (None: this machine's)."""

    offset_ns: int = 0
    now: int = 0
    skew: float = 0.0
    host_name: str | None = None

    def monotonic_ns(self) -> int:
        return self.now + round(self.now * self.skew)

    def wall_ns(self) -> int:
        return T0_NS + self.offset_ns + self.monotonic_ns()

    def host(self) -> str:
        return self.host_name or SYSTEM_CLOCK.host()


@dataclass(frozen=True)
class Message:
    """What every message of the fake cluster carries."""

    shape: tuple[int, ...] = (32, 32)
    dtype: str = "float32"


@dataclass
class IterationScript:
    """What one rank did in one iteration; times are ns from the iteration's start.

    ``texts[i]`` ran i-th, at plan position ``positions[i]``; ``start``/``end`` are its
    times. Steps before ``stop`` completed; the one at ``stop`` (if any) began and never
    ended (``ending`` says why). ``wire`` maps an index to a fault on its message: `DROP`
    (nothing posted), `EXTRA` (posted twice, the copy never waited) or a shape (sent as).
    """

    positions: list[int]
    texts: list[str]
    start: list[float]
    end: list[float]
    stop: int
    ending: str = FINISHED
    wire: dict[int, WireFault] = field(default_factory=dict)
    struck: str | None = None
    """The text of the leaf a crash or hang struck (a composite's sub-step, or the step)."""


@dataclass(frozen=True)
class Playback:
    """What every rank of a run is recorded with (one object shared by all the jobs)."""

    run_dir: str
    world_size: int
    placement: tuple[int, ...]
    num_microbatches: int
    config: dict[str, Any]
    period_ns: float
    """From one iteration's start to the next one's."""
    message: Message
    overlap: bool
    substeps: bool
    stall_after_ns: int | None
    framework: str
    mode: str
    """The record mode ("full": also the Python stack of each P2P post)."""
    activation_bytes: int = 0
    """Bytes a forward keeps until its micro-batch's last backward step (0: no memory
    samples)."""
    losses: tuple[float, ...] = ()
    """The last stage's loss in each iteration (0.5 past its end)."""


@dataclass
class RankJob:
    """Everything needed to write one rank's log (plain data: cheap to send to a worker)."""

    run: Playback
    rank: int
    plan_texts: list[str]
    """The plan the rank was given (its run_start ``plan``)."""
    iterations: list[IterationScript]
    offset_ns: int
    recorded_offset_ns: int
    """What its clock exchange records at time 0: ``offset_ns`` plus the exchange's error."""
    meta_plan: Plan | None = None
    """Rank 0 only: the whole plan, for meta.json."""
    skew: float = 0.0
    host: str | None = None

    def rank_plan(self, steps: list[Step]) -> Plan:
        """The plan handed to the rank's Recorder: the whole plan on rank 0, else one
        holding only this rank's row (all a Recorder reads of another rank's)."""
        if self.meta_plan is not None:
            return self.meta_plan
        rows: list[list[Step | None]] = [[] for _ in range(self.run.world_size)]
        rows[self.rank] = list(steps)
        return Plan(self.run.num_microbatches, self.run.placement, rows)


def play_rank(job: RankJob) -> None:
    """Write one rank's log through a real Recorder on a virtual clock."""
    Player(job).play()


@dataclass(frozen=True, slots=True)
class _Op:
    """A step as the player needs it: for a SEND or RECV, ``kind`` ("send" or "recv"),
    ``key`` (what sequence numbers are counted per) and the message's ends."""

    step: Step
    kind: str | None = None
    key: tuple[str, int, str] | None = None
    ends: dict[str, Any] = field(default_factory=dict)
    """``p2p_posted``'s op, step, peer and channel."""

    @classmethod
    def of(cls, step: Step, placement: tuple[int, ...]) -> _Op:
        if step.kind not in _DIRECTION:
            return cls(step)
        kind = "send" if step.kind in SEND_KINDS else "recv"
        peer = placement[step.stage + _DIRECTION[step.kind]]  # type: ignore[operator]
        channel = step.kind.value[-1]
        ends = {"op": kind, "step": step, "peer": peer, "channel": channel}
        return cls(step, kind, (kind, peer, channel), ends)


class Player:
    """Plays a `RankJob`: one Recorder, one clock, the rank's message sequence numbers."""

    def __init__(self, job: RankJob) -> None:
        self.job = job
        self.run = run = job.run
        self.clock = VirtualClock(job.offset_ns, skew=job.skew, host_name=job.host)
        self.recorder = Recorder(
            RecordSettings(
                run.run_dir, mode=run.mode, stall_timeout=0, abort_timeout=0, flush_interval=3600
            ),
            framework=run.framework,
            framework_version="0",
            clock=self.clock,
        )
        self.placement = run.placement
        self.ops = {text: _Op.of(parse_step(text), run.placement) for text in job.plan_texts}  # type: ignore[arg-type]
        self.plan = job.rank_plan([self.ops[text].step for text in job.plan_texts])
        self.seqs: dict[tuple[str, int, str], int] = {}
        self.arrives: int | None = None
        message = run.message
        self.message_size = (message.shape, _ITEMSIZE[message.dtype] * math.prod(message.shape))
        self.memory = None
        if run.activation_bytes:
            stages = self.plan.stages_of(job.rank)
            self.memory = MemoryModel(stages, run.activation_bytes, self.message_size[1])

    def play(self) -> None:
        job, run, rec, clock = self.job, self.run, self.recorder, self.clock
        rec.begin_run(rank=job.rank, world_size=run.world_size, plan=self.plan, config=run.config)
        self._clock_event("start", 1000)
        last = ORIGIN_NS
        for it, script in enumerate(job.iterations):
            base = ORIGIN_NS + int(it * run.period_ns)
            clock.now = base
            rec.begin_iteration(it)
            last = self._iteration(script, base)
            if script.ending != FINISHED:
                self._stop(script, last)
                return
            clock.now = last + 20
            losses = run.losses
            loss = (
                (losses[it] if it < len(losses) else 0.5)
                if job.rank == self.placement[-1]
                else None
            )
            rec.end_iteration(it, loss)
        self._clock_event("end", last + 1000)
        clock.now = last + 1010
        rec.end_run()

    def _clock_event(self, phase: str, at: int) -> None:
        if self.run.world_size < 2:
            return
        self.clock.now = at
        self.recorder.record_event(
            fmt.CLOCK,
            phase=phase,
            # the true offset at this moment (it drifts with the skew) plus the error
            offset_ns=self.clock.wall_ns()
            - T0_NS
            - at
            + self.job.recorded_offset_ns
            - self.job.offset_ns,
            uncertainty_ns=CLOCK_UNCERTAINTY_NS,
            reference_rank=0,
        )

    def _iteration(self, script: IterationScript, base: int) -> int:
        """Play the steps; returns the virtual time of the rank's last progress."""
        rec, clock, overlap = self.recorder, self.clock, self.run.overlap
        ops = [self._op(text) for text in script.texts]
        self.seqs.clear()
        origin = base + STEP_LEAD_NS
        wire, starts, ends, positions = script.wire, script.start, script.end, script.positions
        posted: dict[int, Any] = {}
        if overlap:  # every recv posted up front, waited where the step is
            for i, op in enumerate(ops):
                if op.kind == "recv" and wire.get(i) != DROP:
                    posted[i] = self._post(op, wire.get(i), origin + int(ends[i]))
        drain = []
        last = base
        for i in range(script.stop):
            op = ops[i]
            start, end = origin + int(starts[i]), origin + int(ends[i])
            clock.now = start
            token = rec.begin_step(positions[i], op.step)
            if op.kind is not None:
                what = wire.get(i) if wire else None
                if what != DROP:
                    ticket = posted.pop(i) if i in posted else self._post(op, what, end)
                    if what == EXTRA:
                        self._post(op, None, end)  # the copy: never waited, like a leaked request
                    clock.now = end
                    if overlap and op.kind == "send":
                        drain.append(ticket)
                    else:
                        rec.p2p_completed(ticket)
            elif op.step.sub_steps and self.run.substeps:
                self._substeps(positions[i], op.step, start, end)
            clock.now = end
            rec.end_step(token)
            if self.memory is not None:
                rec.memory_sample(token, *self.memory.after(op.step), None)
            last = end
        for ticket in drain:
            rec.p2p_completed(ticket)
        if script.stop < len(script.texts):
            last = self._begin_stopped(script, ops[script.stop], origin)
        return last

    def _op(self, text: str) -> _Op:
        """The step of a text and, for a SEND or RECV, its message's ends (cached)."""
        op = self.ops.get(text)
        if op is None:  # a divergent iteration may run steps its plan lacks
            op = self.ops[text] = _Op.of(parse_step(text), self.placement)  # type: ignore[arg-type]
        return op

    def _post(self, op: _Op, wire: WireFault | None, done: int | None) -> Any:
        """Post ``op``, which the cluster completes at ``done`` (None: never). A fake device
        reads it as `arrives`: when a recv's data is there."""
        self.arrives = done
        seqs = self.seqs
        seq = seqs.get(op.key, 0)
        seqs[op.key] = seq + 1  # type: ignore[index]
        shape, nbytes = self.message_size
        if isinstance(wire, tuple):  # a shape mismatch
            shape, nbytes = wire, _ITEMSIZE[self.run.message.dtype] * math.prod(wire)
        dtype = self.run.message.dtype
        return self.recorder.p2p_posted(**op.ends, seq=seq, nbytes=nbytes, shape=shape, dtype=dtype)

    def _substeps(self, position: int, step: Step, start: int, end: int) -> None:
        """A composite's sub-steps: the forward on ``main``, the backward on ``overlap``,
        both from the composite's start; the forward ends halfway (it costs half a backward)."""
        rec = self.recorder
        subs = [
            (rec.begin_step(position, sub, "main" if sub.kind is StepKind.F else "overlap"), sub)
            for sub in step.sub_steps
        ]
        for token, sub in sorted(subs, key=lambda pair: pair[1].kind is not StepKind.F):
            self.clock.now = (start + end) // 2 if sub.kind is StepKind.F else end
            rec.end_step(token)

    def _begin_stopped(self, script: IterationScript, op: _Op, origin: int) -> int:
        """The step the rank stopped in: begun (its message posted if it is a SEND or RECV
        still waiting), never ended. Returns when it began."""
        stop = script.stop
        start = origin + int(script.end[stop - 1]) if stop else origin
        self.clock.now = start
        position = script.positions[stop]
        self.recorder.begin_step(position, op.step)
        if script.struck is not None and op.step.sub_steps:
            struck = parse_step(script.struck)
            thread = "main" if struck.kind is StepKind.F else "overlap"  # type: ignore[union-attr]
            self.recorder.begin_step(position, struck, thread)  # type: ignore[arg-type]
        elif script.ending == BLOCKED and op.kind is not None and not self.run.overlap:
            self._post(op, script.wire.get(stop), None)
        return start

    def _stop(self, script: IterationScript, last: int) -> None:
        """The log ends as a killed process leaves it: no iteration end, no run_end."""
        rec = self.recorder
        if script.ending == CRASHED:
            try:
                raise RuntimeError(f"injected crash in {script.struck}")
            except RuntimeError as exc:
                rec.exception(exc)
        elif self.run.stall_after_ns is not None:
            self.clock.now = last + self.run.stall_after_ns
            Watchdog(rec).dump(fmt.STALL, idle_s=round(self.run.stall_after_ns / 1e9, 3))
        rec.close()


class MemoryModel:
    """A fake rank's memory samples, counted as the runtime counts them: a forward keeps
    ``activation_bytes`` until its micro-batch's last backward step (B, or W after I), and
    a received message's bytes count from its RECV to the compute step that consumes it."""

    def __init__(self, stages: list[int], activation_bytes: int, message_bytes: int) -> None:
        self.slot = {stage: i for i, stage in enumerate(stages)}
        self.activation_bytes = activation_bytes
        self.message_bytes = message_bytes
        self.saved = [0] * len(stages)
        self.inflight = [0] * len(stages)
        self.received: set[tuple[int, int, str]] = set()  # (stage, micro-batch, channel)

    def after(self, step: Step) -> tuple[list[int], list[int]]:
        """(saved, inflight) per stage after ``step`` ended."""
        for leaf in step.leaves():
            kind, slot = leaf.kind, self.slot.get(leaf.stage)  # type: ignore[arg-type]
            if slot is None:
                continue
            if kind in (StepKind.RECV_F, StepKind.RECV_B):
                self.received.add((leaf.stage, leaf.microbatch, kind.value[-1]))  # type: ignore[arg-type]
                self.inflight[slot] += self.message_bytes
            elif kind is StepKind.F:
                self._consume(leaf, "F", slot)
                self.saved[slot] += self.activation_bytes
            elif kind in (StepKind.B, StepKind.I):
                self._consume(leaf, "B", slot)
            if kind in (StepKind.B, StepKind.W):
                self.saved[slot] -= self.activation_bytes
        return list(self.saved), list(self.inflight)

    def _consume(self, leaf: Step, channel: str, slot: int) -> None:
        key = (leaf.stage, leaf.microbatch, channel)
        if key in self.received:
            self.received.discard(key)  # type: ignore[arg-type]
            self.inflight[slot] -= self.message_bytes
