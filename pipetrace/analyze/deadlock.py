"""Hangs: the wait-for graph behind deadlock and rank_stalled.

Each unfinished rank waits on one thing (`blocked`: a peer, or nobody when the transfer
itself is stuck). Following these edges from every blocked rank ends either in a cycle
(**deadlock**) or at a rank that is not blocked (**rank_stalled**): one still computing,
failed, finished without posting the counterpart, or without a log (`terminal` says which).
"""

from __future__ import annotations

from pipetrace import units
from pipetrace.analyze import endings as en
from pipetrace.analyze import findings as fk
from pipetrace.analyze.blocked import Blocked, blocked_ranks
from pipetrace.analyze.findings import Finding, StepRef
from pipetrace.analyze.model import RankState, Run
from pipetrace.analyze.terminal import terminal
from pipetrace.schedule import waitfor


def find_hangs(run: Run) -> list[Finding]:
    blocked = blocked_ranks(run)
    groups = waitfor.solve({r: b.waits_for for r, b in blocked.items()}, blocked)
    by_kind = {kind: [g for g in groups if g.kind == kind] for kind in waitfor.KINDS}
    findings = [_deadlock(run, blocked, g.cycle, g.members) for g in by_kind[waitfor.CYCLE]]
    for g in sorted(by_kind[waitfor.ENDS_AT], key=lambda g: g.end):
        findings.append(_stalled(run, blocked, g.end, g.members))
    stuck = [blocked[g.end] for g in by_kind[waitfor.DEAD_END]]
    findings += [_stuck_transfer(run, b) for b in stuck if not _told_by_peer(b, stuck)]
    return findings + _lone_stalls(run, {r for f in findings for r in f.ranks})


def _stuck_transfer(run: Run, b: Blocked) -> Finding:
    """A blocked rank whose peer reached the counterpart: the transfer itself never ended,
    or the peer had given up on it before this rank got there."""
    cause = (
        "the transfer itself is stuck: the two sides disagree on the message (size, tag) "
        "or the transport lost it"
    )
    peer = run.ranks[b.peer]
    left = peer.last_time()
    if left < b.posted_ns:
        cause = (
            f"rank {b.peer}'s log ends ({peer.status.state}) "
            f"{units.duration(b.posted_ns - left)} before rank {b.rank} got to the "
            "message: it gave up or died before its peer came (a slow peer, or a stall or "
            "P2P timeout too short for it)"
        )
    return Finding(
        fk.RANK_STALLED,
        fk.ERROR,
        f"{b.describe()} never completed although rank {b.peer} reached the "
        f"counterpart {b.counterpart} ({b.counterpart_state})",
        cause,
        ranks=[b.rank, b.peer],
        steps=[_ref(b, "blocked")],
        iterations=[b.iteration],
        time_ns=(b.posted_ns, _end_of_log(run)),
        details={
            "chain": [b.rank, b.peer],
            "terminal_rank": b.peer,
            "terminal_state": "transfer",
            "blocked": {str(b.rank): _blocked_json(b)},
        },
    )


def _told_by_peer(b: Blocked, stuck: list[Blocked]) -> bool:
    """Both sides of one message are stuck in it: one finding tells it, the one of the rank
    that got there last (the lower rank's on a tie)."""
    return any(
        o.rank == b.peer
        and o.step == b.counterpart
        and (o.posted_ns, -o.rank) > (b.posted_ns, -b.rank)
        for o in stuck
    )


def _lone_stalls(run: Run, in_findings: set[int]) -> list[Finding]:
    """Ranks the watchdog saw stalled, or still computing / hung at the end, that no wait
    chain reached: each stalled on its own."""
    waiting = en.waiting_outside_iterations(run)
    endings = en.rank_endings(run)
    out = []
    at_end: dict[str, list[int]] = {}  # what they wait in -> the ranks waiting there
    for rank in run.present_ranks:
        state = endings[rank.rank].state
        watched = rank.status.state in (RankState.STALLED, RankState.ABORTED)
        if rank.rank in in_findings or not (
            (watched and state != en.INTERRUPTED) or state in (en.COMPUTING, en.HUNG)
        ):
            continue
        if rank.rank in waiting:
            at_end.setdefault(waiting[rank.rank], []).append(rank.rank)
            continue
        end = terminal(run, rank.rank, "", -1)
        out.append(
            Finding(
                fk.RANK_STALLED,
                fk.ERROR,
                f"rank {rank.rank} stalled: {end.text.split(';')[0]}",
                end.cause,
                ranks=[rank.rank],
                details={
                    "chain": [rank.rank],
                    "terminal_rank": rank.rank,
                    "terminal_state": end.state,
                },
            )
        )
    told = in_findings | {r for f in out for r in f.ranks}
    return [*out, *(_stalled_at_end(run, ranks, where, told) for where, ranks in at_end.items())]


def _ref(b: Blocked, note: str) -> StepRef:
    return StepRef(b.rank, b.blocking_step, b.iteration, None, b.posted_ns, note)


def _stalled_at_end(run: Run, ranks: list[int], where: str, told: set[int]) -> Finding:
    """The ranks that finished their iterations and wait in ``where`` (the end-of-run clock
    exchange) for the ranks that never came: one finding for all of them. When every absent
    rank is in a hang told already, this wait follows from it."""
    waiting = set(ranks)
    absent = [
        r.rank
        for r in run.ranks
        if r.rank not in waiting
        and r.status.state not in (RankState.FINISHED, RankState.NOT_LOADED)
    ]
    who = en.said_ranks(absent) if absent else "a peer"
    end_rank = absent[0] if absent else ranks[0]  # no absent rank known: its own end
    severity, cause = (
        fk.ERROR,
        f"{who} stopped outside the pipeline's iterations (hung or slow in user code between "
        "iterations: checkpointing, evaluation, data loading) or died",
    )
    if absent and told.issuperset(absent):
        severity, cause = (
            fk.WARNING,
            f"{who} never left {'its' if len(absent) == 1 else 'their'} iterations: "
            f"{'it is' if len(absent) == 1 else 'they are'} in the hang told above, which this "
            "wait follows from",
        )
    return Finding(
        fk.RANK_STALLED,
        severity,
        f"{en.said_ranks(ranks)} finished {'its' if len(ranks) == 1 else 'their'} iterations and "
        f"stalled in {where}: {who} never got there",
        cause,
        ranks=[*ranks, *absent],
        details={
            "chain": [*ranks, *absent],
            "terminal_rank": end_rank,
            "terminal_state": en.rank_endings(run)[end_rank].state,
            "waiting_in": where,
        },
    )


def _end_of_log(run: Run) -> int:
    """The last moment any log shows its rank alive: where a hang's time span ends."""
    return max((r.last_time() for r in run.present_ranks), default=0)


def _deadlock(
    run: Run, blocked: dict[int, Blocked], cycle: list[int], members: list[int]
) -> Finding:
    feeders = sorted(r for r in members if r not in cycle)
    parts = [blocked[r].describe() for r in cycle]
    steps = [_ref(blocked[r], f"waits for rank {blocked[r].waits_for}") for r in cycle]
    steps += [_ref(blocked[r], "blocked behind the cycle") for r in feeders]
    mbs = [int(run.catalog.microbatch[run.catalog.code(blocked[r].step)]) for r in cycle]
    return Finding(
        fk.DEADLOCK,
        fk.ERROR,
        "deadlock: " + " -> ".join(parts) + f" -> rank {cycle[0]}",
        _deadlock_cause({blocked[r].op for r in cycle}),
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


def _deadlock_cause(ops: set[str]) -> str:
    if ops == {"send"}:
        return (
            "every rank in the cycle is sending to the next one before receiving: with "
            "rendezvous (unbuffered) sends nobody reaches its recv; order the sends and recvs "
            "of neighbouring ranks oppositely (e.g. odd ranks recv first)"
        )
    if ops == {"recv"}:
        return "every rank in the cycle waits to receive before it sends what the next one needs"
    return (
        "the ranks post their sends and recvs in orders that wait on each other; the plans "
        "of these ranks do not agree on the message order"
    )


def _stalled(run: Run, blocked: dict[int, Blocked], end_rank: int, starts: list[int]) -> Finding:
    """The wait chains from ``starts`` all end at ``end_rank``, which is not blocked."""
    chains = [_chain(blocked, s) + [end_rank] for s in starts]
    longest = max(chains, key=len)
    last = blocked[longest[-2]]
    end = terminal(run, end_rank, last.counterpart, last.iteration)
    parts = [blocked[r].describe() for r in longest[:-1]]
    order = [r for r in dict.fromkeys(r for chain in chains for r in chain) if r in blocked]
    code = run.catalog.code(last.step)
    mb = int(run.catalog.microbatch[code]) if code >= 0 else -1
    return Finding(
        fk.RANK_STALLED,
        fk.ERROR,
        "stalled: " + " -> ".join(parts) + f" -> {end.text}",
        end.cause,
        ranks=list(dict.fromkeys(r for chain in chains for r in chain)),
        steps=[_ref(blocked[r], f"waits for rank {blocked[r].waits_for}") for r in order],
        microbatches=[mb] if mb >= 0 else [],
        iterations=sorted({blocked[r].iteration for r in order}),
        time_ns=(min(blocked[r].posted_ns for r in order), _end_of_log(run)),
        details={
            "chain": longest,
            "terminal_rank": end_rank,
            "terminal_state": end.state,
            "waiting_for_step": last.counterpart,
            "blocked": {str(r): _blocked_json(blocked[r]) for r in order},
        },
    )


def _chain(blocked: dict[int, Blocked], start: int) -> list[int]:
    """The blocked ranks from ``start`` along the waits, until one that is not blocked."""
    chain, node = [], start
    while node in blocked and node not in chain:
        chain.append(node)
        node = blocked[node].waits_for  # type: ignore[assignment]
    return chain


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
