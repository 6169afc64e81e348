"""From a compute order to a drawable grid and to a runnable plan with messages and FSDP steps.

Both ``layout_bubbles`` and ``lower`` rest on one dependency-driven simulation of a compute-only
plan: every rank runs its steps in order, each step starting once the rank is free and its
inputs exist. The simulation is event driven, not time stepped, so it costs O(steps) whatever
the makespan, which keeps plans of ~10^5 steps well inside the CLI's time budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate, chain, repeat
from operator import attrgetter

import numpy as np

from pipetrace.gc_pause import gc_paused

from .execution import CODE_RECV_F, CODE_SEND_F, PlannedTimes, program_of
from .ir import (
    SWAP_KINDS,
    Plan,
    ScheduleError,
    Step,
    StepKind,
    format_step,
    make_steps,
    thread_parts,
)

# Step costs. The unit grid draws the classic staircase; the timed costs (a full backward
# costs two forwards) give ``lower`` a realistic order in which to post messages.
_UNIT_COSTS = {StepKind.F: 1, StepKind.B: 1, StepKind.I: 1, StepKind.W: 1}
_TIMED_COSTS = {StepKind.F: 1, StepKind.B: 2, StepKind.I: 1, StepKind.W: 1}


# Enum members as module constants: attribute access on an Enum class is slow on the hot path.
_KF, _KB, _KI, _KW = StepKind.F, StepKind.B, StepKind.I, StepKind.W
_SEND_F, _RECV_F = StepKind.SEND_F, StepKind.RECV_F
_SEND_B, _RECV_B = StepKind.SEND_B, StepKind.RECV_B
_MB_BITS = 32
_LEAF_KIND, _LEAF_STAGE = attrgetter("kind"), attrgetter("stage")
_LEAF_MICROBATCH = attrgetter("microbatch")
_SUB_STEPS = attrgetter("sub_steps")
_KINDS = (_KF, _KB, _KI, _KW)  # the compute kinds, by index
_KIND_INDEX = {kind: index for index, kind in enumerate(_KINDS)}


# Event keys: one int per (stage, micro-batch, what): the activation F(s, m) produced (even
# key), or the input gradient of stage s produced by B(s, m) or I(s, m) (the odd key next to it).
# Ints keep the hot loop cheap.
_ONE_STAGE = 1 << (_MB_BITS + 1)  # key distance from (s, m) to (s + 1, m)
# An op's missing input (always available, at time 0) and missing output (never needed).
_NONE, _NOTHING = -(1 << 62), -(1 << 62) + 1


def _describe_event(key: int) -> str:
    stage, mb = key >> (_MB_BITS + 1), (key >> 1) & ((1 << _MB_BITS) - 1)
    return f"{stage}B{mb} or {stage}I{mb}" if key & 1 else f"{stage}F{mb}"


# An op is (first need, second need, make, cost): two events it waits for, the one it
# produces, and its duration. A simple step is one op; a composite several (`_split`).
Op = tuple[int, int, int, int]


@dataclass(slots=True)
class _Run:
    """The outcome of simulating a compute plan: per rank its steps, and when each step
    starts and ends, over every rank's steps in order."""

    steps: list[list[Step]]
    start: np.ndarray
    end: np.ndarray
    leaves: _Leaves


@dataclass(slots=True)
class _Leaves:
    """Every leaf of a compute plan (a step, or a composite's part), in plan order: the
    step it belongs to (its index over every rank's steps), its rank, kind (index into
    ``_KINDS``), stage and micro-batch (int64, or Python ints when int64 could overflow)."""

    owner: np.ndarray
    rank: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray


def _reject(plan: Plan, rank: int, position: int, step: Step, leaf: Step) -> None:
    """Say why the simulation cannot interpret a step, and where it is."""
    where = f"rank {rank}, step {position} ({format_step(step)!r})"
    stage = leaf.stage
    if leaf.kind not in _UNIT_COSTS:
        raise ScheduleError(
            f"{where}: expected a compute-only plan (F, B, I, W, OVERLAP_F_B and bubbles), "
            "not one that already has comms or FSDP steps"
        )
    if stage is None or leaf.microbatch is None:
        raise ScheduleError(f"{where}: a compute step needs a stage and a micro-batch")
    owner = (
        f"rank {plan.placement[stage]}"
        if 0 <= stage < plan.num_stages
        else f"no rank (the plan has {plan.num_stages} stages)"
    )
    raise ScheduleError(f"{where}: stage {stage} is placed on {owner}")


@dataclass(slots=True)
class _Compiled:
    """Each rank's steps (bubbles dropped) and their ops, whose event keys are numbered
    0..; ``events[k]`` is event k's key, ``none`` the number of `_NONE` (always there) and
    ``nothing`` of `_NOTHING` (what an op that makes nothing makes). ``main[j]`` is the op
    of step j (over every rank's steps, in order) that takes its time, counted over every
    rank's ops; None when every step is simple (one op each). ``cost`` is each step's."""

    steps: list[list[Step]]
    ops: list[list[Op]]
    main: np.ndarray | None
    cost: np.ndarray
    events: list[int]
    none: int
    nothing: int
    leaves: _Leaves


def _compile(plan: Plan, costs: dict[StepKind, int]) -> _Compiled:
    """Each rank's steps (bubbles dropped) and, in parallel, their ops.

    Computed over every leaf (a step, or a composite's part) at once, with arrays: an F
    needs the previous stage's activation and makes its own; a B or I needs its forward's
    activation and the next stage's input gradient, and makes its own; a W needs the
    gradient its I made. A missing input or output is a sentinel key (`_NONE`,
    `_NOTHING`), so every simple step's op has two needs and one make.
    """
    rows = [list(filter(None, row)) for row in plan.ranks]  # bubbles (None) dropped
    steps = list(chain.from_iterable(rows))
    leaves, owner = _leaves_of(steps)
    ranks = np.repeat(np.arange(len(rows)), [len(row) for row in rows])[owner]
    kind = np.fromiter(map(_KIND_INDEX.get, map(_LEAF_KIND, leaves), repeat(-1)), np.int64)
    num_stages = plan.num_stages
    stage = _stages(leaves, num_stages)
    mb = _leaf_ints(leaves, _LEAF_MICROBATCH)
    placed = np.array([*plan.placement, -1], dtype=np.int64)  # by stage; -1 for stage -1
    bad = (kind < 0) | (placed[stage] != ranks)
    if mb is None:  # a micro-batch is None or beyond int64
        mb = list(map(_LEAF_MICROBATCH, leaves))
        bad |= np.fromiter((x is None for x in mb), bool, len(mb))
    if bad.any():
        first = int(np.argmax(bad))
        _reject_leaf(plan, int(ranks[first]), steps[owner[first]], leaves[first])
    microbatch = _microbatches(mb)
    (first_need, second_need, make), events, (none, nothing) = _numbered_events(
        kind, stage, microbatch, num_stages, plan.num_microbatches
    )
    cost = np.array([costs[k] for k in _KINDS], dtype=np.int64)[kind]
    ops: list[Op] = list(
        zip(first_need.tolist(), second_need.tolist(), make.tolist(), cost.tolist())
    )
    leaf_table = _Leaves(owner, ranks, kind, stage, microbatch)
    if len(leaves) == len(steps):
        bounds = list(accumulate(map(len, rows), initial=0))
        per_rank = [ops[a:b] for a, b in zip(bounds, bounds[1:])]
        return _Compiled(rows, per_rank, None, cost, events, none, nothing, leaf_table)
    parts, main_in_step = _expanded(ops, owner.tolist(), steps, (none, nothing))
    step_bounds = list(accumulate(map(len, rows), initial=0))
    per_rank = [list(chain.from_iterable(parts[a:b])) for a, b in zip(step_bounds, step_bounds[1:])]
    main = np.cumsum([0, *map(len, parts[:-1])]) + main_in_step
    step_cost = np.maximum.reduceat(cost, np.searchsorted(owner, np.arange(len(steps))))
    return _Compiled(rows, per_rank, main, step_cost, events, none, nothing, leaf_table)


Events = tuple[np.ndarray, np.ndarray, np.ndarray]  # per leaf: first need, second, make


def _numbered_events(
    kind: np.ndarray, stage: np.ndarray, mb: np.ndarray, num_stages: int, num_mbs: int
) -> tuple[Events, list[int], tuple[int, int]]:
    """Each leaf's needs and make as event numbers 0.., every event's key (see above) by
    number, and the numbers of `_NONE` and `_NOTHING`. With micro-batches in range the
    numbers are computed, ``2 * (stage * M + mb) + 1`` for an activation; otherwise the
    keys are numbered in sorted order."""
    last = num_stages - 1
    if mb.dtype != object and mb.min(initial=0) >= 0 and mb.max(initial=-1) < num_mbs:
        size = 2 * num_stages * num_mbs
        activation = (stage * num_mbs + mb) * 2 + 1
        numbered = _needs_and_makes(kind, stage, activation, 2 * num_mbs, (0, size + 1), last)
        both = np.arange(size) >> 1
        keys = (((both // num_mbs) << _MB_BITS) | (both % num_mbs)) << 1
        return numbered, [_NONE, *(keys + (np.arange(size) & 1)).tolist(), _NOTHING], (0, size + 1)
    activation = ((stage.astype(mb.dtype) << _MB_BITS) | mb) << 1
    keyed = _needs_and_makes(kind, stage, activation, _ONE_STAGE, (_NONE, _NOTHING), last)
    events, dense = np.unique(np.concatenate([[_NONE, _NOTHING], *keyed]), return_inverse=True)
    first_need, second_need, make = np.split(dense[2:], 3)
    return (first_need, second_need, make), events.tolist(), (int(dense[0]), int(dense[1]))


def _needs_and_makes(
    kind: np.ndarray,
    stage: np.ndarray,
    activation: np.ndarray,
    one_stage: int,
    sentinels: tuple[int, int],
    last: int,
) -> Events:
    """The event an F needs (the previous stage's activation) and makes (its own); a B or I
    needs its forward's activation and the next stage's input gradient and makes its own
    gradient (activation + 1); a W needs its I's gradient. ``sentinels``: what stands for
    no input (`_NONE`) and no output (`_NOTHING`)."""
    none, nothing = sentinels
    is_f, is_w = kind == _KIND_INDEX[_KF], kind == _KIND_INDEX[_KW]
    before = np.where(stage > 0, activation - one_stage, none)
    grad_from_next = np.where(stage < last, activation + one_stage + 1, none)
    first_need = np.where(is_f, before, np.where(is_w, activation + 1, activation))
    second_need = np.where(is_f | is_w, none, grad_from_next)
    make = np.where(is_f, activation, np.where(is_w, nothing, activation + 1))
    return first_need, second_need, make


def _leaves_of(steps: list[Step]) -> tuple[list[Step], np.ndarray]:
    """Every leaf (a step, or a composite's part) in plan order, and the index of the step
    it belongs to. Without composites the leaves are the steps: no list of them to make."""
    if not any(map(_SUB_STEPS, steps)):
        return steps, np.arange(len(steps))
    parts = list(map(len, map(_SUB_STEPS, steps)))
    leaves = [leaf for step in steps for leaf in step.sub_steps or (step,)]
    return leaves, np.repeat(np.arange(len(steps)), [n or 1 for n in parts])


def _leaf_ints(leaves: list[Step], field: attrgetter) -> np.ndarray | None:
    """One index field of every leaf as int64, read in one C-level pass; None when a value
    is None or beyond int64 (the caller then reads them as Python objects)."""
    try:
        return np.fromiter(map(field, leaves), np.int64, len(leaves))
    except (TypeError, OverflowError):
        return None


def _stages(leaves: list[Step], num_stages: int) -> np.ndarray:
    """Every leaf's stage, -1 for one that is not a stage of the plan (None included)."""
    stage = _leaf_ints(leaves, _LEAF_STAGE)
    if stage is None:
        return np.array(
            [x if x is not None and 0 <= x < num_stages else -1 for x in map(_LEAF_STAGE, leaves)],
            dtype=np.int64,
        )
    return np.where((stage >= 0) & (stage < num_stages), stage, -1)


def _microbatches(mb: list[int] | np.ndarray) -> np.ndarray:
    """Int64, or Python ints (dtype object) where the event keys could overflow int64."""
    try:
        array = np.array(mb, dtype=np.int64)
    except OverflowError:
        return np.array(mb, dtype=object)
    return array if np.abs(array).max(initial=0) < 1 << 29 else np.array(mb, dtype=object)


def _expanded(
    ops: list[Op], owner: list[int], steps: list[Step], sentinels: tuple[int, int]
) -> tuple[list[list[Op]], list[int]]:
    """Per step, its ops (a simple step's own; a composite's leaves' merged by `_merge_ops`
    and split by `_split`) and which of them takes its time. ``sentinels``: the numbers of
    `_NONE` and `_NOTHING`."""
    parts: list[list[Op]] = [[] for _ in steps]
    for op, step in zip(ops, owner):
        parts[step].append(op)
    result, main = [], []
    for part, step in zip(parts, steps):
        if len(part) == 1:
            result.append(part)
            main.append(0)
            continue
        needs, makes, cost = _merge_ops(part, step)
        result.append(_split(needs, makes, cost, *sentinels))
        main.append(len(result[-1]) - len(makes))
    return result, main


def _split(
    needs: tuple[int, ...], makes: tuple[int, ...], cost: int, none: int, nothing: int
) -> list[Op]:
    """One merged op as ops of two needs and one make: its needs two by two in ops that
    take no time and make nothing, the last two with its first make and its whole cost,
    then its other makes in ops that take no time. Run in a row on one rank they start
    once every need is ready and make every output at the end, as the merged op would."""
    pairs = [(*needs[i : i + 2], none, none)[:2] for i in range(0, len(needs), 2)] or [(none, none)]
    ops = [(first, second, nothing, 0) for first, second in pairs[:-1]]
    ops.append((*pairs[-1], makes[0], cost))
    ops.extend((none, none, make, 0) for make in makes[1:])
    return ops


def _reject_leaf(plan: Plan, rank: int, step: Step, leaf: Step) -> None:
    """`_reject` for the first leaf the simulation cannot interpret, found by position."""
    position = next(i for i, s in enumerate(plan.ranks[rank]) if s is step)
    _reject(plan, rank, position, step, leaf)


def _merge_ops(parts: list[Op], composite: Step) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """A composite waits for every part's inputs but those an earlier part on the same
    thread makes (an OVERLAP_B_F's I before its W, `thread_parts`), makes every part's
    outputs and lasts as long as its longest part (one slot on the unit grid): its needs,
    makes and cost."""
    threads = [t for t, group in enumerate(thread_parts(composite)) for _ in group]
    made: set[tuple[int, int]] = set()
    needs: dict[int, None] = {}
    for (first, second, make, _), thread in zip(parts, threads):
        needs.update((k, None) for k in (first, second) if (k, thread) not in made)
        made.add((make, thread))
    return tuple(needs), tuple(op[2] for op in parts), max(op[3] for op in parts)


class CannotFinish(ScheduleError):
    """The compute steps' order cannot run to the end: ranks wait on each other forever."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def _simulate(plan: Plan, costs: dict[StepKind, int]) -> _Run:
    """Run every rank's steps in order as early as their inputs allow (`_run_ops`).

    Raises CannotFinish naming every rank that can never finish.
    """
    compiled = _compile(plan, costs)
    position, done, starts = _run_ops(compiled)
    stuck = [r for r, ops in enumerate(compiled.ops) if position[r] < len(ops)]
    if stuck:
        raise CannotFinish(_stuck_message(compiled, position, done, stuck), stuck)
    start = np.fromiter(chain.from_iterable(starts), np.int64, sum(map(len, starts)))
    if compiled.main is not None:
        start = start[compiled.main]
    return _Run(compiled.steps, start, start + compiled.cost, compiled.leaves)


def _run_ops(compiled: _Compiled) -> tuple[list[int], list[int | None], list[list[int]]]:
    """Each rank runs its ops in order, each as soon as the rank is free and both its needs
    exist; a rank missing one parks on that event and is woken when it is made, so each op
    is examined a bounded number of times. Returns where each rank stopped, when each event
    was made (None: never) and each op's start.

    A rank's ``now`` is the earliest its next op can start: raised to each need's time as
    it is found ready, so a rank woken after parking starts from there.
    """
    all_ops = compiled.ops
    num_ranks = len(all_ops)
    done: list[int | None] = [None] * len(compiled.events)  # event -> when available
    done[compiled.none] = 0  # `_NONE`: an input a step does not have
    parked: list[list[int] | None] = [None] * len(compiled.events)  # event -> ranks waiting
    position = [0] * num_ranks
    free_at = [0] * num_ranks
    starts: list[list[int]] = [[] for _ in range(num_ranks)]
    runnable = list(range(num_ranks))
    while runnable:
        rank = runnable.pop()
        ops, rank_starts = all_ops[rank], starts[rank]
        i, now, n = position[rank], free_at[rank], len(ops)
        while i < n:
            first, second, make, cost = ops[i]
            ready = done[first]
            if ready is not None:
                if ready > now:
                    now = ready
                ready = done[second]
                if ready is not None:
                    if ready > now:
                        now = ready
                    rank_starts.append(now)
                    now += cost
                    done[make] = now
                    waiting = parked[make]
                    if waiting:
                        runnable.extend(waiting)
                        parked[make] = None
                    i += 1
                    continue
                first = second  # the need it waits for
            waiting = parked[first]
            if waiting is None:
                parked[first] = [rank]
            else:
                waiting.append(rank)
            break
        position[rank], free_at[rank] = i, now
    return position, done, starts


def _stuck_message(
    compiled: _Compiled, position: list[int], done: list[int | None], stuck: list[int]
) -> str:
    lines = []
    op_bounds = list(accumulate(map(len, compiled.ops), initial=0))
    step_bounds = list(accumulate(map(len, compiled.steps), initial=0))
    for rank in stuck:
        ops = compiled.ops[rank]
        if compiled.main is None:
            i = first = last = position[rank]
        else:  # the step whose ops include the one it stopped at, and its ops with needs
            main = compiled.main[step_bounds[rank] : step_bounds[rank + 1]] - op_bounds[rank]
            i = int(np.searchsorted(main, position[rank]))
            first, last = int(main[i - 1]) + 1 if i else 0, int(main[i])
        needs = [k for op in ops[first : last + 1] for k in op[:2]]
        missing = [_describe_event(compiled.events[k]) for k in needs if done[k] is None]
        lines.append(
            f"rank {rank} waits forever at its compute step {i} "
            f"({format_step(compiled.steps[rank][i])}) for {', '.join(missing)}"
        )
    return "the compute plan cannot run to the end (deadlock): " + "; ".join(lines)


def layout_bubbles(plan: Plan) -> Plan:
    """Place each rank's compute steps on a unit-time grid, ``None`` marking idle slots.

    Every step (a composite too) takes one slot and starts as soon as its inputs exist, so
    the rows draw the schedule's staircase. Bubbles already in ``plan`` are ignored.
    """
    with gc_paused():
        run = _simulate(plan, _UNIT_COSTS)
        rows: list[list[Step | None]] = []
        every_start, bounds = run.start.tolist(), list(accumulate(map(len, run.steps), initial=0))
        for steps, a, b in zip(run.steps, bounds, bounds[1:], strict=False):
            starts = every_start[a:b]
            row: list[Step | None] = [None] * (starts[-1] + 1 if starts else 0)
            for step, start in zip(steps, starts, strict=True):
                row[start] = step
            rows.append(row)
    return Plan(plan.num_microbatches, plan.placement, rows, plan.name, dict(plan.params))


def lower(plan: Plan, *, fsdp: bool = False) -> Plan:
    """Add the point-to-point messages to a compute-only plan (bubbles are dropped).

    The compute plan is simulated with timed costs; each message is stamped with the end time
    of the step that produces it, each compute step with its start time. Every rank's list
    is then sorted by (time, messages before compute, message number). Both halves of a
    message carry the same stamp, so all rank lists are projections of one global order in
    which each send is directly followed by its receive: the plan cannot deadlock whether
    sends are eager, rendezvous or matched in FIFO order per rank pair, and each rank pair
    sees its messages in the same order on both sides.
    """
    with gc_paused():
        if _has_swaps(plan):
            lowered = _lower_with_swaps(plan)
        else:
            lowered = _add_messages(plan, keep_program=not fsdp)
        return add_fsdp_steps(lowered) if fsdp else lowered


def _has_swaps(plan: Plan) -> bool:
    """Whether any step is an activation swap step: one pass over every step's kind without
    a Python call per step (a lowered plan's compute order has ~1e5 of them)."""
    steps = filter(None, chain.from_iterable(plan.ranks))  # bubbles dropped
    return not SWAP_KINDS.isdisjoint(map(_LEAF_KIND, steps))


# Swap steps that stay right before the next compute step when a plan is lowered; the others
# stay right after the previous one (see `_lower_with_swaps`).
_BEFORE_NEXT = frozenset({StepKind.SWAP_GROUP, StepKind.LOAD_WAIT})


@dataclass(slots=True)
class _SwapAnchors:
    """Where a row's swap steps sit relative to its compute steps (by the compute step's
    identity: the lowered plan holds the same Step objects), and those after the last one."""

    before: dict[int, list[Step]]
    after: dict[int, list[Step]]
    tail: list[Step]


def _lower_with_swaps(plan: Plan) -> Plan:
    """`lower` of a plan with activation swap steps: lowered without them, then each is put
    back next to the compute step it was next to (`_BEFORE_NEXT` kinds before the next one,
    the others after the previous one), so messages never come between them."""
    bare_rows: list[list[Step | None]] = []
    anchors: list[_SwapAnchors] = []
    for row in plan.ranks:
        bare, anchor = _detach_swaps(row)
        bare_rows.append(bare)
        anchors.append(anchor)
    bare_plan = Plan(plan.num_microbatches, plan.placement, bare_rows, plan.name, plan.params)
    lowered = _add_messages(bare_plan, keep_program=False)
    rows: list[list[Step | None]] = []
    for row, anchor in zip(lowered.ranks, anchors, strict=True):
        new_row: list[Step | None] = []
        for step in row:
            new_row.extend(anchor.before.get(id(step), ()))
            new_row.append(step)
            new_row.extend(anchor.after.get(id(step), ()))
        rows.append(new_row + anchor.tail)  # type: ignore[operator]
    return Plan(plan.num_microbatches, plan.placement, rows, plan.name, dict(plan.params))


def _detach_swaps(row: list[Step | None]) -> tuple[list[Step | None], _SwapAnchors]:
    """A row without its swap steps, and where they were."""
    bare: list[Step | None] = []
    anchors = _SwapAnchors({}, {}, [])
    pending: list[Step] = []
    last: Step | None = None
    for step in row:
        if step is not None and step.is_swap:
            if step.kind in _BEFORE_NEXT or last is None:
                pending.append(step)
            else:
                anchors.after.setdefault(id(last), []).append(step)
            continue
        if step is not None and (step.is_compute or step.sub_steps):
            if pending:
                anchors.before[id(step)], pending = pending, []
            last = step
        bare.append(step)
    if pending and last is not None:
        anchors.after.setdefault(id(last), []).extend(pending)
    else:
        anchors.tail = pending
    return bare, anchors


# How a compute leaf's output leaves its rank, by leaf kind: the route row (0: to the next
# stage, activations; 1: to the previous stage, input gradients; -1: none, a W produces
# nothing another stage needs).
_ROUTES = np.array([0, 1, 1, -1])  # by index into `_KINDS`
_SEND_CODE, _RECV_CODE = CODE_SEND_F, CODE_RECV_F  # plus the route: the executor's codes
_SEND_KINDS = np.array([_SEND_F, _SEND_B], dtype=object)  # by route
_RECV_KINDS = np.array([_RECV_F, _RECV_B], dtype=object)
_RECV_STAGE = np.array([1, -1])  # the receiving stage, relative to the sender's


def _neighbour_ranks(placement: tuple[int, ...]) -> np.ndarray:
    """Per route and stage, the rank the message goes to: -1 when there is no neighbour
    stage or it lives on the same rank (no message then)."""
    ranks = np.array(placement, dtype=np.int64)
    to_next = np.full(len(ranks), -1, dtype=np.int64)
    to_prev = np.full(len(ranks), -1, dtype=np.int64)
    to_next[:-1] = np.where(ranks[1:] != ranks[:-1], ranks[1:], -1)
    to_prev[1:] = np.where(ranks[:-1] != ranks[1:], ranks[:-1], -1)
    return np.stack([to_next, to_prev])


def _sorted_order(*columns: np.ndarray) -> np.ndarray:
    """``np.lexsort`` of ``columns`` with the first as the primary key. Non-negative int64
    columns whose combined range fits in int64 are sorted as one combined key by a stable
    argsort instead: the same order, ~3x faster than a pass per column at ~4e5 entries."""
    spans = [int(column.max(initial=0)) + 1 for column in columns]
    if (
        any(column.dtype != np.int64 or column.min(initial=0) < 0 for column in columns)
        or math.prod(spans) >= 1 << 62
    ):
        return np.lexsort(columns[::-1])
    key = np.zeros(len(columns[0]), np.int64)
    for column, span in zip(columns, spans):
        key = key * span + column
    return np.argsort(key, kind="stable")


@dataclass(slots=True)
class _Messages:
    """The messages `_add_messages` adds, one entry per sending leaf, in plan order: its
    route (see `_ROUTES`), the sender's and the receiver's stage, the micro-batch and when
    it is sent (the end of the leaf's step in the compute plan's simulation)."""

    route: np.ndarray
    stage: np.ndarray
    recv_stage: np.ndarray
    microbatch: np.ndarray
    time: np.ndarray


def _add_messages(plan: Plan, *, keep_program: bool) -> Plan:
    """Simulate the compute plan, then place every message and compute step by its stamp.

    Every compute step and both ends of every message are one entry: (rank, time, 1 for
    compute or 0 for a message, message number). One sort of all entries by rank, time,
    kind and number gives every rank's new list; it is done on arrays, as the plan has
    ~4e5 entries. With ``keep_program`` the entries' codes, stages and micro-batches, known
    here, also give the lowered plan's compiled program (`_keep_program`).
    """
    run = _simulate(plan, _TIMED_COSTS)
    leaves = run.leaves
    steps = list(chain.from_iterable(run.steps))
    step_rank = np.repeat(np.arange(plan.num_ranks), [len(row) for row in run.steps])
    route = _ROUTES[leaves.kind]
    peer = np.where(route >= 0, _neighbour_ranks(plan.placement)[route, leaves.stage], -1)
    sent = np.flatnonzero(peer >= 0)  # the leaves that send a message, in plan order
    route, stage, peer = route[sent], leaves.stage[sent], peer[sent]
    compute_end = run.end
    messages = _Messages(
        route,
        stage,
        stage + _RECV_STAGE[route],
        leaves.microbatch[sent],
        compute_end[leaves.owner[sent]],
    )
    mbs = messages.microbatch.tolist()
    sends = make_steps(_SEND_KINDS[route].tolist(), stage.tolist(), mbs)
    recvs = make_steps(_RECV_KINDS[route].tolist(), messages.recv_stage.tolist(), mbs)
    number = np.arange(1, len(sent) + 1)
    entry_rank = np.concatenate([step_rank, step_rank[leaves.owner[sent]], peer])
    entry_time = np.concatenate(
        [
            run.start,
            messages.time,
            messages.time,
        ]
    )
    entry_kind = np.concatenate([np.ones(len(steps), np.int64), np.zeros(2 * len(sent), np.int64)])
    entry_number = np.concatenate([np.zeros(len(steps), np.int64), number, number])
    order = _sorted_order(entry_rank, entry_time, entry_kind, entry_number)
    every = chain(steps, sends, recvs)  # as an object array: no list of ~4e5 ints to index by
    items = np.fromiter(every, object, len(order))[order].tolist()
    bounds = np.cumsum(np.bincount(entry_rank, minlength=plan.num_ranks)).tolist()
    rows: list[list[Step | None]] = [items[a:b] for a, b in zip([0, *bounds], bounds)]
    lowered = Plan(plan.num_microbatches, plan.placement, rows, plan.name, dict(plan.params))
    if keep_program:
        _keep_program(lowered, leaves, compute_end, messages, order)
    return lowered


# The timed costs by kind F, B, I, W: what a lowered plan's `PlannedTimes` were simulated with.
_PLANNED_COSTS = tuple(float(_TIMED_COSTS[kind]) for kind in _KINDS)


def _keep_program(
    lowered: Plan, leaves: _Leaves, compute_end: np.ndarray, messages: _Messages, order: np.ndarray
) -> None:
    """Make the lowered plan's program (`execution.program_of`) from the codes, stages and
    micro-batches of its entries, known here, in the lowered order ``order``: the verifier
    and the simulator then reuse it instead of reading every step back. When every step is
    simple it carries the planned times (`execution.PlannedTimes`): composites cost their
    longest part here but their longest thread in the simulator."""
    num_steps = len(compute_end)
    simple = np.bincount(leaves.owner, minlength=num_steps) == 1
    leaf = np.searchsorted(leaves.owner, np.arange(num_steps))  # each step's first leaf
    codes = np.where(simple, leaves.kind[leaf], -1)  # _KINDS is in CODES order
    route, mb, time = messages.route, messages.microbatch, messages.time
    fields = [
        np.concatenate([codes, _SEND_CODE + route, _RECV_CODE + route])[order],
        np.concatenate(
            [np.where(simple, leaves.stage[leaf], 0), messages.stage, messages.recv_stage]
        )[order],
        np.concatenate([np.where(simple, leaves.microbatch[leaf], 0), mb, mb])[order],
    ]
    planned = (
        PlannedTimes(_PLANNED_COSTS, np.concatenate([compute_end, time, time])[order])
        if simple.all()
        else None
    )
    rows = [list(row) for row in lowered.ranks]
    program_of(lowered, rows, *fields, lowered=True, planned=planned)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# FSDP
# ---------------------------------------------------------------------------------------


def _stage_marks(row: list[Step | None]) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """Per stage in a row: index of its first compute step, of its last B/W, of its last step."""
    first: dict[int, int] = {}
    last_grad: dict[int, int] = {}
    last: dict[int, int] = {}
    for index, step in enumerate(row):
        if step is None or not (step.is_compute or step.sub_steps):
            continue
        for leaf in step.leaves():
            stage = leaf.stage
            assert stage is not None  # every compute step names its stage
            first.setdefault(stage, index)
            last[stage] = index
            if leaf.kind is _KB or leaf.kind is _KW:
                last_grad[stage] = index
    return first, last_grad, last


def add_fsdp_steps(plan: Plan) -> Plan:
    """Insert FSDP's parameter steps around each stage's work on its rank.

    ``UNSHARD`` (all-gather the parameters) goes right before the stage's first compute step,
    ``REDUCE_GRAD`` right after its last B or W (all its weight gradients exist then) and
    ``RESHARD`` (free the gathered parameters) right after its last compute step. Comms and
    bubbles keep their places.
    """
    rows: list[list[Step | None]] = []
    for row in plan.ranks:
        first, last_grad, last = _stage_marks(row)
        before: dict[int, list[Step]] = {}
        after: dict[int, list[Step]] = {}
        for stage in sorted(first):
            before.setdefault(first[stage], []).append(Step(StepKind.UNSHARD, stage))
            if stage in last_grad:
                after.setdefault(last_grad[stage], []).append(Step(StepKind.REDUCE_GRAD, stage))
            after.setdefault(last[stage], []).append(Step(StepKind.RESHARD, stage))
        new_row: list[Step | None] = []
        for index, step in enumerate(row):
            new_row.extend(before.get(index, ()))
            new_row.append(step)
            new_row.extend(after.get(index, ()))
        rows.append(new_row)
    return Plan(plan.num_microbatches, plan.placement, rows, plan.name, dict(plan.params))


# ---------------------------------------------------------------------------------------
# Tied weights
# ---------------------------------------------------------------------------------------


def add_tied_reduce(plan: Plan) -> Plan:
    """Append ``TIED_REDUCE`` to the first and the last stage's ranks (a parameter such as an
    input embedding tied to the output projection lives on both): their gradients are summed
    there, after every step of the iteration, so that no message of the plan waits on the
    reduction. A one-stage plan needs none (the parameter is used twice in one module)."""
    last = plan.num_stages - 1
    if last == 0:
        return plan
    rows = [list(row) for row in plan.ranks]
    for stage in (0, last):
        rows[plan.placement[stage]].append(Step(StepKind.TIED_REDUCE, stage))
    return Plan(plan.num_microbatches, plan.placement, rows, plan.name, dict(plan.params))
