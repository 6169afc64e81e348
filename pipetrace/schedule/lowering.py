"""From a compute order to a drawable grid and to a runnable plan with messages and FSDP steps.

Both ``layout_bubbles`` and ``lower`` rest on one dependency-driven simulation of a compute-only
plan: every rank runs its steps in order, each step starting once the rank is free and its
inputs exist. The simulation is event driven, not time stepped, so it costs O(steps) whatever
the makespan, which keeps plans of ~10^5 steps well inside the CLI's time budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrace.gc_pause import gc_paused

from .ir import Plan, ScheduleError, Step, StepKind, format_step

# Step costs. The unit grid draws the classic staircase; the timed costs (a full backward
# costs two forwards) give ``lower`` a realistic order in which to post messages.
_UNIT_COSTS = {StepKind.F: 1, StepKind.B: 1, StepKind.I: 1, StepKind.W: 1}
_TIMED_COSTS = {StepKind.F: 1, StepKind.B: 2, StepKind.I: 1, StepKind.W: 1}


# Enum members as module constants: attribute access on an Enum class is slow on the hot path.
_KF, _KB, _KI, _KW = StepKind.F, StepKind.B, StepKind.I, StepKind.W
_SEND_F, _RECV_F = StepKind.SEND_F, StepKind.RECV_F
_SEND_B, _RECV_B = StepKind.SEND_B, StepKind.RECV_B
_MB_BITS = 32


# Event keys: one int per (stage, micro-batch, what): the activation F(s, m) produced (even
# key), or the input gradient of stage s produced by B(s, m) or I(s, m) (the odd key next to it).
# Ints keep the hot loop cheap.
_ONE_STAGE = 1 << (_MB_BITS + 1)  # key distance from (s, m) to (s + 1, m)


def _describe_event(key: int) -> str:
    stage, mb = key >> (_MB_BITS + 1), (key >> 1) & ((1 << _MB_BITS) - 1)
    return f"{stage}B{mb} or {stage}I{mb}" if key & 1 else f"{stage}F{mb}"


# An op is (needs, makes, cost): the event keys a step waits for and produces, and its duration.
Op = tuple[tuple[int, ...], tuple[int, ...], int]


@dataclass(slots=True)
class _Run:
    """The outcome of simulating a compute plan: per rank, its steps and their start/end times."""

    steps: list[list[Step]]
    starts: list[list[int]]
    ends: list[list[int]]


def _leaf_op(leaf: Step, last_stage: int, costs: dict[StepKind, int]) -> Op:
    """What a compute step waits for and produces (see the event keys above)."""
    kind, stage, mb = leaf.kind, leaf.stage, leaf.microbatch
    assert stage is not None and mb is not None  # _compile checked every leaf
    activation = ((stage << _MB_BITS) | mb) << 1
    if kind is _KF:
        return ((activation - _ONE_STAGE,) if stage else ()), (activation,), costs[kind]
    if kind is _KW:
        return (activation | 1,), (), costs[kind]
    # B or I: the stage's own forward, and the output gradient from the next stage
    if stage < last_stage:
        return (activation, (activation + _ONE_STAGE) | 1), (activation | 1,), costs[kind]
    return (activation,), (activation | 1,), costs[kind]


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


def _compile(plan: Plan, costs: dict[StepKind, int]) -> tuple[list[list[Step]], list[list[Op]]]:
    """Each rank's steps (bubbles dropped) and, in parallel, their ops."""
    last_stage = plan.num_stages - 1
    placement = plan.placement
    all_steps: list[list[Step]] = []
    all_ops: list[list[Op]] = []
    for rank, row in enumerate(plan.ranks):
        steps: list[Step] = []
        ops: list[Op] = []
        for position, step in enumerate(row):
            if step is None:
                continue
            leaves = step.sub_steps or (step,)
            for leaf in leaves:
                stage = leaf.stage
                if (
                    leaf.kind not in costs
                    or leaf.microbatch is None
                    or stage is None
                    or not 0 <= stage <= last_stage
                    or placement[stage] != rank
                ):
                    _reject(plan, rank, position, step, leaf)
            if len(leaves) == 1:
                ops.append(_leaf_op(step, last_stage, costs))
            else:
                ops.append(_merge_ops([_leaf_op(leaf, last_stage, costs) for leaf in leaves]))
            steps.append(step)
        all_steps.append(steps)
        all_ops.append(ops)
    return all_steps, all_ops


def _merge_ops(parts: list[Op]) -> Op:
    """A composite waits for every part's inputs and lasts as long as its longest part."""
    makes = tuple(k for _, part_makes, _ in parts for k in part_makes)
    needs = tuple(dict.fromkeys(k for part_needs, _, _ in parts for k in part_needs))
    return needs, makes, max(cost for _, _, cost in parts)


def _simulate(plan: Plan, costs: dict[StepKind, int]) -> _Run:
    """Run every rank's steps in order as early as their inputs allow.

    A rank blocked on a missing input parks on that event and is woken when it is produced,
    so each step is examined a bounded number of times. Raises ScheduleError naming every
    rank that can never finish.
    """
    all_steps, all_ops = _compile(plan, costs)
    num_ranks = len(all_ops)
    done: dict[int, int] = {}  # event key -> time it becomes available
    parked: dict[int, list[int]] = {}  # event key -> ranks waiting for it
    position = [0] * num_ranks
    free_at = [0] * num_ranks
    starts: list[list[int]] = [[] for _ in range(num_ranks)]
    ends: list[list[int]] = [[] for _ in range(num_ranks)]
    runnable = list(range(num_ranks))
    while runnable:
        rank = runnable.pop()
        ops, rank_starts, rank_ends = all_ops[rank], starts[rank], ends[rank]
        i, now, n = position[rank], free_at[rank], len(ops)
        while i < n:
            needs, makes, cost = ops[i]
            start = now
            for key in needs:
                ready = done.get(key)
                if ready is None:
                    parked.setdefault(key, []).append(rank)
                    break
                if ready > start:
                    start = ready
            else:
                now = start + cost
                rank_starts.append(start)
                rank_ends.append(now)
                for key in makes:
                    done[key] = now
                    waiting = parked.pop(key, None)
                    if waiting:
                        runnable.extend(waiting)
                i += 1
                continue
            break
        position[rank], free_at[rank] = i, now
    stuck = [r for r in range(num_ranks) if position[r] < len(all_ops[r])]
    if stuck:
        raise ScheduleError(_stuck_message(all_steps, all_ops, position, done, stuck))
    return _Run(all_steps, starts, ends)


def _stuck_message(
    all_steps: list[list[Step]],
    all_ops: list[list[Op]],
    position: list[int],
    done: dict[int, int],
    stuck: list[int],
) -> str:
    lines = []
    for rank in stuck:
        i = position[rank]
        missing = [_describe_event(k) for k in all_ops[rank][i][0] if k not in done]
        lines.append(
            f"rank {rank} waits forever at its compute step {i} "
            f"({format_step(all_steps[rank][i])}) for {', '.join(missing)}"
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
        for steps, starts in zip(run.steps, run.starts, strict=True):
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
        lowered = _add_messages(plan)
        return add_fsdp_steps(lowered) if fsdp else lowered


# Sort keys are (2 * time + [0 message | 1 compute]) * _SEQ_SPAN + message number, packed in
# one int; no plan has anywhere near 2**40 messages.
_SEQ_SPAN = 1 << 40

# How a compute step's output leaves its rank: per stage, the peer rank (-1: none, as there is
# no neighbour stage or it lives on the same rank), the send and receive kinds, and the stage
# the receive belongs to relative to the sender's.
Route = tuple[list[int], StepKind, StepKind, int]


def _message_routes(placement: tuple[int, ...]) -> dict[StepKind, Route]:
    last = len(placement) - 1
    to_next = [
        placement[s + 1] if s < last and placement[s + 1] != placement[s] else -1
        for s in range(last + 1)
    ]
    to_prev = [
        placement[s - 1] if s > 0 and placement[s - 1] != placement[s] else -1
        for s in range(last + 1)
    ]
    backward: Route = (to_prev, _SEND_B, _RECV_B, -1)
    return {_KF: (to_next, _SEND_F, _RECV_F, 1), _KB: backward, _KI: backward}


def _add_messages(plan: Plan) -> Plan:
    run = _simulate(plan, _TIMED_COSTS)
    routes = _message_routes(plan.placement)
    # Per rank, parallel lists of sort keys and steps (no pair tuples: fewer objects to track).
    keys: list[list[int]] = [[] for _ in range(plan.num_ranks)]
    items: list[list[Step]] = [[] for _ in range(plan.num_ranks)]
    seq = 0
    for rank, (steps, starts, ends) in enumerate(zip(run.steps, run.starts, run.ends, strict=True)):
        my_keys, my_items = keys[rank], items[rank]
        for step, start, end in zip(steps, starts, ends, strict=True):
            my_keys.append((2 * start + 1) * _SEQ_SPAN)
            my_items.append(step)
            for leaf in step.sub_steps or (step,):
                route = routes.get(leaf.kind)
                if route is None:  # a W produces nothing another stage needs
                    continue
                peers, send_kind, recv_kind, offset = route
                stage, mb = leaf.stage, leaf.microbatch
                assert stage is not None  # _compile checked every leaf
                peer = peers[stage]
                if peer < 0:
                    continue
                seq += 1
                key = 2 * end * _SEQ_SPAN + seq
                my_keys.append(key)
                my_items.append(Step(send_kind, stage, mb))
                keys[peer].append(key)
                items[peer].append(Step(recv_kind, stage + offset, mb))
    rows: list[list[Step | None]] = []
    for rank_keys, rank_items in zip(keys, items, strict=True):
        order = sorted(range(len(rank_keys)), key=rank_keys.__getitem__)
        rows.append([rank_items[i] for i in order])
    return Plan(plan.num_microbatches, plan.placement, rows, plan.name, dict(plan.params))


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
