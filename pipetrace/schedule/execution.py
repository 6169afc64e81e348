"""One step-by-step executor of a compute+comms plan under a point-to-point semantics.

The verifier runs it to find deadlocks and untagged-matching mix-ups; the simulator runs the
same code with step durations to get a timeline. Keeping one executor means the two tools can
never disagree about when a rank blocks.

Model: every rank walks its steps in order. Compute and FSDP steps never block here (data
dependencies are the verifier's static checks). A SEND or RECV blocks according to the
semantics:

- ``eager``: a send never blocks; a recv blocks until its own tagged message was sent.
- ``rendezvous``: a send blocks until the peer is at the matching recv, and vice versa.
- ``fifo``: no tags. A send to rank q blocks until q is at a recv *from this rank*; the pair
  completes whatever the two steps name (a different identity is a recorded mismatch).

A message is named by its sender's stage and micro-batch; under ``rendezvous`` and ``fifo``
the peer must also be the rank the placement puts at the other end. (A recv on a rank other
than the one its sender targets is a pairing error the verifier reports statically.)

The run is a worklist over ranks: a rank advances until it blocks, and is pushed again only
when a message or a peer's state changes. With no wild-card receives the outcome (who ends
where, and every step's start and end time) does not depend on the worklist order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain
from operator import attrgetter
from typing import TypeVar

import numpy as np

from . import waitfor
from .ir import COLLECTIVE_KINDS, Plan, Step, StepKind, format_step

SEMANTICS = ("eager", "rendezvous", "fifo")

NO_PEER = -1  # a comm step whose peer stage does not exist or has no rank
NOT_COMM = -2  # the peer entry of a step that is not a SEND or RECV

# A simple step's id is ``(stage * mb_stride + microbatch) * 8 + code``: the low three bits
# are its kind, so checks can find a step's neighbours by arithmetic on plain ints.
CODE_F, CODE_B, CODE_I, CODE_W, CODE_RECV_F, CODE_RECV_B, CODE_SEND_F, CODE_SEND_B = range(8)
CODES = {
    StepKind.F: CODE_F,
    StepKind.B: CODE_B,
    StepKind.I: CODE_I,
    StepKind.W: CODE_W,
    StepKind.RECV_F: CODE_RECV_F,
    StepKind.RECV_B: CODE_RECV_B,
    StepKind.SEND_F: CODE_SEND_F,
    StepKind.SEND_B: CODE_SEND_B,
}
_CODE_OF = {kind: CODES.get(kind, -1) for kind in StepKind}  # -1: FSDP and composite steps
# by code: stage offset from a comm step to the stage at the other end of its message
_OTHER_STAGE = np.array([0, 0, 0, 0, -1, 1, 1, -1])

T = TypeVar("T")

_KIND = attrgetter("kind")
_STAGE = attrgetter("stage")
_MICROBATCH = attrgetter("microbatch")


@dataclass(frozen=True, slots=True)
class ProgramArrays:
    """A program's per-step ints concatenated over ranks, with each step's rank and stage as
    written (0 for a step that names none). Int64, or Python ints (dtype object) when an
    index of the plan is too large for int64."""

    ranks: np.ndarray
    ids: np.ndarray
    keys: np.ndarray
    peers: np.ndarray
    stages: np.ndarray


@dataclass(frozen=True, slots=True)
class PlannedTimes:
    """When the lowering's simulation placed each step of the plan it lowered, over every
    step of every rank (as `ProgramArrays`): a compute step's end, either end of a message
    the end of the compute step that produced it. ``costs`` are what it simulated with,
    by kind F, B, I, W. Kept because the eager run of that plan with those costs and
    nothing on the wire ends every step at these times (`planned_outcome`), so the
    simulator need not run it."""

    costs: tuple[float, float, float, float]
    times: np.ndarray


Indices = list[int] | np.ndarray  # stages or micro-batches of every step, as ints

# per rank: step ids to check, and (index, id) of composite leaves (see Program.checked_ids)
Checked = list[tuple[list[int], list[tuple[int, int]]]]


@dataclass(slots=True)
class Program:
    """A plan compiled to flat per-rank int lists, so hot loops touch no Step objects.

    Index ``i`` of a rank's lists is its i-th non-bubble step; ``positions[r][i]`` maps it
    back to ``plan.ranks[r]`` (bubbles included), the convention every report uses.
    ``ids`` are step ids (see ``CODES``; -1 for FSDP and composite steps).

    ``keys`` is -1 for a step that is not a SEND or RECV. The two ends of a message have
    keys ``2 * message`` (send) and ``2 * message + 1`` (recv), where the message is named
    by its sender's step id plus one stage (never negative). ``peers`` is the rank at the
    other end by the plan's placement (``NO_PEER`` when there is none, ``NOT_COMM`` for a
    step that is not a SEND or RECV).

    Callers may set a key to -1 after compiling (a message that is never posted), and the
    executor reads them then. ``arrays`` holds the ids, keys and peers
    over every step of every rank, for checks written as array operations.
    """

    plan: Plan
    mb_stride: int
    steps: list[list[Step]]
    positions: list[Sequence[int]]
    ids: list[list[int]]
    keys: list[list[int]]
    peers: list[list[int]]
    arrays: ProgramArrays
    lowered: bool = False
    """Made by :func:`.lowering.lower` for the plan it made: its rows are projections of
    one global order in which every send directly precedes its recv, so every rank runs to
    the end under every semantics, with no untagged mix-up (see `_runs_through`)."""
    planned: PlannedTimes | None = None
    """Given by :func:`.lowering.lower` with ``lowered`` when every step is simple."""

    def rank_slices(self, flat: list[T]) -> Iterator[list[T]]:
        """A list over every step of every rank (as in ``arrays``) cut into per-rank lists."""
        return _slices(flat, list(accumulate(map(len, self.ids), initial=0)))

    def stages_named(self) -> list[set[int | None]]:
        """Per rank, every stage index its steps and composite leaves name (as written)."""
        counted = self._stages_counted()
        if counted is not None:
            return counted
        result = []
        for steps in self.steps:
            stages = set(map(_STAGE, steps))
            if None in stages:
                stages |= {leaf.stage for s in steps if s.sub_steps for leaf in s.leaves()}
            result.append(stages)
        return result

    def _stages_counted(self) -> list[set[int | None]] | None:
        """`stages_named` with one count over every step's stage, when every step is simple
        (it names exactly its own stage) and every stage is in range; else None."""
        ids, ranks, stage = self.arrays.ids, self.arrays.ranks, self.arrays.stages
        num_stages, num_ranks = self.plan.num_stages, self.plan.num_ranks
        if (
            stage.dtype == object
            or ids.min(initial=0) < 0  # FSDP or composite steps, or micro-batches >= M
            or stage.min(initial=0) < 0
            or stage.max(initial=0) >= num_stages
        ):
            return None
        counts = np.bincount(ranks * num_stages + stage, minlength=num_ranks * num_stages)
        return [set(np.flatnonzero(row).tolist()) for row in counts.reshape(num_ranks, num_stages)]

    def checked_ids(self) -> Checked:
        """Per rank, the ids to check: ``ids`` with out-of-range steps set to -1, and the
        ``(index, id)`` of every in-range composite leaf (its index is the composite's)."""
        S, M, stride = self.plan.num_stages, self.plan.num_microbatches, self.mb_stride
        limit = S * stride * 8
        every = self.arrays.ids  # one check over every step first: nearly every plan passes
        in_range = (
            every.dtype != object
            and stride == M
            and every.min(initial=0) >= -1
            and every.max(initial=-1) < limit
        )
        composites_anywhere = bool((every == -1).any())
        result = []
        for steps, ids in zip(self.steps, self.ids):
            if not in_range and ids and (max(ids) >= limit or min(ids) < -1 or stride != M):
                ids = [k if 0 <= k < limit and (k >> 3) % stride < M else -1 for k in ids]
            composites = (
                [i for i, step in enumerate(steps) if step.sub_steps]
                if composites_anywhere and -1 in ids
                else []
            )
            leaves = [
                (i, ((leaf.stage * stride + leaf.microbatch) << 3) + CODES[leaf.kind])
                for i in composites
                for leaf in steps[i].leaves()
                if 0 <= leaf.stage < S and 0 <= leaf.microbatch < M
            ]
            result.append((ids, leaves))
        return result

    @staticmethod
    def locate(checked: Checked, wanted: set[int]) -> dict[int, list[tuple[int, int]]]:
        """Every (rank, index) of the given step ids among ``checked_ids()``, in one pass."""
        where: dict[int, list[tuple[int, int]]] = {}
        for rank, (ids, leaves) in enumerate(checked):
            for i, k in chain(enumerate(ids), leaves):
                if k in wanted:
                    where.setdefault(k, []).append((rank, i))
        return where

    def comm_refs(self, wanted: set[int]) -> dict[tuple[int, int], list[tuple[int, int]]]:
        """(is_recv, message id) -> every (rank, index) of those messages, in one pass.

        A message id is ``(key >> 1) * (num_ranks + 1) + destination rank``: the
        destination is the peer of a send and the rank of a recv, so a recv on a rank other
        than the one its send targets has another id."""
        where: dict[tuple[int, int], list[tuple[int, int]]] = {}
        per_message = self.plan.num_ranks + 1
        for rank, (keys, peers) in enumerate(zip(self.keys, self.peers)):
            for index, (key, peer) in enumerate(zip(keys, peers)):
                if key >= 0:
                    ident = (key >> 1) * per_message + (rank if key & 1 else peer)
                    if ident in wanted:
                        where.setdefault((key & 1, ident), []).append((rank, index))
        return where


def compile_plan(plan: Plan) -> Program:
    """Flatten a plan for :func:`execute` and the verifier's checks.

    Each step's kind, stage and micro-batch are read once, into arrays over every step of
    every rank; ids, keys and peers are array arithmetic on those, split back into per-rank
    int lists (what the executor's loop indexes fastest). A step whose micro-batch is out of
    range gets id -2 and no key: it is reported by the verifier and never blocks.

    The last plan's program is kept (see `_Compiled`): the verifier and the simulator are
    often run on one plan one after the other, and compiling ~4e5 steps is a large part of
    either.
    """
    last = _last
    if last is not None and last.matches(plan):
        return last.program
    rows = [[s for s in row if s is not None] for row in plan.ranks]
    steps = list(chain.from_iterable(rows))
    codes = np.fromiter(map(_CODE_OF.__getitem__, map(_KIND, steps)), np.int64, len(steps))
    stages, mbs = list(map(_STAGE, steps)), list(map(_MICROBATCH, steps))
    if (codes < 0).any():  # FSDP steps name no micro-batch, composites no stage
        stages = [0 if x is None else x for x in stages]
        mbs = [0 if x is None else x for x in mbs]
    return program_of(plan, rows, codes, stages, mbs)


def program_of(
    plan: Plan,
    rows: list[list[Step]],
    codes: np.ndarray,
    stages: Indices,
    mbs: Indices,
    *,
    lowered: bool = False,
    planned: PlannedTimes | None = None,
) -> Program:
    """The program of ``plan`` from every step's code (see ``CODES``; -1 for FSDP and
    composite steps), stage and micro-batch, over ``rows`` (its steps without bubbles)
    concatenated; it becomes the kept program. For a caller that made the plan and so
    knows these already (:func:`.lowering.lower`, which passes ``lowered`` and
    ``planned``)."""
    stride = max(plan.num_microbatches, 1)
    stage = _int_array(stages, stride)
    ids = _step_ids(codes, stage, _int_array(mbs, stride), stride)
    comm = (ids >= 0) & ((ids & 4) != 0)
    code = (ids & 7).astype(np.int64)
    stage_step = 8 * stride  # id distance between (s, m) and (s + 1, m)
    # by code: key = 2 * id + this; a message is named by its sender's id plus one stage
    # (so a recv from stage -1 still gets a key >= 0) and a recv's key is its send's + 1
    key_shift = np.array([0, 0, 0, 0, 5, 5 + 4 * stage_step, 2 * stage_step, 2 * stage_step])
    keys = np.where(comm, 2 * ids + key_shift[code], -1)
    peers = np.where(comm, _ranks_of(plan, ids // stage_step + _OTHER_STAGE[code]), NOT_COMM)
    bounds = list(accumulate(map(len, rows), initial=0))

    def per_rank(values: np.ndarray) -> list[list[int]]:
        return list(_slices(values.tolist(), bounds))

    positions = [
        range(len(row))  # a row without bubbles: no list of ~1e4 ints per rank to make
        if len(steps) == len(row)
        else [i for i, s in enumerate(row) if s is not None]
        for row, steps in zip(plan.ranks, rows)
    ]
    ranks = np.repeat(np.arange(len(rows)), [len(steps) for steps in rows])
    program = Program(
        plan,
        stride,
        rows,
        positions,
        per_rank(ids),
        per_rank(keys),
        per_rank(peers),
        ProgramArrays(ranks, ids, keys, peers, stage),
        lowered,
        planned,
    )
    _remember(plan, program)
    return program


def _slices(flat: list[T], bounds: list[int]) -> Iterator[list[T]]:
    """``flat`` cut at consecutive ``bounds`` (from 0 to its length)."""
    return (flat[a:b] for a, b in zip(bounds, bounds[1:]))


# Python ints this large or larger may overflow int64 in the id and key arithmetic.
_INT64_SAFE = 1 << 58


def _step_ids(codes: np.ndarray, stage: np.ndarray, mb: np.ndarray, stride: int) -> np.ndarray:
    """Every step's id (see ``CODES``): -1 for FSDP and composite steps, -2 when the
    micro-batch is >= ``stride``. Int64 arrays, or arrays of Python ints when an index is
    too large for int64 arithmetic (a hand-written plan may name any index: `_int_array`)."""
    ids = np.where(mb < stride, (stage * stride + mb) * 8 + codes, -2)
    return np.where(codes < 0, -1, ids)


def _int_array(values: Indices, stride: int) -> np.ndarray:
    """Int64 when every id and key made from these indices fits, else Python ints."""
    try:
        array = np.array(values, dtype=np.int64)
    except OverflowError:
        return np.array(values, dtype=object)
    if array.size and np.abs(array).max() >= _INT64_SAFE // (16 * stride):
        return np.array(values, dtype=object)
    return array


def _ranks_of(plan: Plan, stages: np.ndarray) -> np.ndarray:
    """The rank holding each stage, ``NO_PEER`` for a stage that does not exist or whose
    placement names no rank of the plan."""
    num_stages, num_ranks = plan.num_stages, plan.num_ranks
    table = np.array(
        [r if 0 <= r < num_ranks else NO_PEER for r in plan.placement] + [NO_PEER], np.int64
    )
    inside = (stages >= 0) & (stages < num_stages)
    return table[np.where(inside, stages, num_stages).astype(np.int64)]


@dataclass(frozen=True, slots=True)
class _Compiled:
    """A plan, a copy of what its program was compiled from, and the program.

    Steps are frozen, so a plan whose placement, micro-batch count and rows still equal
    the copy (rows compare element by element, by identity first: a few milliseconds at
    ~4e5 steps) compiles to the same program. Only the plan object it was made for may
    reuse it, as the program refers back to its plan; and only while its keys are as
    compiled (a caller may drop messages from its copy by setting keys to -1).
    """

    plan: Plan
    num_microbatches: int
    placement: tuple[int, ...]
    rows: list[list[Step | None]]
    keys: list[list[int]]
    program: Program

    def matches(self, plan: Plan) -> bool:
        return (
            plan is self.plan
            and plan.num_microbatches == self.num_microbatches
            and plan.placement == self.placement
            and plan.ranks == self.rows
            and self.program.keys == self.keys
        )


_last: _Compiled | None = None  # replaced whole, so threads never see half of one


def _remember(plan: Plan, program: Program) -> None:
    global _last
    rows = [list(row) for row in plan.ranks]
    keys = [list(row) for row in program.keys]
    _last = _Compiled(plan, plan.num_microbatches, plan.placement, rows, keys, program)


def with_messages(plan: Plan) -> Plan:
    """A compute-only plan lowered to compute+comms by :func:`.lowering.lower`, for running.

    Collective steps (FSDP, TIED_REDUCE) are dropped first (lowering expects pure compute, and
    here they neither block nor cost anything), so the result carries none.
    """
    from .lowering import lower  # lazy: only compute-only plans need it

    if any(s is not None and s.kind in COLLECTIVE_KINDS for row in plan.ranks for s in row):
        plan = Plan(
            plan.num_microbatches,
            plan.placement,
            [[s for s in row if s is None or s.kind not in COLLECTIVE_KINDS] for row in plan.ranks],
            plan.name,
            dict(plan.params),
        )
    return lower(plan)


@dataclass(slots=True)
class Outcome:
    """Where every rank ended, when each step started and ended, and untagged mix-ups.

    ``cursors[r] == len(program.keys[r])`` when rank r finished. ``mismatches`` holds
    ``(send_rank, send_index, recv_rank, recv_index)`` pairs matched under ``fifo`` whose
    messages differ.
    """

    program: Program
    semantics: str
    cursors: list[int]
    start: list[list[float]]
    end: list[list[float]]
    mismatches: list[tuple[int, int, int, int]]

    def blocked(self) -> dict[int, int]:
        """rank -> index of the step it is stuck in, for ranks that did not finish."""
        return {
            rank: cursor
            for rank, cursor in enumerate(self.cursors)
            if cursor < len(self.program.keys[rank])
        }

    def waits_for(self, rank: int) -> int | None:
        """The rank a blocked rank waits for (None when the peer stage has no rank)."""
        peer = self.program.peers[rank][self.cursors[rank]]
        return None if peer == NO_PEER else peer

    def step_text(self, rank: int) -> str:
        """The text of the step a rank stopped at."""
        return format_step(self.program.steps[rank][self.cursors[rank]])


def execute(
    program: Program,
    semantics: str = "eager",
    durations: list[list[float]] | None = None,
    transfer: float = 0.0,
) -> Outcome:
    """Run every rank as far as it can go.

    ``durations[r][i]`` is the CPU time of step i of rank r (zero when omitted);
    ``transfer`` is a message's time on the wire. Under ``eager`` a recv ends no earlier
    than its send's time plus ``transfer``; under ``rendezvous`` and ``fifo`` both ends of a
    pair finish together, ``transfer`` after the later of them arrived.
    """
    if semantics not in SEMANTICS:
        raise ValueError(f"unknown semantics {semantics!r}; expected one of {SEMANTICS}")
    if durations is None and transfer == 0 and _runs_through(program):
        keys = program.keys
        zeros = [[0.0] * len(row) for row in keys], [[0.0] * len(row) for row in keys]
        return Outcome(program, semantics, list(map(len, keys)), *zeros, [])
    state = _State.new(program, durations, transfer, fifo=semantics == "fifo")
    (_run_eager if semantics == "eager" else _run_paired)(state)
    return Outcome(program, semantics, state.cursor, state.start, state.end, state.mismatches)


def _runs_through(program: Program) -> bool:
    """Whether ``program`` is a lowered plan's, unchanged since lowering (the kept program,
    keys as compiled): then every rank finishes, at time zero when nothing takes time, and
    running it would only confirm that (verify's check of a built plan)."""
    last = _last
    return (
        program.lowered
        and last is not None
        and last.program is program
        and program.keys == last.keys
    )


def planned_outcome(program: Program, costs: tuple[float, float, float, float]) -> Outcome | None:
    """The eager run of a lowered plan whose compute steps cost ``costs`` (by kind F, B, I,
    W) and whose messages take no time on the wire, read from the lowering's simulation
    instead of run: None unless that simulation used the same costs (`PlannedTimes`) and
    the program is still as lowered (`_runs_through`).

    Why the two agree: `lower` sorts each rank's steps by (time, messages first), both ends
    of a message at the end of the compute step that produced it. So a send comes right
    after its producer (nothing between them moves the rank's clock past that end), and a
    recv's message was sent at its stamp, which is no later than the start of any compute
    step after it; every input of a compute step arrived by a recv before it or was made
    before it on its rank. By induction in that order, the rank's clock after each step is
    the running maximum of the planned times: a compute step's end is above every stamp
    before it, a recv waits until its stamp, a send leaves the clock as it was.
    """
    planned = program.planned
    if planned is None or planned.costs != costs or not _runs_through(program):
        return None
    ranks, times = program.arrays.ranks, planned.times
    lift = ranks * (int(times.max(initial=0)) + 1)  # each rank's maximum starts afresh
    end = np.maximum.accumulate(times + lift) - lift
    ends = list(program.rank_slices(end.astype(np.float64).tolist()))
    starts = [[0.0, *row[:-1]] if row else [] for row in ends]  # each step after the last
    return Outcome(program, "eager", list(map(len, program.keys)), starts, ends, [])


@dataclass(slots=True)
class _State:
    """The executor's progress: per rank its cursor and clock, each step's start and end,
    messages in flight (eager) and the worklist of ranks that may advance."""

    keys: list[list[int]]
    peers: list[list[int]]
    durations: list[list[float]]
    transfer: float
    fifo: bool  # untagged pairing (see `_fifo_pairs`)
    start: list[list[float]]
    end: list[list[float]]
    cursor: list[int]
    clock: list[float]
    work: list[int]
    in_flight: Slots  # by send key: when its message is receivable, or None
    waiting: Slots  # by send key: the rank blocked receiving it, or -1
    extra: dict[int, list[float]] = field(default_factory=dict)  # duplicated messages' copies
    mismatches: list[tuple[int, int, int, int]] = field(default_factory=list)

    @classmethod
    def new(
        cls, program: Program, durations: list[list[float]] | None, transfer: float, fifo: bool
    ) -> _State:
        keys = program.keys
        n = len(keys)
        top = max((max(row, default=-1) for row in keys), default=-1) + 1
        return cls(
            keys,
            program.peers,
            durations if durations is not None else [[0.0] * len(row) for row in keys],
            transfer,
            fifo,
            [[0.0] * len(row) for row in keys],
            [[0.0] * len(row) for row in keys],
            [0] * n,
            [0.0] * n,
            list(range(n - 1, -1, -1)),
            *_slots(top, sum(map(len, keys))),
        )


Slots = list | defaultdict  # indexed by message key; reading an unset key gives the default


def _slots(top: int, num_steps: int) -> tuple[Slots, Slots]:
    """In-flight times and waiting ranks by message key: lists when the keys are small (a
    plan with indices in range has keys below ~16 per step), else dicts with the same
    defaults, so the executor's loop indexes either alike."""
    if top <= 16 * num_steps + 64:
        return [None] * top, [-1] * top
    return defaultdict(lambda: None), defaultdict(lambda: -1)


_BLOCKED = -1.0  # what `_paired_step` returns when the rank cannot go on (times are >= 0)


def _run_eager(s: _State) -> None:
    """Advance each rank on the worklist until it blocks at a recv or ends.

    A send never blocks and wakes the rank waiting for its message; a recv waits until its
    message was sent and has spent ``transfer`` on the wire. Compute and FSDP steps never
    block. The comm steps are handled inline rather than by a per-step function: this loop
    runs once per step of the plan (~4e5), and a call per comm step costs about a quarter of
    the run. A step starts when the one before it on its rank ended (at 0 for the first),
    so start times are copied from the end times after the run rather than stored per step.
    """
    keys, durations, end = s.keys, s.durations, s.end
    cursor, clock, work = s.cursor, s.clock, s.work
    in_flight, extra, waiting, transfer = s.in_flight, s.extra, s.waiting, s.transfer
    while work:
        rank = work.pop()
        keys_r, dur_r, end_r = keys[rank], durations[rank], end[rank]
        t, n = clock[rank], len(keys_r)
        for i in range(cursor[rank], n):
            key = keys_r[i]
            if key < 0:  # compute or FSDP
                t += dur_r[i]
            elif key & 1:  # a recv
                key -= 1  # its send's key
                ready = in_flight[key]
                if ready is None:
                    waiting[key] = rank
                    break
                in_flight[key] = None
                if extra and key in extra:
                    _next_copy(in_flight, extra, key)
                if ready > t:
                    t = ready
            else:  # a send
                ready = t + transfer
                if in_flight[key] is None:
                    in_flight[key] = ready
                else:  # a duplicate
                    extra.setdefault(key, []).append(ready)
                woken = waiting[key]
                if woken >= 0:
                    waiting[key] = -1
                    work.append(woken)
            end_r[i] = t
        else:
            i = n  # ran to the end of its plan
        cursor[rank], clock[rank] = i, t
    for start_r, end_r, done in zip(s.start, end, cursor):
        start_r[1:done] = end_r[: max(done - 1, 0)]


def _run_paired(s: _State) -> None:
    """Rendezvous and fifo: advance each rank on the worklist until it blocks or ends;
    a SEND or RECV goes on only when its peer is at the other end (see `_paired_step`)."""
    keys, durations, start, end = s.keys, s.durations, s.start, s.end
    cursor, clock, work = s.cursor, s.clock, s.work
    while work:
        rank = work.pop()
        keys_r, dur_r, start_r, end_r = keys[rank], durations[rank], start[rank], end[rank]
        t, n = clock[rank], len(keys_r)
        for i in range(cursor[rank], n):
            if keys_r[i] >= 0:
                done = _paired_step(s, rank, i, t)
                if done == _BLOCKED:
                    break
                t = done
                continue
            start_r[i] = t
            t += dur_r[i]
            end_r[i] = t
        else:
            i = n  # ran to the end of its plan
        cursor[rank], clock[rank] = i, t


def _paired_step(s: _State, rank: int, i: int, t: float) -> float:
    """A SEND or RECV begun at ``t`` under rendezvous or fifo: it waits until the peer is at
    the other end; the pair completes both ends at once, ``transfer`` after the later
    arrived, and wakes the peer. Returns when it ended, or ``_BLOCKED``."""
    peer = s.peers[rank][i]
    if peer in (NO_PEER, rank):
        return _BLOCKED
    j = s.cursor[peer]
    if j >= len(s.keys[peer]):
        return _BLOCKED
    if s.fifo:
        if not _fifo_pairs(s, rank, i, peer, j):
            return _BLOCKED
    elif s.keys[peer][j] != s.keys[rank][i] ^ 1:
        return _BLOCKED
    other = s.clock[peer]
    done = (t if t > other else other) + s.transfer
    s.start[rank][i], s.end[rank][i] = t, done
    s.start[peer][j], s.end[peer][j] = other, done
    s.cursor[peer], s.clock[peer] = j + 1, done
    s.work.append(peer)
    return done


def _fifo_pairs(s: _State, rank: int, i: int, peer: int, j: int) -> bool:
    """Under ``fifo`` (no tags) any recv from this rank pairs with any send to it: whether
    the peer's step ``j`` is one, recording a pair that names different messages."""
    key, other_key = s.keys[rank][i], s.keys[peer][j]
    if other_key < 0 or (other_key ^ key) & 1 == 0 or s.peers[peer][j] != rank:
        return False
    if other_key != key ^ 1:
        s.mismatches.append((peer, j, rank, i) if key & 1 else (rank, i, peer, j))
    return True


def _next_copy(in_flight: Slots, extra: dict[int, list[float]], key: int) -> None:
    """A duplicated message: the next copy becomes receivable."""
    in_flight[key] = extra[key].pop(0)
    if not extra[key]:
        del extra[key]


# ---------------------------------------------------------------------------------------
# Why ranks are stuck: the wait-for graph of a finished run
# ---------------------------------------------------------------------------------------


def counterpart(step: Step) -> str:
    """The text of the step on the peer rank that a comm step pairs with."""
    s, m = step.stage, step.microbatch
    return {
        StepKind.SEND_F: f"{s + 1}RECV_F{m}",
        StepKind.RECV_F: f"{s - 1}SEND_F{m}",
        StepKind.SEND_B: f"{s - 1}RECV_B{m}",
        StepKind.RECV_B: f"{s + 1}SEND_B{m}",
    }[step.kind]


@dataclass(slots=True)
class Stall:
    """Blocked ranks that wait, directly or through each other, on one thing.

    ``kind`` is ``"deadlock"`` (a wait-for cycle, listed in ``chain`` from its lowest rank)
    or ``"stuck"`` (a chain ending at a rank that finished, or at a stage with no rank).
    ``ranks`` is every rank of the group, including those queued behind the chain.
    """

    kind: str
    chain: list[int]
    ranks: list[int]
    message: str


def stalls(outcome: Outcome) -> list[Stall]:
    """Group the blocked ranks by what they ultimately wait on (:func:`.waitfor.solve`) and
    explain each group: a cycle is a deadlock, a chain ending at a rank that finished or at
    a stage with no rank is stuck."""
    stuck = outcome.blocked()
    target = {r: outcome.waits_for(r) for r in stuck}
    result = []
    for group in waitfor.solve(target, sorted(stuck)):
        members = group.members
        if group.kind == waitfor.CYCLE:
            start = min(group.cycle)
            lead = f"deadlock under {outcome.semantics}: "
        else:
            depth = {r: _depth(r, target) for r in members}
            start = max(members, key=lambda r: (depth[r], -r))
            lead = f"rank {start} can never finish under {outcome.semantics}: "
        text, chain = _chain(outcome, target, start)
        others = [r for r in members if r not in chain]
        if others:
            text += "; also stuck behind it: " + ", ".join(
                f"rank {r} in {outcome.step_text(r)} waiting for rank {target[r]}" for r in others
            )
        kind = "deadlock" if group.kind == waitfor.CYCLE else "stuck"
        result.append(Stall(kind, chain, members, lead + text))
    return result


def _depth(rank: int, target: dict[int, int | None]) -> int:
    depth = 0
    while rank in target:
        depth, rank = depth + 1, target[rank]
    return depth


def _chain(outcome: Outcome, target: dict[int, int | None], start: int) -> tuple[str, list[int]]:
    """'rank a blocked in X waiting for rank b, which is blocked in Y waiting for ...'."""
    parts: list[str] = []
    chain: list[int] = []
    rank = start
    while True:
        chain.append(rank)
        where = f"rank {rank} blocked in" if not parts else "which is blocked in"
        text, peer = outcome.step_text(rank), target[rank]
        if peer is None:
            parts.append(f"{where} {text}, whose peer stage does not exist or has no rank")
            break
        parts.append(f"{where} {text} waiting for rank {peer}")
        if peer not in target:
            step = outcome.program.steps[rank][outcome.cursors[rank]]
            parts.append(f"which finished its plan without reaching {counterpart(step)}")
            break
        if peer in chain:
            break
        rank = peer
    return ", ".join(parts), chain
