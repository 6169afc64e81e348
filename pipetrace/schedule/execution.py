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

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter

from . import waitfor
from .ir import FSDP_KINDS, Plan, Step, StepKind, format_step

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
_OTHER_STAGE = (0, 0, 0, 0, -1, 1, 1, -1)

_STAGE = attrgetter("stage")

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
    """

    plan: Plan
    mb_stride: int
    steps: list[list[Step]]
    positions: list[list[int]]
    ids: list[list[int]]
    keys: list[list[int]]
    peers: list[list[int]]

    def stages_named(self) -> list[set[int | None]]:
        """Per rank, every stage index its steps and composite leaves name (as written)."""
        result = []
        for steps in self.steps:
            stages = set(map(_STAGE, steps))
            if None in stages:
                stages |= {leaf.stage for s in steps if s.sub_steps for leaf in s.leaves()}
            result.append(stages)
        return result

    def checked_ids(self) -> Checked:
        """Per rank, the ids to check: ``ids`` with out-of-range steps set to -1, and the
        ``(index, id)`` of every in-range composite leaf (its index is the composite's)."""
        S, M, stride = self.plan.num_stages, self.plan.num_microbatches, self.mb_stride
        limit = S * stride * 8
        result = []
        for steps, ids in zip(self.steps, self.ids):
            if ids and (max(ids) >= limit or min(ids) < -1 or stride != M):
                ids = [k if 0 <= k < limit and (k >> 3) % stride < M else -1 for k in ids]
            composites = [i for i, step in enumerate(steps) if step.sub_steps] if -1 in ids else []
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

    Written as list comprehensions over small-int tables: at ~4e5 steps, every per-step
    operation counts. A step whose micro-batch is out of range gets id -2 and no key: it
    is reported by the verifier and never blocks.
    """
    stride = max(plan.num_microbatches, 1)
    stage_step = 8 * stride  # id distance between (s, m) and (s + 1, m)
    # by code: key = 2 * id + this; a message is named by its sender's id plus one stage
    # (so a recv from stage -1 still gets a key >= 0) and a recv's key is its send's + 1
    key_shift = (0, 0, 0, 0, 5, 5 + 4 * stage_step, 2 * stage_step, 2 * stage_step)
    num_ranks = plan.num_ranks
    rank_of = {s: r for s, r in enumerate(plan.placement) if 0 <= r < num_ranks}
    rows = [[s for s in row if s is not None] for row in plan.ranks]
    program = Program(plan, stride, rows, [], [], [], [])
    for row, steps in zip(plan.ranks, rows):
        program.positions.append(
            list(range(len(row)))
            if len(steps) == len(row)
            else [i for i, s in enumerate(row) if s is not None]
        )
        ids = [
            ((s.stage * stride + m) * 8 + c if (m := s.microbatch) < stride else -2)
            if (c := _CODE_OF[s.kind]) >= 0
            else -1
            for s in steps
        ]
        program.ids.append(ids)
        program.keys.append([2 * k + key_shift[k & 7] if k >= 0 and k & 4 else -1 for k in ids])
        program.peers.append(
            [
                rank_of.get(k // stage_step + _OTHER_STAGE[k & 7], NO_PEER)
                if k >= 0 and k & 4
                else NOT_COMM
                for k in ids
            ]
        )
    return program


def with_messages(plan: Plan) -> Plan:
    """A compute-only plan lowered to compute+comms by :func:`.lowering.lower`, for running.

    FSDP steps are dropped first (lowering expects pure compute, and here they neither
    block nor cost anything), so the result carries no FSDP steps.
    """
    from .lowering import lower  # lazy: only compute-only plans need it

    if any(s is not None and s.kind in FSDP_KINDS for row in plan.ranks for s in row):
        plan = Plan(
            plan.num_microbatches,
            plan.placement,
            [[s for s in row if s is None or s.kind not in FSDP_KINDS] for row in plan.ranks],
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
    state = _State.new(program, durations, transfer, fifo=semantics == "fifo")
    _run(state, _eager_step if semantics == "eager" else _paired_step)
    return Outcome(program, semantics, state.cursor, state.start, state.end, state.mismatches)


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
    in_flight: dict[int, float] = field(default_factory=dict)  # send key -> when receivable
    extra: dict[int, list[float]] = field(default_factory=dict)  # duplicated messages' copies
    waiting: dict[int, int] = field(default_factory=dict)  # send key -> the rank receiving it
    mismatches: list[tuple[int, int, int, int]] = field(default_factory=list)

    @classmethod
    def new(
        cls, program: Program, durations: list[list[float]] | None, transfer: float, fifo: bool
    ) -> _State:
        keys = program.keys
        n = len(keys)
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
        )


_BLOCKED = -1.0  # what a comm step function returns when the rank cannot go on (times >= 0)


def _run(s: _State, comm_step: Callable[[_State, int, int, int, float], float]) -> None:
    """Advance each rank on the worklist until it blocks or ends. Compute and FSDP steps
    never block; ``comm_step(state, rank, index, key, t)`` runs a SEND or RECV begun at
    ``t`` and returns when it ended, or ``_BLOCKED``."""
    keys, durations, start, end = s.keys, s.durations, s.start, s.end
    cursor, clock, work = s.cursor, s.clock, s.work
    while work:
        rank = work.pop()
        keys_r, dur_r, start_r, end_r = keys[rank], durations[rank], start[rank], end[rank]
        t, n = clock[rank], len(keys_r)
        for i in range(cursor[rank], n):
            key = keys_r[i]
            if key >= 0:
                done = comm_step(s, rank, i, key, t)
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


def _eager_step(s: _State, rank: int, i: int, key: int, t: float) -> float:
    """A send never blocks and wakes the rank waiting for its message; a recv waits until
    its message was sent and has spent ``transfer`` on the wire."""
    in_flight, extra = s.in_flight, s.extra
    if key & 1:
        ready = in_flight.pop(key - 1, None)
        if ready is None:
            s.waiting[key - 1] = rank
            return _BLOCKED
        if extra and key - 1 in extra:
            _next_copy(in_flight, extra, key - 1)
        s.start[rank][i] = t
        if ready > t:
            t = ready
    else:
        s.start[rank][i] = t
        ready = t + s.transfer
        if in_flight.setdefault(key, ready) is not ready:  # a duplicate
            extra.setdefault(key, []).append(ready)
        woken = s.waiting.pop(key, -1)
        if woken >= 0:
            s.work.append(woken)
    s.end[rank][i] = t
    return t


def _paired_step(s: _State, rank: int, i: int, key: int, t: float) -> float:
    """Rendezvous and fifo: the step waits until the peer is at the other end; the pair
    completes both ends at once, ``transfer`` after the later arrived, and wakes the peer."""
    peer = s.peers[rank][i]
    if peer in (NO_PEER, rank):
        return _BLOCKED
    j = s.cursor[peer]
    if j >= len(s.keys[peer]):
        return _BLOCKED
    if s.fifo:
        if not _fifo_pairs(s, rank, i, peer, j):
            return _BLOCKED
    elif s.keys[peer][j] != key ^ 1:
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


def _next_copy(in_flight: dict[int, float], extra: dict[int, list[float]], key: int) -> None:
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
