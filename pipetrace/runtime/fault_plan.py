"""Where in a plan a fault can strike, and what it does to the plan's progress.

Plan queries shared by the fault records (`pipetrace.runtime.faults`), which check faults in
the parent, and by `pipetrace.runtime.inject`, which applies them on the ranks. Pure Python.
"""

from __future__ import annotations

from pipetrace.schedule.execution import compile_plan, execute
from pipetrace.schedule.ir import Plan, Step, StepKind

SEND_KINDS = {"F": StepKind.SEND_F, "B": StepKind.SEND_B}
RECV_KINDS = {"F": StepKind.RECV_F, "B": StepKind.RECV_B}


def peer_of(plan: Plan, step: Step) -> int:
    """The rank at the other end of a SEND/RECV step's message."""
    s = step.stage or 0
    other = {
        StepKind.SEND_F: s + 1,
        StepKind.RECV_F: s - 1,
        StepKind.SEND_B: s - 1,
        StepKind.RECV_B: s + 1,
    }[step.kind]
    return plan.placement[other]


def message_step(plan: Plan, rank: int, channel: str, mb: int, receives: bool) -> Step | None:
    kind = (RECV_KINDS if receives else SEND_KINDS)[channel]
    return next((s for s in plan.steps(rank) if s.kind is kind and s.microbatch == mb), None)


def sends_to(plan: Plan, rank: int, peer: int) -> list[Step]:
    return [
        s
        for s in plan.steps(rank)
        if s.kind in (StepKind.SEND_F, StepKind.SEND_B) and peer_of(plan, s) == peer
    ]


def consecutive_sends(plan: Plan, rank: int, channel: str) -> list[tuple[Step, Step]]:
    """Pairs of sends one after the other on one channel (same peer, same kind), in plan order."""
    kind = SEND_KINDS[channel]
    last: dict[int, Step] = {}
    pairs = []
    for step in plan.steps(rank):
        if step.kind is kind:
            peer = peer_of(plan, step)
            if peer in last:
                pairs.append((last[peer], step))
            last[peer] = step
    return pairs


def is_stream_first(plan: Plan, step: Step, receives: bool) -> bool:
    """Whether the message of a SEND (or RECV) step is the first its sender sends on its
    (channel, sending stage) stream: the one preceded by the shape header."""
    channel = "F" if step.kind in (StepKind.SEND_F, StepKind.RECV_F) else "B"
    s = step.stage or 0
    src = s if not receives else (s - 1 if channel == "F" else s + 1)
    kind = SEND_KINDS[channel]
    first = next(x for x in plan.steps(plan.placement[src]) if x.kind is kind and x.stage == src)
    return first.microbatch == step.microbatch


def finishes(
    plan: Plan,
    rank: int,
    moved: Step,
    *,
    overlap: bool,
    before: Step | None = None,
    after: Step | None = None,
) -> bool:
    """Whether every rank still finishes an iteration when ``rank`` runs ``moved`` right
    before ``before`` (or right after ``after``) instead of where its plan has it.

    The plan executor of the schedule verifier runs it with gloo's tagged matching: sends
    are rendezvous in plain mode and never block in overlap mode, where a recv is waited by
    the step that consumes it (so recvs are moved next to their consumers first)."""
    rows = [plan.steps(r) for r in range(plan.num_ranks)]
    if overlap:
        rows = [recvs_at_consumers(row) for row in rows]
    row = [s for s in rows[rank] if s != moved]
    anchor = before if before is not None else after
    index = row.index(anchor) + (0 if before is not None else 1)  # type: ignore[arg-type]
    rows[rank] = row[:index] + [moved] + row[index:]
    program = compile_plan(
        Plan(plan.num_microbatches, plan.placement, rows, plan.name, dict(plan.params))
    )
    return not execute(program, "eager" if overlap else "rendezvous").blocked()


def consumer(steps: list[Step], recv: Step) -> Step | None:
    """The first step after ``recv`` that uses its message (a composite holding it counts):
    the forward of the receiving stage for RECV_F, its backward (B or I) for RECV_B."""
    wants = (StepKind.F,) if recv.kind is StepKind.RECV_F else (StepKind.B, StepKind.I)
    start = steps.index(recv)
    return next(
        (
            s
            for s in steps[start + 1 :]
            if any(
                leaf.kind in wants
                and leaf.stage == recv.stage
                and leaf.microbatch == recv.microbatch
                for leaf in s.leaves()
            )
        ),
        None,
    )


def waited_at(steps: list[Step], recv: Step, overlap: bool) -> Step:
    """The step where a recv's message is waited for: the RECV step in plain mode, the step
    that consumes it in overlap mode."""
    return (consumer(steps, recv) or recv) if overlap else recv


def recvs_at_consumers(row: list[Step]) -> list[Step]:
    """The row with every RECV step moved right before the step that consumes its message."""
    out = list(row)
    for recv in [s for s in row if s.kind in (StepKind.RECV_F, StepKind.RECV_B)]:
        user = consumer(out, recv)
        if user is not None:
            out.remove(recv)
            out.insert(out.index(user), recv)
    return out


class StepOrder:
    """The step order of a rank per iteration: some steps moved right after others (what
    the deadlock and swap-order faults do; the runtime's executor and the fake cluster
    both run it)."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self.moves: dict[int, list[tuple[int, int]]] = {}  # iteration -> (moved, anchor) positions

    def move(self, iteration: int, step: Step, *, after: Step) -> None:
        self.moves.setdefault(iteration, []).append(
            (self.steps.index(step), self.steps.index(after))
        )

    def __call__(self, iteration: int) -> list[int] | None:
        moves = self.moves.get(iteration)
        if moves is None:
            return None
        order = list(range(len(self.steps)))
        for moved, anchor in moves:
            order.remove(moved)
            order.insert(order.index(anchor) + 1, moved)
        return order
