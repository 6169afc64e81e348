"""Hangs and failures: rank_failed, and the wait-for graph behind deadlock and rank_stalled.

A rank is *blocked* when its log ends (no run_end) with a P2P op posted and never done that
it is waiting on: the op of its open SEND/RECV step, else the recv feeding its open compute
step (overlap mode), else its oldest open op (e.g. sends drained at iteration end). A blocked
rank waits for the op's peer, unless the peer already posted the counterpart (then the
transfer itself is stuck: the chain ends there). Following these edges from every blocked
rank ends either in a cycle (**deadlock**) or at a rank that is not blocked (**rank_stalled**):
one still computing, failed, finished without posting the counterpart, or without a log.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetrace.analyze import endings as en
from pipetrace.analyze import findings as fk
from pipetrace.analyze.derive import counterpart_text, message_identity
from pipetrace.analyze.findings import Finding, StepRef
from pipetrace.analyze.model import COMPUTE_CODES, OP_SEND, OPEN, OPS, RankState, RankTimeline, Run
from pipetrace.schedule import waitfor
from pipetrace.schedule.ir import StepKind


@dataclass
class Blocked:
    rank: int
    op_row: int
    op: str  # "send" / "recv"
    peer: int
    step: str  # the SEND/RECV step that posted the op
    blocking_step: str  # the open step the rank sits in (may be a compute step)
    iteration: int
    posted_ns: int
    waits_for: int | None  # None: the counterpart was posted, the transfer is stuck
    counterpart: str  # the step the peer must run
    counterpart_state: str = ""  # set when the counterpart was already posted


def blocked_ranks(run: Run) -> dict[int, Blocked]:
    """Every rank that waits on a P2P op, with what it waits for. A rank that raised an error
    of its own waits for nobody, nor does one the user's interrupt found waiting (`endings`);
    a rank whose counterpart was posted by such a crashed rank waits for it (the crash, not
    the transport, is why the transfer never completes)."""
    crashed = en.failed_first_hand(run)
    endings = en.rank_endings(run)
    out: dict[int, Blocked] = {}
    for rank in run.present_ranks:
        if rank.status.state == RankState.FINISHED or rank.rank in crashed:
            continue
        if endings[rank.rank].state == en.INTERRUPTED:  # where it was, not a hang
            continue
        b = _blocking_op(run, rank) or _collective_wait(run, rank)
        if b is not None:
            if b.waits_for is None and b.peer in crashed:
                b.waits_for = b.peer
            out[rank.rank] = b
    return out


def _open_rows(rank: RankTimeline) -> np.ndarray:
    return np.flatnonzero(rank.steps.end == OPEN)


def _blocking_op(run: Run, rank: RankTimeline) -> Blocked | None:
    p2p, steps, catalog = rank.p2p, rank.steps, run.catalog
    open_ops = np.flatnonzero(p2p.done == OPEN)
    open_steps = _open_rows(rank)
    if not len(open_ops):
        return _unposted(run, rank, open_steps)
    open_codes = set(steps.code[open_steps].tolist())
    src, mb = message_identity(rank, catalog)
    chosen = None
    # 1. the op posted by an open SEND/RECV step
    for row in open_ops:
        if int(p2p.code[row]) in open_codes:
            chosen = row
    blocking_step = None
    if chosen is None:
        # 2. a recv feeding an open compute step (same stage and micro-batch)
        for srow in open_steps[::-1]:
            code = int(steps.code[srow])
            step = catalog.step(code)
            if step is None:
                continue
            for leaf in step.leaves():
                for row in open_ops:
                    if p2p.op[row] == OP_SEND:
                        continue
                    rstep = catalog.step(int(p2p.code[row]))
                    if (
                        rstep is not None
                        and rstep.stage == leaf.stage
                        and rstep.microbatch == leaf.microbatch
                    ):
                        chosen, blocking_step = row, catalog.texts[code]
                        break
                if chosen is not None:
                    break
            if chosen is not None:
                break
    if chosen is None:
        if len(open_steps) and np.isin(catalog.kind[steps.code[open_steps]], COMPUTE_CODES).any():
            return None  # computing, its in-flight ops are not what it waits on
        chosen = int(open_ops[np.argmin(p2p.post[open_ops])])
    row = int(chosen)
    text = catalog.texts[int(p2p.code[row])]
    op = int(p2p.op[row])
    waits_for: int | None = int(p2p.peer[row])
    state = ""
    counterpart = _counterpart_row(run, rank, row, int(src[row]), int(mb[row]))
    if counterpart is not None:
        other_rank, j = counterpart
        state = (
            "completed" if run.ranks[other_rank].p2p.done[j] != OPEN else "posted, not completed"
        )
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


def _unposted(run: Run, rank: RankTimeline, open_steps: np.ndarray) -> Blocked | None:
    """An open SEND/RECV step that has not posted its op yet (e.g. still exchanging the
    message's shape): the rank waits for the message the step names."""
    catalog = run.catalog
    for row in open_steps[::-1]:
        code = int(rank.steps.code[row])
        step = catalog.step(code)
        if step is None or not step.is_comm or run.plan is None:
            continue
        kind = step.kind.value
        channel = 0 if kind.endswith("F") else 1
        op = OP_SEND if kind.startswith("SEND") else 1 - OP_SEND
        direction = 1 if channel == 0 else -1
        src = step.stage if op == OP_SEND else step.stage - direction  # type: ignore[operator]
        other_stage = step.stage + direction if op == OP_SEND else src  # type: ignore[operator]
        if not 0 <= other_stage < len(run.plan.placement):
            continue
        peer = run.pipelines.peer(rank.rank, run.plan.placement[other_stage])
        iteration = int(rank.steps.it[row])
        waits_for: int | None = peer
        state = ""
        if 0 <= peer < run.world_size and run.ranks[peer].present:
            other = run.ranks[peer]
            osrc, omb = message_identity(other, catalog)
            op_table = other.p2p
            hits = np.flatnonzero(
                (op_table.op != op)
                & (op_table.peer == rank.rank)
                & (op_table.ch == channel)
                & (op_table.it == iteration)
                & (osrc == src)
                & (omb == step.microbatch)
            )
            if len(hits):
                waits_for = None
                state = "completed" if op_table.done[hits[0]] != OPEN else "posted, not completed"
        text = catalog.texts[code]
        return Blocked(
            rank=rank.rank,
            op_row=-1,
            op=OPS[op],
            peer=peer,
            step=text,
            blocking_step=text,
            iteration=iteration,
            posted_ns=int(rank.steps.begin[row]),
            waits_for=waits_for,
            counterpart=counterpart_text(op, channel, src, step.microbatch),  # type: ignore[arg-type]
            counterpart_state=state,
        )
    return None


COLLECTIVE = "collective"
"""`Blocked.op` of a rank waiting in a collective that joins the replicas' pipelines."""
JOINING = frozenset({StepKind.REDUCE_GRAD, StepKind.UNSHARD})
"""The steps that are collectives over the replicas: FSDP's gradient reduce-scatter and
parameter all-gather (a run without several replicas has nobody to wait for in them)."""


def _collective_wait(run: Run, rank: RankTimeline) -> Blocked | None:
    """The rank sits in a collective step over the replicas (its last open step): it waits
    for the first rank holding the same stage in another replica that never began that
    step in that iteration (None: every one did, the collective itself is stuck)."""
    open_steps = _open_rows(rank)
    if not run.pipelines.several or not len(open_steps):
        return None
    row = int(open_steps[-1])
    code = int(rank.steps.code[row])
    step = run.catalog.step(code)
    if step is None or step.kind not in JOINING:
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


def _began(run: Run, rank: int, code: int, iteration: int) -> bool:
    if not 0 <= rank < run.world_size or not run.ranks[rank].present:
        return False
    steps = run.ranks[rank].steps
    return bool(((steps.code == code) & (steps.it == iteration)).any())


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
    other = run.ranks[peer]
    osrc, omb = message_identity(other, run.catalog)
    op = other.p2p
    hits = np.flatnonzero(
        (op.op != p2p.op[row])
        & (op.peer == rank.rank)
        & (op.ch == p2p.ch[row])
        & (op.it == p2p.it[row])
        & (osrc == src)
        & (omb == mb)
    )
    return (peer, int(hits[0])) if len(hits) else None


def _describe_blocked(b: Blocked) -> str:
    if b.op == COLLECTIVE:
        return f"rank {b.rank} in {b.step}: a collective over the replicas with rank {b.peer}"
    direction = "to" if b.op == "send" else "from"
    where = b.step if b.blocking_step == b.step else f"{b.blocking_step} (waiting for its {b.step})"
    return f"rank {b.rank} in {where}: {b.op} {direction} rank {b.peer}"


def _ref(run: Run, b: Blocked, note: str) -> StepRef:
    return StepRef(b.rank, b.blocking_step, b.iteration, None, b.posted_ns, note)


def _terminal(run: Run, rank_id: int, wanted: str, iteration: int) -> tuple[str, str, str]:
    """(terminal state, description, likely cause) of the rank at the end of a wait-for
    chain: its `endings` verdict, the one `rank_failed` tells too."""
    if not 0 <= rank_id < run.world_size:
        return (
            en.MISSING,
            f"rank {rank_id} does not exist (world size {run.world_size})",
            "the plan or the runtime addresses a rank outside the job",
        )
    rank = run.ranks[rank_id]
    ending = en.rank_endings(run)[rank_id]
    at = en.where(run, rank)
    in_plan = wanted in rank.plan
    never = (
        (f"it never ran {wanted}" + ("" if in_plan else ", which is not in its plan"))
        if not _executed(run, rank, wanted, iteration)
        else f"it ran {wanted} but the message never arrived"
    )
    if ending.state == en.NOT_LOADED:
        return (
            en.NOT_LOADED,
            f"rank {rank_id} was not loaded ({rank.status.detail})",
            f"unknown: load rank {rank_id} too to see why it never ran {wanted or 'on'}",
        )
    if ending.state == en.MISSING:
        return (
            en.MISSING,
            f"rank {rank_id} has no log",
            "the rank never started recording (crashed at start?)",
        )
    if ending.state == en.EXITED:
        return (
            en.EXITED,
            f"rank {rank_id} {ending.evidence}; {never}",
            (
                "the plans of the two ranks disagree: the counterpart step is missing"
                if not in_plan
                else "the counterpart was skipped (a custom step function that does not send/recv?)"
            ),
        )
    if ending.state == en.CRASHED:
        how = rank.status.detail
        if rank.status.state == RankState.ENDED:
            how = f"died without a trace ({ending.evidence})"
        return (
            en.CRASHED,
            f"rank {rank_id} {how} {at.phrase}",
            f"rank {rank_id} failed before reaching {wanted}",
        )
    if ending.state == en.COMPUTING:
        text = at.step if at.open else run.catalog.texts[rank.steps.code[_open_rows(rank)[-1]]]
        begun = _open_since(run, rank, text)
        begun = ending.last_alive_ns if begun is None else begun
        return (
            en.COMPUTING,
            f"rank {rank_id} is still in {text} (begun {_fmt_s(begun)}, open for at least "
            f"{max(0, ending.last_alive_ns - begun) / 1e9:.3g} s); {never}",
            f"step {text} on rank {rank_id} never returns (an infinite loop, a lock, or a "
            "very slow step)",
        )
    if ending.state == en.INTERRUPTED:
        what = f"rank {rank_id} was interrupted by the user {at.phrase}; {never}"
        return en.INTERRUPTED, what, "the user interrupted the run (Ctrl-C) before the message came"
    if ending.state == en.HUNG:
        return (
            en.HUNG,
            f"rank {rank_id} stalled {at.phrase} ({ending.evidence}); {never}",
            f"rank {rank_id} is stuck outside the pipeline's steps (user code between steps, "
            "a lock, a data loader)",
        )
    return (
        en.UNKNOWN,
        f"rank {rank_id}'s log stops {at.phrase} ({ending.evidence}); {never}",
        f"rank {rank_id} hung or was killed {at.phrase}: look at its process and its stderr",
    )


def _executed(run: Run, rank: RankTimeline, text: str, iteration: int) -> bool:
    code = run.catalog.code(text)
    if code < 0:
        return False
    rows = rank.steps.code == code
    return bool((rows & (rank.steps.it == iteration)).any())


def _open_since(run: Run, rank: RankTimeline, text: str | None) -> int | None:
    """When the rank began the still-open step ``text`` (its latest open row)."""
    rows = _open_rows(rank)
    begun = [
        int(rank.steps.begin[r]) for r in rows if run.catalog.texts[rank.steps.code[r]] == text
    ]
    return begun[-1] if begun else None


def _fmt_s(t: int) -> str:
    return f"{t / 1e9:.3f} s"


def find_hangs(run: Run) -> list[Finding]:
    blocked = blocked_ranks(run)
    groups = waitfor.solve({r: b.waits_for for r, b in blocked.items()}, blocked)
    by_kind = {kind: [g for g in groups if g.kind == kind] for kind in waitfor.KINDS}
    findings = [_deadlock(run, blocked, g.cycle, g.members) for g in by_kind[waitfor.CYCLE]]
    for g in sorted(by_kind[waitfor.ENDS_AT], key=lambda g: g.end):
        findings.append(_stalled(run, blocked, g.end, g.members))
    for b in (blocked[g.end] for g in by_kind[waitfor.DEAD_END]):
        findings.append(
            Finding(
                fk.RANK_STALLED,
                fk.ERROR,
                f"{_describe_blocked(b)} never completed although rank {b.peer} posted the "
                f"counterpart {b.counterpart} ({b.counterpart_state})",
                "the transfer itself is stuck: the two sides disagree on the message (size, tag) "
                "or the transport lost it",
                ranks=[b.rank, b.peer],
                steps=[_ref(run, b, "blocked")],
                iterations=[b.iteration],
                time_ns=(b.posted_ns, _end_of_log(run)),
                details={
                    "chain": [b.rank, b.peer],
                    "terminal_rank": b.peer,
                    "terminal_state": "transfer",
                },
            )
        )
    in_findings = {r for f in findings for r in f.ranks}
    waiting = en.waiting_outside_iterations(run)
    endings = en.rank_endings(run)
    for rank in run.present_ranks:
        state = endings[rank.rank].state
        watched = rank.status.state in (RankState.STALLED, RankState.ABORTED)
        if (
            (watched and state != en.INTERRUPTED) or state in (en.COMPUTING, en.HUNG)
        ) and rank.rank not in in_findings:
            if rank.rank in waiting:
                findings.append(_stalled_at_end(run, rank, waiting))
                continue
            word, text, cause = _terminal(run, rank.rank, "", -1)
            findings.append(
                Finding(
                    fk.RANK_STALLED,
                    fk.ERROR,
                    f"rank {rank.rank} stalled: {text.split(';')[0]}",
                    cause,
                    ranks=[rank.rank],
                    details={
                        "chain": [rank.rank],
                        "terminal_rank": rank.rank,
                        "terminal_state": word,
                    },
                )
            )
    return findings


def _stalled_at_end(run: Run, rank: RankTimeline, waiting: dict[int, str]) -> Finding:
    absent = [
        r.rank
        for r in run.ranks
        if r.rank not in waiting
        and r.status.state not in (RankState.FINISHED, RankState.NOT_LOADED)
    ]
    who = f"rank(s) {', '.join(map(str, absent))}" if absent else "a peer"
    terminal = absent[0] if absent else rank.rank  # no absent rank known: its own end
    return Finding(
        fk.RANK_STALLED,
        fk.ERROR,
        f"rank {rank.rank} finished its iterations and stalled in {waiting[rank.rank]}: "
        f"{who} never got there",
        f"{who} stopped outside the pipeline's iterations (hung or slow in user code between "
        "iterations: checkpointing, evaluation, data loading) or died",
        ranks=[rank.rank, *absent],
        details={
            "chain": [rank.rank, *absent],
            "terminal_rank": terminal,
            "terminal_state": en.rank_endings(run)[terminal].state,
            "waiting_in": waiting[rank.rank],
        },
    )


def _end_of_log(run: Run) -> int:
    """The last moment any log shows its rank alive: where a hang's time span ends."""
    return max((r.last_time() for r in run.present_ranks), default=0)


def _deadlock(
    run: Run, blocked: dict[int, Blocked], cycle: list[int], members: list[int]
) -> Finding:
    feeders = sorted(r for r in members if r not in cycle)
    parts = [_describe_blocked(blocked[r]) for r in cycle]
    steps = [_ref(run, blocked[r], f"waits for rank {blocked[r].waits_for}") for r in cycle]
    steps += [_ref(run, blocked[r], "blocked behind the cycle") for r in feeders]
    mbs = [int(run.catalog.microbatch[run.catalog.code(blocked[r].step)]) for r in cycle]
    ops = {blocked[r].op for r in cycle}
    if ops == {"send"}:
        cause = (
            "every rank in the cycle is sending to the next one before receiving: with "
            "rendezvous (unbuffered) sends nobody reaches its recv; order the sends and recvs "
            "of neighbouring ranks oppositely (e.g. odd ranks recv first)"
        )
    elif ops == {"recv"}:
        cause = "every rank in the cycle waits to receive before it sends what the next one needs"
    else:
        cause = (
            "the ranks post their sends and recvs in orders that wait on each other; the plans "
            "of these ranks do not agree on the message order"
        )
    return Finding(
        fk.DEADLOCK,
        fk.ERROR,
        "deadlock: " + " -> ".join(parts) + f" -> rank {cycle[0]}",
        cause,
        ranks=list(cycle) + feeders,
        steps=steps,
        microbatches=[m for m in mbs if m >= 0],
        iterations=sorted({blocked[r].iteration for r in cycle}),
        time_ns=(max(blocked[r].posted_ns for r in cycle), _end_of_log(run)),
        details={
            "cycle": list(cycle),
            "blocked": {str(r): _blocked_json(blocked[r]) for r in list(cycle) + feeders},
        },
    )


def _stalled(run: Run, blocked: dict[int, Blocked], terminal: int, starts: list[int]) -> Finding:
    chains = []
    members: list[int] = []
    for s in starts:
        chain, node = [], s
        while node in blocked and node not in chain:
            chain.append(node)
            node = blocked[node].waits_for  # type: ignore[assignment]
        chain.append(terminal)
        chains.append(chain)
        members.extend(chain)
    longest = max(chains, key=len)
    last = blocked[longest[-2]]
    word, text, cause = _terminal(run, terminal, last.counterpart, last.iteration)
    parts = [_describe_blocked(blocked[r]) for r in longest[:-1]]
    order = list(dict.fromkeys(members))
    steps = [
        _ref(run, blocked[r], f"waits for rank {blocked[r].waits_for}")
        for r in order
        if r in blocked
    ]
    mb = (
        int(run.catalog.microbatch[run.catalog.code(last.step)])
        if run.catalog.code(last.step) >= 0
        else -1
    )
    return Finding(
        fk.RANK_STALLED,
        fk.ERROR,
        "stalled: " + " -> ".join(parts) + f" -> {text}",
        cause,
        ranks=order,
        steps=steps,
        microbatches=[mb] if mb >= 0 else [],
        iterations=sorted({blocked[r].iteration for r in order if r in blocked}),
        time_ns=(min(blocked[r].posted_ns for r in order if r in blocked), _end_of_log(run)),
        details={
            "chain": longest,
            "terminal_rank": terminal,
            "terminal_state": word,
            "waiting_for_step": last.counterpart,
            "blocked": {str(r): _blocked_json(blocked[r]) for r in order if r in blocked},
        },
    )


def _blocked_json(b: Blocked) -> dict[str, object]:
    return {
        "op": b.op,
        "peer": b.peer,
        "step": b.step,
        "blocking_step": b.blocking_step,
        "iteration": b.iteration,
        "posted_ns": b.posted_ns,
        "waits_for": b.waits_for,
        "counterpart": b.counterpart,
    }
