"""What each unfinished rank waits on: one edge of the wait-for graph that `deadlock` solves.

A rank is *blocked* when its log ends (no run_end) with a P2P op posted and never done that
it is waiting on: the op of its open SEND/RECV step, else the recv feeding its open compute
step (overlap mode), else its oldest open op (e.g. sends drained at iteration end). A blocked
rank waits for the op's peer, unless the peer already posted the counterpart (then the
transfer itself is stuck: the chain ends there). A rank in an open SEND/RECV step that has
not posted its op yet, or in a collective over the replicas, waits the same way (a peer that
sits in the counterpart step, posted or not, is at the message too: the transfer is stuck).
A rank whose host went on while its device never completed a transfer (device timing: the
oldest work its last listing names as pending is a SEND or RECV) waits on its device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetrace.analyze import endings as en
from pipetrace.analyze.derive import (
    StepMessage,
    counterpart_rows,
    counterpart_text,
    message_identity,
    step_message,
)
from pipetrace.analyze.device_times import pending_work
from pipetrace.analyze.model import COMPUTE_CODES, OP_SEND, OPEN, OPS, RankState, RankTimeline, Run
from pipetrace.recorder.watchdog import UNSHARD_WAIT_FRAME, main_thread_in, main_thread_waits
from pipetrace.schedule.ir import StepKind

COLLECTIVE = "collective"
"""`Blocked.op` of a rank waiting in a collective that joins the replicas' pipelines."""
JOINING = frozenset({StepKind.REDUCE_GRAD, StepKind.UNSHARD})
"""The steps that are collectives over the replicas: FSDP's gradient reduce-scatter and
parameter all-gather (a run without several replicas has nobody to wait for in them)."""
COMPLETED = "completed"
"""`Blocked.counterpart_state` when the peer's side of the message is done."""


@dataclass
class Blocked:
    rank: int
    op_row: int
    op: str  # "send" / "recv" / COLLECTIVE
    peer: int
    step: str  # the SEND/RECV step that posted the op
    blocking_step: str  # the open step the rank sits in (may be a compute step)
    iteration: int
    posted_ns: int
    waits_for: int | None  # None: the counterpart was posted, the transfer is stuck
    counterpart: str  # the step the peer must run
    counterpart_state: str = ""  # set when the counterpart was already posted
    on_device: bool = False  # the host went on; the device never completed the op

    def describe(self) -> str:
        if self.op == COLLECTIVE:
            return (
                f"rank {self.rank} in {self.step}: a collective over the replicas with "
                f"rank {self.peer}"
            )
        direction = "to" if self.op == "send" else "from"
        where = (
            f"{self.step} on its device"
            if self.on_device
            else self.step
            if self.blocking_step == self.step
            else f"{self.blocking_step} (waiting for its {self.step})"
        )
        return f"rank {self.rank} in {where}: {self.op} {direction} rank {self.peer}"


def blocked_ranks(run: Run) -> dict[int, Blocked]:
    """Every rank that waits on a P2P op, with what it waits for. A rank that raised an error
    of its own waits for nobody, nor does one the user's interrupt found waiting (`endings`),
    nor one a signal killed with no stall recorded before it (the P2P op it was in was a
    moment's, not a hang: its watchdog would have said so);
    a rank whose counterpart was posted by such a crashed rank waits for it (the crash, not
    the transport, is why the transfer never completes)."""
    crashed = en.failed_first_hand(run)
    endings = en.rank_endings(run)
    dead = {r for r, e in endings.items() if e.state == en.CRASHED}
    out: dict[int, Blocked] = {}
    for rank in run.present_ranks:
        if rank.status.state == RankState.FINISHED or rank.rank in crashed:
            continue
        if endings[rank.rank].state in (en.INTERRUPTED, en.EXITED):  # where it was, not a
            continue  # hang; or it ran to the end (its log cut short: `endings`)
        if rank.status.state == RankState.SIGNALED and endings[rank.rank].state == en.CRASHED:
            continue  # killed at work: no stall of its watchdog says it had been waiting
        b = _blocking_op(run, rank) or _collective_wait(run, rank) or _device_wait(run, rank)
        if b is not None and b.counterpart_state == COMPLETED and rank.rank in dead:
            continue  # the message got through and the rank died after: it waits for nobody
        if b is not None:
            if b.waits_for is None and b.peer in crashed:
                b.waits_for = b.peer
            out[rank.rank] = b
    return out


def open_rows(rank: RankTimeline) -> np.ndarray:
    """The rows of the rank's steps that never ended."""
    return np.flatnonzero(rank.steps.end == OPEN)


def _blocking_op(run: Run, rank: RankTimeline) -> Blocked | None:
    open_ops = np.flatnonzero(rank.p2p.done == OPEN)
    open_steps = open_rows(rank)
    if not len(open_ops):
        return _unposted(run, rank, open_steps)
    chosen = _op_of_open_comm_step(run, rank, open_ops, open_steps)
    if chosen is not None:
        return _blocked_on(run, rank, chosen, None)
    feeding = _recv_feeding_compute(run, rank, open_ops, open_steps)
    if feeding is not None and not _stack_elsewhere(rank):
        return _blocked_on(run, rank, *feeding)
    codes = rank.steps.code[open_steps]
    if len(open_steps) and np.isin(run.catalog.kind[codes], COMPUTE_CODES).any():
        return None  # computing, its in-flight ops are not what it waits on
    return _blocked_on(run, rank, int(open_ops[np.argmin(rank.p2p.post[open_ops])]), None)


def _stack_elsewhere(rank: RankTimeline) -> bool:
    """The watchdog's last stall shows the main thread outside a P2P wait: a rank inside a
    compute step whose recv is still open (overlap mode waits it inside the step) is then
    stuck in its own code before the wait, not in the transfer."""
    stall = rank.final_stall()
    return stall is not None and main_thread_waits(stall.fields.get("stacks")) is False


def _op_of_open_comm_step(
    run: Run, rank: RankTimeline, open_ops: np.ndarray, open_steps: np.ndarray
) -> int | None:
    """The (last) open op posted by a still-open SEND/RECV step."""
    open_codes = set(rank.steps.code[open_steps].tolist())
    chosen = None
    for row in open_ops:
        if int(rank.p2p.code[row]) in open_codes:
            chosen = int(row)
    return chosen


def _recv_feeding_compute(
    run: Run, rank: RankTimeline, open_ops: np.ndarray, open_steps: np.ndarray
) -> tuple[int, str] | None:
    """An open recv for the stage and micro-batch of an open compute step (overlap mode),
    latest step first: (its op row, the compute step's text)."""
    catalog, p2p = run.catalog, rank.p2p
    recvs = [row for row in open_ops if p2p.op[row] != OP_SEND]
    for srow in open_steps[::-1]:
        code = int(rank.steps.code[srow])
        step = catalog.step(code)
        if step is None:
            continue
        for leaf in step.leaves():
            for row in recvs:
                rstep = catalog.step(int(p2p.code[row]))
                if (
                    rstep is not None
                    and rstep.stage == leaf.stage
                    and rstep.microbatch == leaf.microbatch
                ):
                    return int(row), catalog.texts[code]
    return None


def _blocked_on(run: Run, rank: RankTimeline, row: int, blocking_step: str | None) -> Blocked:
    """The rank waits on its op ``row``: for the peer, unless the peer posted the counterpart."""
    p2p = rank.p2p
    src, mb = message_identity(rank, run.catalog)
    text = run.catalog.texts[int(p2p.code[row])]
    op = int(p2p.op[row])
    waits_for: int | None = int(p2p.peer[row])
    state = ""
    counterpart = _counterpart_row(run, rank, row, int(src[row]), int(mb[row]))
    if counterpart is not None:
        other_rank, j = counterpart
        state = _posted_state(run.ranks[other_rank].p2p.done[j])
        waits_for = None
    return Blocked(
        rank=rank.rank,
        op_row=row,
        op=OPS[op],
        peer=int(p2p.peer[row]),
        step=text,
        blocking_step=blocking_step or text,
        iteration=int(p2p.it[row]),
        posted_ns=int(p2p.post[row]),
        waits_for=waits_for,
        counterpart=counterpart_text(op, int(p2p.ch[row]), int(src[row]), int(mb[row])),
        counterpart_state=state,
    )


def _posted_state(done: int) -> str:
    return COMPLETED if done != OPEN else "posted, not completed"


def _unposted(run: Run, rank: RankTimeline, open_steps: np.ndarray) -> Blocked | None:
    """An open SEND/RECV step that has not posted its op yet (e.g. still exchanging the
    message's shape): the rank waits for the message the step names."""
    catalog = run.catalog
    for row in open_steps[::-1]:
        code = int(rank.steps.code[row])
        message = step_message(run, rank.rank, code)
        if message is None:
            continue
        peer, iteration = message.peer, int(rank.steps.it[row])
        waits_for: int | None = peer
        state = ""
        if 0 <= peer < run.world_size and run.ranks[peer].present:
            hits = counterpart_rows(run, rank.rank, message, iteration)
            if len(hits):
                waits_for = None
                state = _posted_state(run.ranks[peer].p2p.done[hits[0]])
            elif _sits_in(run, run.ranks[peer], message.counterpart, iteration):
                waits_for = None  # both sides are at the message: neither waits for the other
                state = "in that step, not posted yet"
        text = catalog.texts[code]
        return Blocked(
            rank=rank.rank,
            op_row=-1,
            op=OPS[message.op],
            peer=peer,
            step=text,
            blocking_step=text,
            iteration=iteration,
            posted_ns=int(rank.steps.begin[row]),
            waits_for=waits_for,
            counterpart=message.counterpart,
            counterpart_state=state,
        )
    return None


def _sits_in(run: Run, rank: RankTimeline, text: str, iteration: int) -> bool:
    """Whether ``rank``'s log ends inside the step ``text`` of ``iteration``."""
    rows = open_rows(rank)
    code = run.catalog.code(text)
    return bool(((rank.steps.code[rows] == code) & (rank.steps.it[rows] == iteration)).any())


def _counterpart_row(
    run: Run, rank: RankTimeline, row: int, src: int, mb: int
) -> tuple[int, int] | None:
    """The peer's op for the message this op means (by meaning when the step texts tell it,
    else by the seq pairing); None when the peer never posted it."""
    p2p = rank.p2p
    peer = int(p2p.peer[row])
    if src < 0 or not 0 <= peer < run.world_size or not run.ranks[peer].present:
        if p2p.match_rank[row] >= 0:
            return int(p2p.match_rank[row]), int(p2p.match_index[row])
        return None
    message = StepMessage(int(p2p.op[row]), int(p2p.ch[row]), src, mb, peer)
    hits = counterpart_rows(run, rank.rank, message, int(p2p.it[row]))
    return (peer, int(hits[0])) if len(hits) else None


def _collective_wait(run: Run, rank: RankTimeline) -> Blocked | None:
    """The rank sits in a collective step over the replicas (its last open step): it waits
    for the first rank holding the same stage in another replica that never began that
    step in that iteration (None: every one did, the collective itself is stuck)."""
    steps = open_rows(rank)
    if not run.pipelines.several or not len(steps):
        return None
    row = int(steps[-1])
    code = int(rank.steps.code[row])
    step = run.catalog.step(code)
    if step is None or (step.kind not in JOINING and not _waits_on_unshard(rank)):
        return None
    iteration = int(rank.steps.it[row])
    pipelines = run.pipelines
    own = pipelines.pipeline_rank(rank.rank)
    others = [pipelines.global_rank(r, own) for r in range(pipelines.count)]
    late = [g for g in others if g != rank.rank and not _began(run, g, code, iteration)]
    text = run.catalog.texts[code]
    return Blocked(
        rank=rank.rank,
        op_row=-1,
        op=COLLECTIVE,
        peer=late[0] if late else others[0],
        step=text,
        blocking_step=text,
        iteration=iteration,
        posted_ns=int(rank.steps.begin[row]),
        waits_for=late[0] if late else None,
        counterpart=text,
        counterpart_state="" if late else "begun by every replica",
    )


def _device_wait(run: Run, rank: RankTimeline) -> Blocked | None:
    """A rank whose host went on (an NCCL ``wait()`` returns at once) while its device never
    got through a transfer: the oldest work its last listing names as pending on the device
    is a SEND or RECV. It waits for the peer, unless the peer's side completed on the
    device (then the transfer itself is stuck)."""
    pending = pending_work(rank)
    code = run.catalog.code(pending.work.label) if pending is not None else -1
    rows = np.flatnonzero(rank.p2p.code == code) if code >= 0 else ()
    if not len(rows):
        return None  # compute: the rank's own kernel, told by `terminal`
    row = int(rows[-1])
    b = _blocked_on(run, rank, row, None)
    src, mb = message_identity(rank, run.catalog)
    counterpart = _counterpart_row(run, rank, row, int(src[row]), int(mb[row]))
    done = counterpart is not None and run.ranks[counterpart[0]].p2p.dend[counterpart[1]] != OPEN
    b.waits_for = None if done else b.peer
    b.counterpart_state = COMPLETED if done else ""
    b.on_device = True
    return b


def _waits_on_unshard(rank: RankTimeline) -> bool:
    """The watchdog's last stall shows the main thread waiting for FSDP's all-gather over
    the replicas, inside a compute step (FSDP2 waits its prefetched unshard there)."""
    stall = rank.final_stall()
    return stall is not None and main_thread_in(stall.fields.get("stacks"), UNSHARD_WAIT_FRAME)


def _began(run: Run, rank: int, code: int, iteration: int) -> bool:
    if not 0 <= rank < run.world_size or not run.ranks[rank].present:
        return False
    steps = run.ranks[rank].steps
    return bool(((steps.code == code) & (steps.it == iteration)).any())
