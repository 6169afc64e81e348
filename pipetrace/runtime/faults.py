"""The kinds of fault pipetrace can inject on purpose (``pipetrace run --inject``), one typed
record each: where it strikes, its defaults, how it is checked against a plan, what it does.

Pure Python (no torch), like `pipetrace.runtime.config`. `pipetrace.runtime.fault_spec` parses
``KIND[:KEY=VALUE,...]`` specs into these records and resolves them against the run's plan in
the parent, before any rank starts; every default is filled in then, so each rank applies
exactly the same fault. `pipetrace.runtime.inject` applies them on the ranks, and the fake
cluster of the tests (`pipetrace.testing.cluster`) plays them on virtual time.

Words as in `pipetrace.schedule.ir`. ``step=`` is the training step (iteration) counted from
0, as ``it`` in the trace; ``microbatch=`` counts from 0; ``channel=`` is ``F`` (activations)
or ``B`` (gradients). What each fault does on the wire is described in docs/runtime.md,
"Fault injection".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from pipetrace.errors import PipetraceError
from pipetrace.runtime.fault_plan import (
    consecutive_sends,
    finishes,
    is_stream_first,
    message_step,
    peer_of,
    sends_to,
)
from pipetrace.schedule.ir import Plan, Step, StepKind, format_step

# Faults that leave the run hung: `pipetrace run` then lowers the watchdog and P2P timeouts
# it was not given (seconds), so that an injected run ends within seconds, recorded.
HANG_STALL_TIMEOUT = 3.0
HANG_ABORT_TIMEOUT = 2.0
HANG_P2P_TIMEOUT = 20.0

NOBODY_MICROBATCH = 1 << 20
"""The micro-batch whose tag an extra-send message carries: no recv is ever posted for it."""


@dataclass(frozen=True)
class Fault:
    """Where a fault strikes: a pipeline rank, at (or from) a training step.

    Fields left None take their defaults in `resolve`; a resolved fault has none left.
    """

    KIND: ClassVar[str] = ""
    HANGS: ClassVar[bool] = False
    """True when the run cannot end by itself: only the watchdog or a timeout ends it."""
    ENDS_RUN: ClassVar[bool] = False
    """True when the run fails (hangs or crashes): `launch` stops at such a case, so run it
    alone rather than with other cases in one launch."""
    DEFAULT_STEP: ClassVar[int] = 1
    RUNTIMES: ClassVar[tuple[str, ...]] = ("pipetrace",)
    """The ``--runtime`` values it can be injected on (`pipetrace.torch_pipelining.faults`
    applies it on torch's runtime, which has no executor to reorder nor wire to tamper with)."""

    rank: int | None = None
    """The pipeline rank that misbehaves (default: the middle rank, P // 2)."""
    step: int | None = None
    """The training step (iteration, from 0) it happens in."""
    replica: int | None = None
    """The replica (data-parallel pipeline) whose rank misbehaves: default 0 with several
    replicas; None (the only pipeline) without."""

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @property
    def spec(self) -> str:
        """The fault as a --inject spec (with every default filled in once resolved)."""
        values = [
            f"{name}={_format_value(getattr(self, name))}"
            for name in self.keys()
            if getattr(self, name) is not None
        ]
        return self.KIND + (":" + ",".join(values) if values else "")

    def resolve(self, where: FaultTarget) -> Fault:
        """This fault with its defaults filled in, checked against the run; raises
        PipetraceError naming the problem."""
        num_ranks = where.plan.num_ranks
        rank = num_ranks // 2 if self.rank is None else self.rank
        _check_range(self, "rank", rank, num_ranks, f"--ranks {num_ranks}")
        step = min(self.DEFAULT_STEP, where.steps - 1) if self.step is None else self.step
        _check_range(
            self, "step", step, where.steps, f"--steps {where.steps}; step counts iterations from 0"
        )
        return dataclasses.replace(self, rank=rank, step=step, replica=self._replica(where))

    def _replica(self, where: FaultTarget) -> int | None:
        """None without data parallelism, so that a spec stays as it always was."""
        if where.replicas == 1:
            if self.replica is not None:
                raise self.error("replica= needs --data-parallel 2 or more")
            return None
        replica = self.replica or 0
        _check_range(self, "replica", replica, where.replicas, f"--data-parallel {where.replicas}")
        return replica

    def describe(self, plan: Plan, *, overlap: bool = False) -> str:
        """One line: what this (resolved) fault does in this plan."""
        raise NotImplementedError

    def error(self, problem: str) -> PipetraceError:
        return PipetraceError(f"--inject {self.spec}: {problem}")


@dataclass(frozen=True)
class FaultTarget:
    """What a fault is checked against: the run's plan and settings
    (`pipetrace.runtime.fault_spec.resolve_faults` makes it from a `RunConfig`)."""

    plan: Plan
    steps: int
    overlap: bool
    message_shape: tuple[int, ...]
    """The shape of every message of the demo model (micro-batch samples, width)."""
    replicas: int = 1
    """Data-parallel replicas, each running the plan."""


# -- faults inside a compute step --------------------------------------------------------

_PHASES = {"F": (StepKind.F,), "B": (StepKind.B, StepKind.I), "W": (StepKind.W,)}


@dataclass(frozen=True)
class _AtComputeStep(Fault):
    microbatch: int | None = None
    """The micro-batch whose step it strikes."""
    phase: str | None = None
    """F (forward), B (backward: B or I) or W (weight gradient)."""

    PHASES: ClassVar[tuple[str, ...]] = tuple(_PHASES)

    def resolve(self, where: FaultTarget) -> Fault:
        fault = super().resolve(where)
        mb = _microbatch(fault, where.plan)
        phase = "F" if self.phase is None else self.phase
        fault = dataclasses.replace(fault, microbatch=mb, phase=phase)
        fault.target(where.plan)
        return fault

    def target(self, plan: Plan) -> Step:
        """The step it strikes: the rank's first step of this phase and micro-batch (a
        composite's sub-step included)."""
        kinds = _PHASES[self.phase or "F"]
        for step in plan.steps(self.rank or 0):
            for leaf in step.leaves():
                if leaf.kind in kinds and leaf.microbatch == self.microbatch:
                    return leaf
        raise self.error(
            f"rank {self.rank}'s plan has no {self.phase} step of micro-batch "
            f"{self.microbatch} ({plan.name} has no {'/'.join(k.value for k in kinds)} steps "
            f"there); use phase={'|'.join(p for p in self.PHASES if p != self.phase)}"
        )


@dataclass(frozen=True)
class Crash(_AtComputeStep):
    KIND = "crash"
    RUNTIMES = ("pipetrace", "torch")
    ENDS_RUN = True

    def describe(self, plan: Plan, *, overlap: bool = False) -> str:
        step = format_step(self.target(plan))
        return f"crash: rank {self.rank} raises RuntimeError in {step} at step {self.step}"


@dataclass(frozen=True)
class Hang(_AtComputeStep):
    KIND = "hang"
    RUNTIMES = ("pipetrace", "torch")
    HANGS = True
    ENDS_RUN = True

    def describe(self, plan: Plan, *, overlap: bool = False) -> str:
        step = format_step(self.target(plan))
        return f"hang: rank {self.rank} blocks forever in {step} at step {self.step}"


_STRAGGLER_PHASES = {
    "F": (StepKind.F,),
    "B": (StepKind.B, StepKind.I, StepKind.W),
    "all": (StepKind.F, StepKind.B, StepKind.I, StepKind.W),
}


@dataclass(frozen=True)
class Straggler(Fault):
    KIND = "straggler"
    RUNTIMES = ("pipetrace", "torch")
    DEFAULT_STEP = 0

    factor: float | None = None
    """Each step of the phase takes this many times its own duration (default 3)."""
    phase: str | None = None
    """F (forwards, the default), B (backward work: B, I and W) or all."""

    PHASES: ClassVar[tuple[str, ...]] = tuple(_STRAGGLER_PHASES)

    def resolve(self, where: FaultTarget) -> Fault:
        fault = super().resolve(where)
        return dataclasses.replace(
            fault,
            factor=3.0 if self.factor is None else self.factor,
            phase="F" if self.phase is None else self.phase,
        )

    @property
    def kinds(self) -> tuple[StepKind, ...]:
        return _STRAGGLER_PHASES[self.phase or "F"]

    def describe(self, plan: Plan, *, overlap: bool = False) -> str:
        which = {"F": "forward", "B": "backward", "all": "compute"}[self.phase or "F"]
        return (
            f"straggler: every {which} step of rank {self.rank} takes {self.factor:g}x as long, "
            f"from step {self.step} on"
        )


# -- faults on the wire ------------------------------------------------------------------


@dataclass(frozen=True)
class SlowLink(Fault):
    KIND = "slow-link"
    DEFAULT_STEP = 0

    delay: float | None = None
    """Seconds between posting each send and putting it on the wire (default 0.02)."""

    def resolve(self, where: FaultTarget) -> Fault:
        fault = super().resolve(where)
        if not any(
            s.kind in (StepKind.SEND_F, StepKind.SEND_B) for s in where.plan.steps(fault.rank or 0)
        ):
            raise fault.error(f"rank {fault.rank} sends no messages in this plan")
        return dataclasses.replace(fault, delay=0.02 if self.delay is None else self.delay)

    def describe(self, plan: Plan, *, overlap: bool = False) -> str:
        return (
            f"slow-link: every send of rank {self.rank} reaches the wire "
            f"{(self.delay or 0.0) * 1e3:g} ms after it is posted, from step {self.step} on"
        )


@dataclass(frozen=True)
class _OneMessage(Fault):
    """A fault on one message the rank sends (or receives) on a channel."""

    microbatch: int | None = None
    """The micro-batch whose message it strikes."""
    channel: str | None = None
    """F or B (default: F if the rank has such a message of that micro-batch, else B)."""

    RECEIVES: ClassVar[bool] = False
    """The message is one the rank receives (else one it sends)."""
    SAYS: ClassVar[str] = ""
    """What `describe` says after the kind, with {rank}, {message}, {step}, {peer} (and the
    subclass's `_say` fields) filled in."""

    def describe(self, plan: Plan, *, overlap: bool = False) -> str:
        step = self.target(plan)
        return f"{self.KIND}: " + self.SAYS.format(**self._say(plan, step))

    def _say(self, plan: Plan, step: Step) -> dict[str, object]:
        return {
            "rank": self.rank,
            "message": format_step(step),
            "step": self.step,
            "peer": peer_of(plan, step),
        }

    CHANGES_MESSAGE: ClassVar[bool] = True
    """The fault changes or drops the message itself, which at step 0 must then not be the
    first of its stream: that one also carries the stream's shape to the receiver."""

    def resolve(self, where: FaultTarget) -> Fault:
        fault = super().resolve(where)
        mb = _microbatch(fault, where.plan)
        channel = self.channel
        if channel is None:
            channel = (
                "F" if message_step(where.plan, fault.rank or 0, "F", mb, self.RECEIVES) else "B"
            )
        fault = dataclasses.replace(fault, microbatch=mb, channel=channel)
        step = fault.target(where.plan)
        if (
            self.CHANGES_MESSAGE
            and fault.step == 0
            and is_stream_first(where.plan, step, self.RECEIVES)
        ):
            raise fault.error(
                f"{format_step(step)} is the first message of its stream at step 0 (it carries the "
                "stream's shape to the receiver); use step>=1 or another microbatch="
            )
        return fault

    def target(self, plan: Plan) -> Step:
        """The SEND (or RECV) step of the message: the rank's first of that channel and
        micro-batch."""
        step = message_step(
            plan, self.rank or 0, self.channel or "F", self.microbatch or 0, self.RECEIVES
        )
        if step is None:
            what = "receives" if self.RECEIVES else "sends"
            raise self.error(
                f"rank {self.rank} {what} no {self.channel} message of micro-batch "
                f"{self.microbatch} in this plan; use another channel= or rank="
            )
        return step


@dataclass(frozen=True)
class DropRecv(_OneMessage):
    KIND = "drop-recv"
    HANGS = True
    ENDS_RUN = True
    RECEIVES = True
    SAYS = (
        "rank {rank} skips {message} at step {step} (posts nothing, computes on zeros); "
        "rank {peer}'s send is never received"
    )


@dataclass(frozen=True)
class DropSend(_OneMessage):
    KIND = "drop-send"
    RUNTIMES = ("pipetrace", "torch")
    HANGS = True
    ENDS_RUN = True
    SAYS = "rank {rank} skips {message} at step {step} (posts nothing); rank {peer} waits for it"


@dataclass(frozen=True)
class ExtraSend(_OneMessage):
    KIND = "extra-send"
    CHANGES_MESSAGE = False  # the copy goes after the real message
    SAYS = (
        "rank {rank} sends {message} a second time at step {step}, under a tag rank {peer} "
        "never receives (never waited, like a leaked request)"
    )


@dataclass(frozen=True)
class ShapeMismatch(_OneMessage):
    KIND = "shape-mismatch"

    shape: tuple[int, ...] | None = None
    """The shape sent instead (default: half the rows); at most as many elements as the
    right one, since gloo aborts a process that receives more than its buffer holds."""

    def resolve(self, where: FaultTarget) -> Fault:
        fault = super().resolve(where)
        assert isinstance(fault, ShapeMismatch)
        right = where.message_shape
        shape = self.shape if self.shape is not None else _smaller(right)
        fault = dataclasses.replace(fault, shape=shape)
        if shape == right:
            raise fault.error(
                f"shape={_format_value(shape)} is the message's right shape; give another"
            )
        if math.prod(shape) > math.prod(right):
            raise fault.error(
                f"shape={_format_value(shape)} has more elements than the right "
                f"{_format_value(right)}: gloo aborts the receiving process (SIGABRT) before its "
                f"recording is flushed; give at most {math.prod(right)} elements"
            )
        return fault

    SAYS = (
        "rank {rank} sends {message} at step {step} as a {shape} tensor; rank {peer} receives "
        "it into its usual buffer"
    )

    def _say(self, plan: Plan, step: Step) -> dict[str, object]:
        return {**super()._say(plan, step), "shape": _format_value(self.shape or ())}


@dataclass(frozen=True)
class SwapOrder(_OneMessage):
    KIND = "swap-order"

    def resolve(self, where: FaultTarget) -> Fault:
        fault = Fault.resolve(self, where)
        assert isinstance(fault, SwapOrder)
        rank, plan = fault.rank or 0, where.plan
        channel = self.channel
        if channel is None:  # the first channel with a pair that can be swapped, else F
            channel = next(
                (
                    c
                    for c in ("F", "B")
                    if dataclasses.replace(fault, channel=c).pairs(plan, overlap=where.overlap)
                ),
                "F",
            )
        fault = dataclasses.replace(fault, channel=channel)
        if not consecutive_sends(plan, rank, channel):
            raise fault.error(
                f"rank {rank} sends fewer than two {channel} messages to one peer; "
                "use another channel= or rank="
            )
        usable = fault.pairs(plan, overlap=where.overlap)
        if self.microbatch is None:
            if not usable:
                raise fault.error(
                    f"no two {channel} messages of rank {rank} can be swapped without a deadlock "
                    f"in {plan.name} ({_mode(where.overlap)}); use another channel= or rank="
                )
            return dataclasses.replace(fault, microbatch=usable[0][0].microbatch)
        if not any(
            a.microbatch == self.microbatch for a, _ in consecutive_sends(plan, rank, channel)
        ):
            raise fault.error(
                f"rank {rank} sends no {channel} message after micro-batch {self.microbatch}'s on "
                "its channel to swap it with; give an earlier microbatch="
            )
        if not any(a.microbatch == self.microbatch for a, _ in usable):
            can = sorted({a.microbatch for a, _ in usable})
            raise fault.error(
                f"rank {rank} cannot send its {channel} message of micro-batch {self.microbatch} "
                f"after the next one without a deadlock in {plan.name} ({_mode(where.overlap)}); "
                + (
                    f"microbatch= can be {', '.join(map(str, can))}"
                    if can
                    else "no micro-batch can"
                )
            )
        return fault

    def pairs(self, plan: Plan, *, overlap: bool) -> list[tuple[Step, Step]]:
        """Every (first, second) pair of consecutive sends on the channel that can be swapped
        without a deadlock, in plan order."""
        rank = self.rank or 0
        return [
            (a, b)
            for a, b in consecutive_sends(plan, rank, self.channel or "F")
            if not (
                self.step == 0
                and (is_stream_first(plan, a, False) or is_stream_first(plan, b, False))
            )
            and finishes(plan, rank, a, before=b, overlap=overlap)
        ]

    def pair(self, plan: Plan, *, overlap: bool) -> tuple[Step, Step]:
        """(first, second): the first runs right after the second."""
        return _of_microbatch(self.pairs(plan, overlap=overlap), self.microbatch)

    def describe(self, plan: Plan, *, overlap: bool = False) -> str:
        a, b = self.pair(plan, overlap=overlap)
        return (
            f"swap-order: rank {self.rank} runs {format_step(b)} before {format_step(a)} at step "
            f"{self.step}, each message under the other's tag: rank {peer_of(plan, a)} receives "
            f"{format_step(b)}'s tensor as {format_step(a)}'s and the other way round"
        )


@dataclass(frozen=True)
class Deadlock(Fault):
    KIND = "deadlock"
    HANGS = True
    ENDS_RUN = True

    peer: int | None = None
    """The neighbour it deadlocks with. Default: rank + 1, with rank (P-1)//2; another
    neighbouring pair when that one cannot deadlock the plan."""
    microbatch: int | None = None
    """The micro-batch of the held send (default: the first whose hold deadlocks)."""

    def resolve(self, where: FaultTarget) -> Fault:
        plan = where.plan
        num_ranks = plan.num_ranks
        if num_ranks < 2:
            raise self.error("a deadlock needs two ranks (--ranks >= 2)")
        for key in ("rank", "peer"):
            if getattr(self, key) is not None:
                _check_range(self, key, getattr(self, key), num_ranks, f"--ranks {num_ranks}")
        # Defaults: the middle pair of neighbours, (P-1)//2 holding a send to the next rank;
        # when that pair cannot deadlock this plan, the other direction, then the rank before.
        if self.rank is not None:
            rank = self.rank
            tries = (
                [(rank, self.peer)]
                if self.peer is not None
                else [(rank, rank + 1), (rank, rank - 1)]
            )
        elif self.peer is not None:
            tries = [(self.peer - 1, self.peer), (self.peer + 1, self.peer)]
        else:
            low = (num_ranks - 1) // 2
            tries = [(low, low + 1), (low + 1, low), (low, low - 1), (low - 1, low)]
        tries = [(r, p) for r, p in tries if 0 <= r < num_ranks and 0 <= p < num_ranks] or tries[:1]
        fault: Deadlock = self
        for rank, peer in tries:
            fault = dataclasses.replace(
                Fault.resolve(dataclasses.replace(self, rank=rank), where), peer=peer
            )
            _check_range(fault, "peer", peer, num_ranks, f"--ranks {num_ranks}")
            if peer == rank:
                raise fault.error("peer must be another rank than rank")
            if fault.holds(plan, overlap=where.overlap):
                break
        holds = fault.holds(plan, overlap=where.overlap)
        rank, peer = fault.rank, fault.peer
        if not holds:
            if not sends_to(plan, rank or 0, peer or 0):
                raise fault.error(
                    f"rank {rank} sends nothing to rank {peer} in {plan.name}; peer= must be a "
                    "neighbour it sends to"
                )
            raise fault.error(
                f"no send of rank {rank} to rank {peer} deadlocks {plan.name} "
                f"({_mode(where.overlap)}) when held back; try another peer= or rank="
            )
        if self.microbatch is not None:
            chosen = [h for h in holds if h[0].microbatch == self.microbatch]
            if not chosen:
                can = sorted({h[0].microbatch for h in holds})
                raise fault.error(
                    f"holding rank {rank}'s send of micro-batch {self.microbatch} to rank {peer} "
                    f"does not deadlock {plan.name}; microbatch= can be {', '.join(map(str, can))}"
                )
            return fault
        return dataclasses.replace(fault, microbatch=holds[0][0].microbatch)

    def holds(self, plan: Plan, *, overlap: bool) -> list[tuple[Step, Step]]:
        """Every (held send, the recv from the peer it waits for) that deadlocks, in plan order."""
        rank, peer = self.rank or 0, self.peer or 0
        steps = plan.steps(rank)
        sends = sends_to(plan, rank, peer)
        out = []
        for i, send in enumerate(steps):
            if send not in sends:
                continue
            recv = next(
                (
                    s
                    for s in steps[i + 1 :]
                    if s.kind in (StepKind.RECV_F, StepKind.RECV_B) and peer_of(plan, s) == peer
                ),
                None,
            )
            if recv is not None and not finishes(plan, rank, send, after=recv, overlap=overlap):
                out.append((send, recv))
        return out

    def hold(self, plan: Plan, *, overlap: bool) -> tuple[Step, Step]:
        """(held send, the recv it waits for) of the fault's micro-batch."""
        return _of_microbatch(self.holds(plan, overlap=overlap), self.microbatch)

    def describe(self, plan: Plan, *, overlap: bool = False) -> str:
        send, recv = self.hold(plan, overlap=overlap)
        return (
            f"deadlock: rank {self.rank} runs {format_step(send)} only once {format_step(recv)} "
            f"(from rank {self.peer}) has completed, at step {self.step}; rank {self.peer} sends "
            "that only after it"
        )


FAULT_KINDS: dict[str, type[Fault]] = {
    cls.KIND: cls
    for cls in (
        Crash,
        Hang,
        Deadlock,
        DropRecv,
        DropSend,
        ExtraSend,
        ShapeMismatch,
        SwapOrder,
        Straggler,
        SlowLink,
    )
}


def _format_value(value: object) -> str:
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# -- checking against a run --------------------------------------------------------------


def _check_range(fault: Fault, key: str, value: int, limit: int, why: str) -> None:
    if not 0 <= value < limit:
        raise fault.error(f"{key} must be 0..{limit - 1} ({why}), got {value}")


def _microbatch(fault: Fault, plan: Plan) -> int:
    given = fault.microbatch
    mb = min(1, plan.num_microbatches - 1) if given is None else given
    _check_range(
        fault, "microbatch", mb, plan.num_microbatches, f"--microbatches {plan.num_microbatches}"
    )
    return mb


def _of_microbatch(pairs: list[tuple[Step, Step]], mb: int | None) -> tuple[Step, Step]:
    """The first pair whose first step is of micro-batch ``mb``."""
    return next(pair for pair in pairs if pair[0].microbatch == mb)


def _mode(overlap: bool) -> str:
    return "overlapped P2P" if overlap else "plain P2P"


def _smaller(shape: tuple[int, ...]) -> tuple[int, ...]:
    if shape[0] > 1:
        return ((shape[0] + 1) // 2, *shape[1:])
    return (*shape[:-1], max(1, shape[-1] // 2)) if shape[-1] > 1 else (*shape, 0)
