"""Applying injected faults (`pipetrace.runtime.faults`) on a rank, as wrappers.

Three places:

- compute faults (crash, hang, straggler) wrap the executor's step handlers
  (`PipelineRunner.register_custom_function`);
- faults that run the rank's steps in another order (deadlock, swap-order) give the
  executor a step order for their iteration (`Executor.set_step_order`): the recording shows
  each step with its plan position, in the order it ran;
- message faults wrap the rank's `P2P` (`FaultyP2P` replaces ``executor.p2p``), which sees
  every tensor sent and every recv posted, and put the odd message on the wire through
  `P2P.send`'s ``wire`` argument: what the recorder sees is what went on the wire.

Faults fire only on their rank and at their step (iteration); a resolved fault names
everything (see `faults.Fault.resolve`), and its targets are recomputed here from the plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pipetrace.runtime.fault_plan import StepOrder, waited_at
from pipetrace.runtime.faults import (
    NOBODY_MICROBATCH,
    Crash,
    Deadlock,
    DropRecv,
    DropSend,
    ExtraSend,
    Fault,
    Hang,
    ShapeMismatch,
    SlowLink,
    Straggler,
    SwapOrder,
)
from pipetrace.runtime.p2p import P2P, PendingRecv, WireFault
from pipetrace.schedule.ir import Plan, Step, StepKind

if TYPE_CHECKING:
    from pipetrace.runtime.api import PipelineRunner
    from pipetrace.runtime.executor import StepContext


def install_faults(runner: PipelineRunner, faults: tuple[Fault, ...], *, overlap: bool) -> None:
    """Arm the faults of ``runner``'s rank (resolved faults; others are ignored).

    Step-kind handlers registered here replace custom functions of the same kinds.
    """
    rank, plan = runner.rank, runner.plan
    # Every rank of a run with faults posts its recvs at their steps (none ahead): a fault
    # then blocks the peers' sends exactly where the plan's order makes it block them.
    runner.executor.post_recvs_at_steps()
    mine = [f for f in faults if f.rank == rank]
    if not mine:
        return
    hooks: dict[StepKind, _StepHooks] = {}

    def on(kind: StepKind) -> _StepHooks:
        return hooks.setdefault(kind, _StepHooks())

    for fault in mine:
        if isinstance(fault, (Crash, Hang)):
            on(fault.target(plan).kind).before.append(_Strike(fault, fault.target(plan)))
        elif isinstance(fault, Straggler):
            slow = _Slow(fault)
            for kind in fault.kinds:
                on(kind).after.append(slow)
    for kind, hook in hooks.items():
        runner.register_custom_function(kind, hook)
    executor = runner.executor
    reorder = StepOrder(plan.steps(rank))
    for fault in mine:
        if isinstance(fault, Deadlock):
            send, recv = fault.hold(plan, overlap=overlap)
            reorder.move(fault.step or 0, send, after=waited_at(plan.steps(rank), recv, overlap))
        elif isinstance(fault, SwapOrder):
            first, second = fault.pair(plan, overlap=overlap)
            reorder.move(fault.step or 0, first, after=second)
    if reorder.moves:
        executor.set_step_order(reorder)
    wire = [
        f
        for f in mine
        if isinstance(f, (SlowLink, DropRecv, DropSend, ExtraSend, ShapeMismatch, SwapOrder))
    ]
    if wire and executor.p2p is not None:
        executor.p2p = FaultyP2P(executor.p2p, executor.context, plan, wire, overlap=overlap)  # type: ignore[assignment]


# -- step handlers -------------------------------------------------------------------------


class _StepHooks:
    """The handler of one step kind: ``before`` hooks may take the step over (return True:
    the built-in handler does not run), ``after`` hooks see its duration."""

    def __init__(self) -> None:
        self.before: list[Callable[[Step, StepContext], bool]] = []
        self.after: list[Callable[[Step, StepContext, float], None]] = []

    def __call__(self, step: Step, ctx: StepContext) -> None:
        skip = False
        for hook in self.before:
            skip = hook(step, ctx) or skip
        start = time.perf_counter()
        if not skip:
            ctx.default(step)
        elapsed = time.perf_counter() - start
        for after in self.after:
            after(step, ctx, elapsed)


class _Strike:
    """crash / hang: raise, or never return, at the start of the target step."""

    def __init__(self, fault: Crash | Hang, target: Step) -> None:
        self.fault = fault
        self.target = target

    def __call__(self, step: Step, ctx: StepContext) -> bool:
        if step != self.target or ctx.iteration != self.fault.step:
            return False
        if isinstance(self.fault, Crash):
            # the spec names the iteration and the step; analyze adds where the rank was
            raise RuntimeError(f"injected crash (--inject {self.fault.spec})")
        injected_hang()
        return True  # never reached


def injected_hang() -> None:
    """Block the calling thread forever (--inject hang): only the watchdog, a signal or the
    launcher ends the process. Sleeps in slices so that Python signal handlers still run."""
    while True:
        time.sleep(1.0)


class _Slow:
    """straggler: after each step of its kinds, sleep (factor - 1) times the step's duration
    (a sleep, not a busy loop, so that the other ranks sharing the CPU are not slowed)."""

    def __init__(self, fault: Straggler) -> None:
        self.fault = fault
        self.extra = (fault.factor or 1.0) - 1.0

    def __call__(self, step: Step, ctx: StepContext, elapsed: float) -> None:
        if ctx.iteration >= (self.fault.step or 0) and step.kind in self.fault.kinds:
            time.sleep(elapsed * self.extra)


# -- messages ------------------------------------------------------------------------------


class FaultyP2P:
    """A rank's `P2P` with message faults; everything else goes straight through."""

    def __init__(
        self, inner: P2P, context: StepContext, plan: Plan, faults: list[Fault], *, overlap: bool
    ) -> None:
        self.inner = inner
        self.context = context
        self.slow = [f for f in faults if isinstance(f, SlowLink)]
        self.drops = {f.target(plan): f for f in faults if isinstance(f, DropRecv)}
        self.skips = {f.target(plan): f for f in faults if isinstance(f, DropSend)}
        self.extras = {f.target(plan): f for f in faults if isinstance(f, ExtraSend)}
        self.shapes = {f.target(plan): f for f in faults if isinstance(f, ShapeMismatch)}
        # swap-order: the executor runs the pair's sends in swapped order (`StepOrder`); each
        # goes under the other's tag, so the recv posted for the first message takes the
        # second one, as an order-matching transport (NCCL, untagged gloo) would deliver it.
        self.swaps: dict[Step, tuple[SwapOrder, Step]] = {}  # send -> (fault, the other send)
        for f in faults:
            if isinstance(f, SwapOrder):
                first, second = f.pair(plan, overlap=overlap)
                self.swaps[first], self.swaps[second] = (f, second), (f, first)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def begin_iteration(self) -> None:
        self.inner.begin_iteration()

    def drain(self) -> None:
        self.inner.drain()

    def _active(self, fault: Fault | None) -> bool:
        return fault is not None and fault.step == self.context.iteration

    def send(self, step: Step, tensor: torch.Tensor, *, peer: int, channel: str) -> None:
        it = self.context.iteration
        if self._active(self.skips.get(step)):
            return  # nothing posted (nor recorded): the tensor is dropped
        delay = max((f.delay or 0.0 for f in self.slow if it >= (f.step or 0)), default=0.0)
        as_message = None
        swap = self.swaps.get(step)
        if swap is not None and self._active(swap[0]):
            as_message = (swap[1].stage, swap[1].microbatch)
        shape = self.shapes.get(step)
        unchecked = self._active(shape)
        if unchecked:
            tensor = _reshaped(tensor, shape.shape or ())  # type: ignore[union-attr]
        wire = WireFault(as_message, unchecked, delay) if as_message or unchecked or delay else None  # type: ignore[arg-type]
        self.inner.send(step, tensor, peer=peer, channel=channel, wire=wire)
        if self._active(self.extras.get(step)):
            self.inner.send(
                step,
                tensor,
                peer=peer,
                channel=channel,
                wire=WireFault(
                    as_message=(step.stage, NOBODY_MICROBATCH), delay=delay, detached=True
                ),
            )  # type: ignore[arg-type]

    def recv(
        self, step: Step, *, peer: int, channel: str, src_stage: int
    ) -> torch.Tensor | PendingRecv:
        if self._active(self.drops.get(step)):
            meta = self.inner.stream_meta(channel, src_stage)
            if meta is None:
                raise RuntimeError(f"drop-recv: the shape of {step}'s stream is not known yet")
            # nothing is posted (nor recorded): the consumer computes on zeros
            return torch.zeros(meta.shape, dtype=meta.dtype, device=self.inner.device)
        return self.inner.recv(step, peer=peer, channel=channel, src_stage=src_stage)


def _reshaped(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The first elements of ``tensor`` laid out as ``shape`` (no more elements than it has)."""
    count = 1
    for size in shape:
        count *= size
    return tensor.detach().reshape(-1)[:count].reshape(shape).clone()
