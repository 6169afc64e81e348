"""Runs one rank's plan, step by step, for one iteration at a time.

The plan is compiled once into a list of (position, step, handler): the per-step cost is a
tuple unpack, a call, and the two recorder hooks (no-ops with `NullRecorder`). Handlers are
looked up by step kind, and `register_custom_function` replaces one.

Data moves between steps through four mailboxes keyed by (stage, micro-batch): a stage's
input activation, its output activation waiting for SEND_F, the gradient of its output, and
its input gradient waiting for SEND_B. When the neighbouring stage lives on the same rank (the
turn of a V placement) the producing step fills the consumer's mailbox directly and the plan
holds no message for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from operator import add
from typing import TYPE_CHECKING, Any, Protocol

from pipetrace.recorder.hooks import NullRecorder, RecorderHooks, sample_counts
from pipetrace.runtime import fsdp
from pipetrace.runtime.config import CustomFunction
from pipetrace.runtime.recv_ahead import RecvAhead
from pipetrace.schedule.ir import COLLECTIVE_KINDS, SEND_KINDS, Plan, Step, StepKind

if TYPE_CHECKING:
    import torch

    from pipetrace.runtime.activation_swap import SwapSteps
    from pipetrace.runtime.backend import Stage
    from pipetrace.runtime.p2p import P2P

MEMORY_NEUTRAL = SEND_KINDS | COLLECTIVE_KINDS
"""Steps that change no value of a memory sample: they keep or release no activation and
fill or empty no mailbox (a sent tensor is not counted)."""


Handler = Callable[[int, Step], "int | None"]
"""(position in the rank's plan, step) -> None, or the bytes an activation swap launch copies
(recorded with the step)."""
Entry = tuple[int, Step, Handler]
"""A step of the rank's program: (position, step, its handler)."""


class FrameworkOps(Protocol):
    """The little the executor needs from a framework besides its stages and its P2P; every
    `pipetrace.runtime.backend.Backend` is one."""

    @property
    def pending_type(self) -> type:
        """The class of the posted-recv handles that the P2P returns in overlap mode."""

    def mean_loss(self, losses: Iterable[Any]) -> float:
        """The mean of the last stage's micro-batch losses, as a float."""

    def thread_initializer(self) -> Callable[[], None]:
        """Called on the main thread when the overlap thread is made; what it returns runs
        once on that thread (per-thread framework state, e.g. torch's thread count)."""

    def fsdp_steps(self, stages: dict[int, Any]) -> fsdp.FsdpSteps:
        """The handlers of UNSHARD / RESHARD / REDUCE_GRAD (no-ops without sharded stages)."""

    def grad_base(self, param: Any) -> Any:
        """What ``param``'s gradient holds as an iteration starts, for `sum_with_peer`."""

    def sum_with_peer(self, param: Any, peer: int, base: Any) -> None:
        """TIED_REDUCE: add rank ``peer``'s gradient of its copy of ``param`` since ``base``
        (`grad_base` at the iteration's start) to this rank's."""

    def allocator_bytes(self) -> tuple[int, int] | None:
        """(allocated, reserved) bytes of the device allocator; None without one (CPU)."""

    def swap_steps(self) -> SwapSteps:
        """The handlers of the activation swap steps (asked for only by plans that hold
        them; `pipetrace.runtime.activation_swap`)."""


@dataclass
class StepContext:
    """What a custom step function sees; updated in place at each iteration.

    ``default(step)`` runs the built-in handler, for functions that wrap rather than replace.
    """

    plan: Plan
    """The whole schedule (all ranks)."""
    rank: int
    """This rank's index in the plan."""
    stages: dict[int, Stage]
    """The stages this rank holds, by stage index."""
    default: Callable[[Step], None]
    """Runs the built-in handler for a step."""
    position: int = -1
    """The position of the current step in this rank's plan (bubbles excluded)."""
    iteration: int = -1
    """The current iteration, from 0."""
    inputs: Sequence[torch.Tensor] = ()
    """This iteration's micro-batch inputs (used by stage 0)."""
    targets: Sequence[torch.Tensor] | None = None
    """This iteration's micro-batch targets (used by the last stage's loss)."""
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    """Micro-batch -> loss, filled as the last stage's forwards run (on its rank only)."""


class Executor:
    """Executes ``plan.ranks[rank]`` over the given stages.

    ``p2p`` may be None when the plan holds no messages for this rank (e.g. one rank).
    ``ops`` are the framework's few operations the executor needs (default: the torch
    backend's). ``tied`` maps the first and the last stage, those of them this rank holds, to
    the parameter they share (needed when the plan has TIED_REDUCE steps).
    """

    def __init__(
        self,
        *,
        plan: Plan,
        rank: int,
        stages: dict[int, Stage],
        p2p: P2P | None,
        recorder: RecorderHooks | None = None,
        ops: FrameworkOps | None = None,
        tied: dict[int, Any] | None = None,
    ) -> None:
        expected = set(plan.stages_of(rank))
        if set(stages) != expected:
            raise ValueError(f"rank {rank} holds stages {sorted(expected)}, got {sorted(stages)}")
        self.plan = plan
        self.rank = rank
        self.stages = stages
        self.p2p = p2p
        self.recorder: RecorderHooks = recorder if recorder is not None else NullRecorder()
        if ops is None:
            from pipetrace.runtime.torch_backend import TorchBackend

            ops = TorchBackend()
        self._ops: FrameworkOps = ops
        self._pending = self._ops.pending_type
        self._placement = plan.placement
        self._last_stage = plan.num_stages - 1
        self._loss_scale = 1.0 / plan.num_microbatches
        self._fsdp = self._ops.fsdp_steps(stages)
        self._builtin = self._builtin_handlers()
        self._steps = plan.steps(rank)
        self._swap: SwapSteps | None = None
        self._capturing: dict[tuple[int, int], Any] = {}  # swap groups whose forward is next
        if any(step.is_swap for step in self._steps):
            self._swap = self._ops.swap_steps()
            self._capturing = self._swap.capturing
            self._builtin.update(self._swap.handlers())
        self._handlers = dict(self._builtin)
        self.context = StepContext(plan, rank, stages, self._run_default)
        if self._last_stage in stages:
            self.context.losses = stages[self._last_stage].losses
        self._tied = tied or {}
        self._tied_base: dict[int, Any] = {}  # stage -> `Ops.grad_base` at iteration start
        self._check_needs()
        self._program: list[Entry] = []
        self._compile()
        # Recvs posted one message ahead where the transport matches by tag (gloo).
        self._ahead: RecvAhead | None = None
        if getattr(p2p, "tag_matched", False):
            self._ahead = RecvAhead.of(self._steps, plan.placement)
        self._step_order: Callable[[int], Sequence[int] | None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._iteration = -1
        self._failed: BaseException | None = None
        # Mailboxes, keyed by (stage, micro-batch); values may be PendingRecv in overlap mode.
        self._act_in: dict[tuple[int, int], Any] = {}
        self._act_out: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_in: dict[tuple[int, int], Any] = {}
        self._grad_out: dict[tuple[int, int], torch.Tensor] = {}
        self._init_memory_sampling()

    def _init_memory_sampling(self) -> None:
        # stage index -> its slot in a memory sample (plan order)
        self._memory_slots = {s: i for i, s in enumerate(self.plan.stages_of(self.rank))}
        # per slot, its stage's bytes held for each micro-batch's backward (`held_bytes`)
        self._held = [self.stages[s].held_bytes for s in self._memory_slots]
        for s, stage in self.stages.items():  # fed over P2P: its streams' shapes are fixed
            stage.input_fixed = s > 0 and self._placement[s - 1] != self.rank
        # Per slot, the bytes in `_act_in` and in `_grad_in`, kept as the mailboxes fill and
        # empty while the stages count (a sample then reads them instead of scanning the
        # mailboxes). Two lists: an overlapped pair's forward (activations) and backward
        # (gradients) update them from two threads, each only its own.
        self._act_bytes = [0] * len(self._memory_slots)
        self._grad_bytes = [0] * len(self._memory_slots)
        # The bytes of each local hand-off in `_act_in` and `_grad_in` (same keys), read from
        # the tensor when it is handed on, not again when it is taken.
        self._handed_act: dict[tuple[int, int], int] = {}
        self._handed_grad: dict[tuple[int, int], int] = {}
        # Received message bytes per (channel, receiving stage): a P2P buffer is made from
        # its stream's shape and dtype, fixed for the runner's life, so its size is read from
        # a tensor once, not at each recv and consumption (a call into the framework each).
        self._received_bytes: dict[tuple[str, int], int] = {}
        # Set by `_memory_sampler` at each iteration's start:
        self._counting = False  # whether the stages count what they save
        self._sampled = False  # whether an earlier iteration sampled memory
        self._reads_allocator = False  # whether the device has an allocator to read
        self._unsampled: frozenset[StepKind] = frozenset()  # kinds not followed by a sample
        self._watched = False  # whether the sample is the recorder's `memory_watch`

    def _builtin_handlers(self) -> dict[StepKind, Handler]:
        return {
            StepKind.F: self._forward,
            StepKind.B: self._backward,
            StepKind.I: self._backward_input,
            StepKind.W: self._backward_weight,
            StepKind.SEND_F: self._send_f,
            StepKind.SEND_B: self._send_b,
            StepKind.RECV_F: self._recv_f,
            StepKind.RECV_B: self._recv_b,
            StepKind.UNSHARD: self._fsdp.unshard,
            StepKind.RESHARD: self._fsdp.reshard,
            StepKind.REDUCE_GRAD: self._fsdp.reduce_grad,
            StepKind.OVERLAP_F_B: self._overlap,
            StepKind.OVERLAP_B_F: self._overlap,
            StepKind.TIED_REDUCE: self._tied_reduce,
        }

    def _check_needs(self) -> None:
        """The plan's messages need a P2P, its TIED_REDUCE steps their tied parameters."""
        if self.p2p is None and any(step.is_comm for step in self._steps):
            raise ValueError(f"rank {self.rank}'s plan sends or receives messages: it needs a P2P")
        untied = {s.stage for s in self._steps if s.kind is StepKind.TIED_REDUCE} - set(self._tied)
        if untied:
            raise ValueError(f"rank {self.rank}'s plan has TIED_REDUCE for stages {sorted(untied)}")

    # -- configuration ---------------------------------------------------------------------

    def register_custom_function(self, kind: StepKind | str, fn: CustomFunction) -> None:
        """Run ``fn(step, context)`` instead of the built-in handler for every step of
        ``kind`` (sub-steps of OVERLAP_F_B and OVERLAP_B_F composites included). A function
        for RECV_F or RECV_B turns off posting recvs ahead (`recv_ahead`): it may receive by
        itself, so every recv is posted at its step."""
        context = self.context

        def handler(position: int, step: Step) -> None:
            context.position = position
            fn(step, context)

        self._handlers[StepKind(kind)] = handler
        if StepKind(kind) in (StepKind.RECV_F, StepKind.RECV_B):
            self._ahead = None
        self._compile()

    def set_step_order(self, order: Callable[[int], Sequence[int] | None] | None) -> None:
        """Fault injection only (`pipetrace.runtime.inject`): ``order(iteration)`` returns the
        plan positions in the order to run them in that iteration, or None for the plan's
        order. The recorder sees each step with its plan position, as it ran."""
        self._step_order = order

    def post_recvs_at_steps(self) -> None:
        """Fault injection only: post every recv at its own step, none ahead, so that an
        injected message fault blocks a send exactly as the plan's order makes it."""
        self._ahead = None

    def _compile(self) -> None:
        handlers = self._handlers
        self._program = [
            (position, step, handlers[step.kind]) for position, step in enumerate(self._steps)
        ]

    def _run_default(self, step: Step) -> None:
        self._builtin[step.kind](self.context.position, step)

    # -- one iteration ---------------------------------------------------------------------

    def run_iteration(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor] | None,
    ) -> float | None:
        """Run this rank's plan once; returns the mean micro-batch loss on the rank holding
        the last stage, None elsewhere. Gradients accumulate into ``param.grad``.

        After a failed iteration the executor refuses to run again: its mailboxes, its
        in-flight messages and its peers are in unknown states.
        """
        if self._failed is not None:
            raise RuntimeError(
                f"rank {self.rank}: iteration {self._iteration} failed "
                f"({type(self._failed).__name__}); build a new runner"
            )
        self._iteration += 1
        context = self.context
        context.iteration = self._iteration
        context.inputs = inputs
        context.targets = targets
        recorder = self.recorder
        recorder.begin_iteration(self._iteration)
        for stage in self.stages.values():
            stage.reset()
        self._fsdp.begin_iteration()
        # what the tied gradients held before this iteration: only its part is exchanged
        self._tied_base = {s: self._ops.grad_base(p) for s, p in self._tied.items()}
        if self._swap is not None:
            self._swap.begin_iteration()
        if self.p2p is not None:
            self.p2p.begin_iteration()
        if self._ahead is not None:
            self._ahead.begin_iteration(self.p2p)
        sample = self._memory_sampler()
        program = self._program
        if (
            self._step_order is not None
            and (order := self._step_order(self._iteration)) is not None
        ):
            program = [program[position] for position in order]
        turn = getattr(recorder, "next_step", None)
        try:
            if turn is not None and (sample is None or self._watched):
                self._run_turns(program, turn, sample)
            else:
                self._run_steps(program, sample)
            if self.p2p is not None:
                self.p2p.drain()
            self._check_finished()
        except BaseException as exc:
            self._failed = exc
            raise
        losses = context.losses
        loss = self._ops.mean_loss(losses.values()) if losses else None
        recorder.end_iteration(self._iteration, loss)
        return loss

    def _run_steps(self, program: list[Entry], sample: Callable[[Any], None] | None) -> None:
        """The steps of ``program`` in order, each between the recorder's `begin_step` and
        `end_step`, and ``sample`` after each whose kind may change memory."""
        begin, end = self.recorder.begin_step, self.recorder.end_step
        unsampled = self._unsampled
        for position, step, handler in program:
            token = begin(position, step)
            moved = handler(position, step)
            if moved is None:
                end(token)
            else:  # an activation swap launch: the bytes it copies go with the step
                end(token, moved)
            if sample is not None and step.kind not in unsampled:
                sample(token)

    def _run_turns(
        self, program: list[Entry], turn: Callable[..., Any], sample: Callable[[Any], None] | None
    ) -> None:
        """`_run_steps` with one call into the recorder between two steps (its `next_step`:
        the end, the sample of the counts it watches, the next begin), for a recorder that
        has it and samples memory, if at all, through `memory_watch`."""
        end = self.recorder.end_step
        unsampled = self._unsampled
        token, sampled = None, False
        for position, step, handler in program:
            token = turn(token, sampled, position, step)
            moved = handler(position, step)
            sampled = sample is not None and step.kind not in unsampled
            if moved is not None:  # an activation swap launch: the bytes it copies go with it
                end(token, moved)
                if sampled:
                    sample(token)
                token = None
        if token is not None:
            end(token)
            if sampled:
                sample(token)

    def _check_finished(self) -> None:
        leftovers = {
            "received activations never used": self._act_in,
            "activations never sent": self._act_out,
            "received gradients never used": self._grad_in,
            "gradients never sent": self._grad_out,
            "recvs posted ahead never used": {} if self._ahead is None else self._ahead.posted,
        }
        problems = [f"{what}: {sorted(box)}" for what, box in leftovers.items() if box]
        problems += [
            f"stage {s} has {stage.pending()} micro-batch(es) without a finished backward"
            for s, stage in self.stages.items()
            if stage.pending()
        ]
        if self._swap is not None and self._swap.unfinished():
            problems.append(f"swap groups never loaded back: {self._swap.unfinished()}")
        if problems:
            raise RuntimeError(
                f"rank {self.rank}: the plan left work unfinished after iteration "
                f"{self._iteration}: " + "; ".join(problems)
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._swap is not None:
            self._swap.close()

    def _memory_sampler(self) -> Callable[[Any], None] | None:
        """What takes a memory sample after each step of this iteration, given the step's
        token (None: nothing): the recorder's watch of the counts the executor keeps (the
        stages' held bytes, the mailboxes' bytes), or `_sample_memory` with swap steps or a
        device allocator to read. Asked of the recorder at each iteration's start, so that
        a recorder switched on and off between iterations (bench/bench_recorder.py) costs
        nothing while off: the stages count what they save only while memory is sampled.

        The recorder writes a sample only when it differs from the one before, and the
        steps of `MEMORY_NEUTRAL` kinds change none of its values; so after the run's first
        sample they are not sampled at all (a third of the demo's samples, each costing
        more than a step's events), unless the device's allocator is read (its bytes may
        move at any step) or swap steps move activations in the background."""
        records = bool(getattr(self.recorder, "records_memory", False))
        if records != self._counting:
            self._counting = records
            for stage in self.stages.values():
                stage.count_saved = records
            if records:
                self._count_mailboxes()
        if not records:
            return None
        self._reads_allocator = self._ops.allocator_bytes() is not None
        every_step = self._reads_allocator or self._swap is not None or not self._sampled
        self._unsampled = frozenset() if every_step else MEMORY_NEUTRAL
        self._sampled = True
        self._watched = False
        if self._swap is not None or self._reads_allocator:
            return self._sample_memory
        counts = (self._held, self._act_bytes, self._grad_bytes)
        watch = getattr(self.recorder, "memory_watch", None)
        if watch is None:  # a recorder without its own: the lists made here
            return partial(sample_counts, self.recorder.memory_sample, *counts)
        self._watched = True
        return watch(*counts)

    def _count_mailboxes(self) -> None:
        """The mailboxes' bytes per slot, counted afresh (counting starts: from here on
        they are kept up to date as the mailboxes fill and empty)."""
        slots = self._memory_slots
        self._handed_act.clear()  # a hand-off not in them is read from its tensor
        self._handed_grad.clear()
        for box, counts in ((self._act_in, self._act_bytes), (self._grad_in, self._grad_bytes)):
            counts[:] = [0] * len(slots)
            for (stage, _), value in list(box.items()):
                if value is not None:
                    counts[slots[stage]] += value.nbytes

    def _sample_memory(self, token: Any) -> None:
        """The recorder's ``memory`` sample after the step of ``token`` when swap steps or
        a device allocator add to it: per stage, the activations kept for backward on the
        device (less what swap steps offloaded to the host), the received tensors not yet
        consumed (the mailboxes' counts), the offloaded bytes, the allocator's bytes."""
        saved = list(map(sum, map(dict.values, self._held)))
        inflight = list(map(add, self._act_bytes, self._grad_bytes))
        swapped = None
        if self._swap is not None:
            on_host = self._swap.swapped_bytes()
            swapped = [on_host.get(stage, 0) for stage in self._memory_slots]
            saved = [kept - away for kept, away in zip(saved, swapped)]
        allocator = self._ops.allocator_bytes() if self._reads_allocator else None
        self.recorder.memory_sample(token, saved, inflight, allocator, swapped)

    # -- compute ---------------------------------------------------------------------------

    def _forward(self, position: int, step: Step) -> None:
        s, mb = step.stage, step.microbatch
        stage = self.stages[s]
        if self._fsdp.pending:
            self._fsdp.wait_unshard(s)
        if s == 0:
            x = self.context.inputs[mb]
        else:
            key = (s, mb)
            x = self._act_in.pop(key)
            if self._counting:
                n = self._handed_act.pop(key, None)
                if n is None:
                    n = self._received_bytes.get(("F", s)) or x.nbytes
                self._act_bytes[self._memory_slots[s]] -= n
            if type(x) is self._pending:
                x = x.wait()
        hooks = self._capturing.pop((s, mb), None) if self._capturing else None
        if hooks is None:
            out = self._stage_forward(stage, s, mb, x)
        else:  # a swapped micro-batch: autograd saves into its swap group
            with hooks:
                out = self._stage_forward(stage, s, mb, x)
            self._keep_resident(s, mb, x, out)
        if out is None:
            return
        if self._placement[s + 1] == self.rank:
            key = (s + 1, mb)
            self._act_in[key] = out
            if self._counting:
                n = self._handed_act[key] = out.nbytes
                self._act_bytes[self._memory_slots[s + 1]] += n
        else:
            self._act_out[(s, mb)] = out

    def _keep_resident(self, s: int, mb: int, x: Any, out: Any) -> None:
        """Tell the swap group what the rank holds until the backward anyway: the input, the
        output, the target of the last stage (copying them would free nothing)."""
        targets = self.context.targets if s == self._last_stage else None
        assert self._swap is not None
        self._swap.keep(s, mb, (x, out, None if targets is None else targets[mb]))

    def _stage_forward(self, stage: Stage, s: int, mb: int, x: Any) -> Any:
        """The stage's forward; None on the last stage (its loss stays with the stage)."""
        if s == self._last_stage:
            targets = self.context.targets
            stage.forward(mb, x, None if targets is None else targets[mb], self._loss_scale)
            return None
        return stage.forward(mb, x)

    def _output_grad(self, s: int, mb: int) -> torch.Tensor | None:
        if s == self._last_stage:
            return None
        key = (s, mb)
        grad = self._grad_in.pop(key)
        if self._counting and grad is not None:
            n = self._handed_grad.pop(key, None)
            if n is None:
                n = self._received_bytes.get(("B", s)) or grad.nbytes
            self._grad_bytes[self._memory_slots[s]] -= n
        if type(grad) is self._pending:
            grad = grad.wait()
        return grad

    def _pass_input_grad(self, s: int, mb: int, dx: torch.Tensor | None) -> None:
        if s == 0:
            return
        if self._placement[s - 1] == self.rank:
            key = (s - 1, mb)
            self._grad_in[key] = dx
            if self._counting and dx is not None:
                n = self._handed_grad[key] = dx.nbytes
                self._grad_bytes[self._memory_slots[s - 1]] += n
        else:
            self._grad_out[(s, mb)] = dx  # type: ignore[assignment]

    def _backward(self, position: int, step: Step) -> None:
        self._input_gradient(step, full=True)

    def _backward_input(self, position: int, step: Step) -> None:
        self._input_gradient(step, full=False)

    def _input_gradient(self, step: Step, *, full: bool) -> None:
        """B (``full``: dx and dw) or I (dx only) of one micro-batch; dx goes on."""
        s, mb = step.stage, step.microbatch
        if self._fsdp.pending:
            self._fsdp.wait_unshard(s)
        stage = self.stages[s]
        run = stage.backward if full else stage.backward_input
        self._pass_input_grad(s, mb, run(mb, self._output_grad(s, mb)))

    def _backward_weight(self, position: int, step: Step) -> None:
        if self._fsdp.pending:
            self._fsdp.wait_unshard(step.stage)
        self.stages[step.stage].backward_weight(step.microbatch)

    def _overlap(self, position: int, step: Step) -> None:
        """OVERLAP_F_B and OVERLAP_B_F: the forward on this thread, the backward on a worker
        thread (B, or an OVERLAP_B_F's I then W, one after the other), joined."""
        forward = next(sub for sub in step.sub_steps if sub.kind is StepKind.F)
        backward = tuple(sub for sub in step.sub_steps if sub is not forward)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                1,
                thread_name_prefix=f"pipetrace-overlap-r{self.rank}",
                initializer=self._ops.thread_initializer(),
            )
        future = self._pool.submit(self._sub_steps, position, backward, "overlap")
        try:
            self._sub_step(position, forward, "main")
        finally:
            backward_error = future.exception()
        if backward_error is not None:
            raise backward_error

    def _sub_steps(self, position: int, steps: tuple[Step, ...], thread: str) -> None:
        for step in steps:
            self._sub_step(position, step, thread)

    def _sub_step(self, position: int, step: Step, thread: str) -> None:
        token = self.recorder.begin_step(position, step, thread)
        self._handlers[step.kind](position, step)
        self.recorder.end_step(token)

    def _tied_reduce(self, position: int, step: Step) -> None:
        """Sum the tied parameter's gradient with the other tied stage's rank. Sends still in
        flight are waited first: the peer may need them to reach its own TIED_REDUCE."""
        partner = self._last_stage if step.stage == 0 else 0
        peer = self._placement[partner]
        if peer == self.rank:
            return  # both stages here: they share one parameter, autograd summed it
        if self.p2p is not None:
            self.p2p.drain()
        stage = step.stage
        self._ops.sum_with_peer(self._tied[stage], peer, self._tied_base[stage])  # type: ignore[index]

    # -- messages --------------------------------------------------------------------------

    def _send_f(self, position: int, step: Step) -> None:
        s = step.stage
        tensor = self._act_out.pop((s, step.microbatch))
        self.p2p.send(step, tensor, peer=self._placement[s + 1], channel="F")  # type: ignore[union-attr]

    def _send_b(self, position: int, step: Step) -> None:
        s = step.stage
        tensor = self._grad_out.pop((s, step.microbatch))
        self.p2p.send(step, tensor, peer=self._placement[s - 1], channel="B")  # type: ignore[union-attr]

    def _recv_f(self, position: int, step: Step) -> None:
        s = step.stage
        peer = self._placement[s - 1]
        received = self._act_in[(s, step.microbatch)] = self._receive(
            position, step, peer, "F", s - 1
        )
        if self._counting:
            self._act_bytes[self._memory_slots[s]] += self._received_size("F", s, received)

    def _recv_b(self, position: int, step: Step) -> None:
        s = step.stage
        peer = self._placement[s + 1]
        received = self._grad_in[(s, step.microbatch)] = self._receive(
            position, step, peer, "B", s + 1
        )
        if self._counting:
            self._grad_bytes[self._memory_slots[s]] += self._received_size("B", s, received)

    def _received_size(self, channel: str, s: int, received: Any) -> int:
        """The bytes of a message received for stage ``s`` on ``channel`` (the same for
        every message of the stream: `_received_bytes`)."""
        key = (channel, s)
        size = self._received_bytes.get(key)
        if size is None:
            size = self._received_bytes[key] = received.nbytes
        return size

    def _receive(self, position: int, step: Step, peer: int, channel: str, src: int) -> Any:
        """The message of a RECV step: the tensor (plain mode, waited here) or a pending recv
        (overlap mode, waited by its consumer). With `RecvAhead`, the recv was posted one
        message earlier, or is posted here before the next one of its (peer, channel)."""
        p2p = self.p2p
        ahead = self._ahead
        if ahead is None:
            return p2p.recv(step, peer=peer, channel=channel, src_stage=src)  # type: ignore[union-attr]
        early = ahead.take(position, p2p)
        if early is None:
            early = p2p.recv_early(step, peer=peer, channel=channel, src_stage=src)  # type: ignore[union-attr]
            if early is None:  # the stream's first message: its shape comes first
                received = p2p.recv(step, peer=peer, channel=channel, src_stage=src)  # type: ignore[union-attr]
                ahead.posted_at_step(position, p2p)
                return received
            ahead.posted_at_step(position, p2p)
        return p2p.received_early(early, step, peer, channel)  # type: ignore[union-attr]
