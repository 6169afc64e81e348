"""Message problems: unmatched_send, unmatched_recv, message_mismatch, order_crossing.

Pairs come from `matching` (the (iteration, channel, seq) rule). Each op also says which
message it *means*: the step that posted it names the sending stage and the micro-batch
(`derive.message_identity`). On one channel (sender, receiver, channel) and iteration, the
sender's sequence of meant messages, in post order, must equal the receiver's:

- a message meant on one side only -> unmatched_send / unmatched_recv (reported once it can
  no longer come: the peer finished, failed, moved on, ran the counterpart step without
  posting it, or has no such step; an op still waiting in a hung run is the hang's business);
- same messages, different order -> order_crossing: a transport that matches by order (NCCL,
  or gloo without tags) hands the receiver the wrong micro-batch even when shapes agree;
- a pair that disagrees on bytes, shape or dtype -> message_mismatch.

Only channel-iterations with a symptom (an unmatched op, a pair whose meanings differ, or a
pair out of order) are examined in Python; a clean run costs a few numpy passes.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from pipetrace.analyze import findings as fk
from pipetrace.analyze.derive import counterpart_text, message_identity
from pipetrace.analyze.findings import Finding, StepRef
from pipetrace.analyze.model import CHANNELS, OP_SEND, OPEN, P2PTable, RankState, Run

Group = tuple[int, int, int, int]  # (sender, receiver, channel, iteration)


def find_message_problems(run: Run) -> list[Finding]:
    identities = {r.rank: message_identity(r, run.catalog) for r in run.present_ranks}
    flagged: set[Group] = set()
    mismatches: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)
    for rank in run.present_ranks:
        p = rank.p2p
        if not len(p):
            continue
        src, mb = identities[rank.rank]
        unmatched = p.match_rank < 0
        for row in np.flatnonzero(unmatched):
            flagged.add(_group(rank.rank, p, int(row)))
        sends = np.flatnonzero((p.op == OP_SEND) & ~unmatched)
        if not len(sends):
            continue
        peers = p.match_rank[sends]
        for peer in np.unique(peers):
            rows = sends[peers == peer]
            other = run.ranks[int(peer)].p2p
            orows = p.match_index[rows]
            osrc, omb = identities[int(peer)]
            differ = (src[rows] != osrc[orows]) | (mb[rows] != omb[orows])
            ch, it = p.ch[rows], p.it[rows]
            # order: by send row, the matched recv rows must increase within (channel, iteration)
            backwards = np.zeros(len(rows), bool)
            backwards[1:] = (ch[1:] == ch[:-1]) & (it[1:] == it[:-1]) & (orows[1:] < orows[:-1])
            for row in rows[differ | backwards]:
                flagged.add(_group(rank.rank, p, int(row)))
            bad = (
                (p.nbytes[rows] != other.nbytes[orows])
                | (p.dtype[rows] != other.dtype[orows])
                | (p.shape[rows] != other.shape[orows])
            )
            for row, orow in zip(rows[bad], orows[bad]):
                mismatches[(rank.rank, int(peer), int(p.ch[row]))].append((int(row), int(orow)))
    out = [_mismatch(run, key, pairs) for key, pairs in sorted(mismatches.items())]
    unmatched_sends: dict[tuple[int, int, int], list] = defaultdict(list)
    unmatched_recvs: dict[tuple[int, int, int], list] = defaultdict(list)
    crossings: dict[tuple[int, int, int], list] = defaultdict(list)
    for group in sorted(flagged):
        _examine(run, group, identities, unmatched_sends, unmatched_recvs, crossings)
    for key, items in sorted(unmatched_sends.items()):
        out.append(_unmatched(run, key, items, send=True))
    for key, items in sorted(unmatched_recvs.items()):
        out.append(_unmatched(run, key, items, send=False))
    for key, items in sorted(crossings.items()):
        out.append(_crossing(run, key, items))
    return out


def _channel(ch: int) -> str:
    """A channel's name ("F", "B"); the loader keeps any other one only as such."""
    return CHANNELS[ch] if ch in (0, 1) else "other than F and B"


def _group(rank: int, p: P2PTable, row: int) -> Group:
    peer = int(p.peer[row])
    sender, receiver = (rank, peer) if p.op[row] == OP_SEND else (peer, rank)
    return sender, receiver, int(p.ch[row]), int(p.it[row])


def _rows(run: Run, rank: int, peer: int, op: int, ch: int, it: int) -> np.ndarray:
    if not 0 <= rank < run.world_size or not run.ranks[rank].present:
        return np.empty(0, np.int64)
    p = run.ranks[rank].p2p
    return np.flatnonzero((p.op == op) & (p.peer == peer) & (p.ch == ch) & (p.it == it))


def _examine(
    run: Run, group: Group, identities, unmatched_sends, unmatched_recvs, crossings
) -> None:
    sender, receiver, ch, it = group
    s_rows = _rows(run, sender, receiver, OP_SEND, ch, it)
    r_rows = _rows(run, receiver, sender, 1 - OP_SEND, ch, it)
    s_ids = _ids(identities.get(sender), s_rows)
    r_ids = _ids(identities.get(receiver), r_rows)
    known = all(i[1] >= 0 for i in s_ids + r_ids)
    if not known:  # meanings unknown: fall back to the seq pairing
        for row in s_rows:
            if run.ranks[sender].p2p.match_rank[row] < 0:
                _maybe_unmatched(run, sender, receiver, int(row), ch, it, unmatched_sends, True)
        for row in r_rows:
            if run.ranks[receiver].p2p.match_rank[row] < 0:
                _maybe_unmatched(run, receiver, sender, int(row), ch, it, unmatched_recvs, False)
        return
    extra = Counter(s_ids) - Counter(r_ids)
    missing = Counter(r_ids) - Counter(s_ids)
    kept_s = _drop(
        s_rows,
        s_ids,
        extra,
        lambda row: _maybe_unmatched(run, sender, receiver, row, ch, it, unmatched_sends, True),
    )
    kept_r = _drop(
        r_rows,
        r_ids,
        missing,
        lambda row: _maybe_unmatched(run, receiver, sender, row, ch, it, unmatched_recvs, False),
    )
    seq_s = [i for _, i in kept_s]
    seq_r = [i for _, i in kept_r]
    if seq_s != seq_r:
        crossed = [(a, b, ia, ib) for (a, ia), (b, ib) in zip(kept_s, kept_r) if ia != ib]
        crossings[(sender, receiver, ch)].append((it, crossed))


def _ids(identity, rows: np.ndarray) -> list[tuple[int, int]]:
    if identity is None:
        return []
    src, mb = identity
    return list(zip(src[rows].tolist(), mb[rows].tolist()))


def _drop(
    rows: np.ndarray, ids: list, surplus: Counter, report
) -> list[tuple[int, tuple[int, int]]]:
    """Remove surplus meanings (the last occurrences) and report them; returns the rest."""
    surplus = Counter(surplus)
    kept = []
    for row, ident in reversed(list(zip(rows.tolist(), ids))):
        if surplus.get(ident, 0) > 0:
            surplus[ident] -= 1
            report(row)
        else:
            kept.append((row, ident))
    kept.reverse()
    return kept


def _maybe_unmatched(
    run: Run, rank: int, peer: int, row: int, ch: int, it: int, into, send: bool
) -> None:
    """Record an op without counterpart if the counterpart can no longer come."""
    p = run.ranks[rank].p2p
    src, mb = message_identity(run.ranks[rank], run.catalog)
    wanted = (
        counterpart_text(int(p.op[row]), ch, int(src[row]), int(mb[row])) if src[row] >= 0 else None
    )
    reason = _why_never(run, peer, wanted, it)
    if reason is None:
        # The peer failed, hung or stopped before it could post the counterpart: a consequence,
        # reported as rank_failed / deadlock / rank_stalled, not as a message problem.
        return
    into[(rank, peer, ch)].append((row, it, int(mb[row]), wanted, reason))


def _why_never(run: Run, peer: int, wanted: str | None, it: int) -> str | None:
    if not 0 <= peer < run.world_size:
        return f"rank {peer} does not exist"
    other = run.ranks[peer]
    if not other.present:
        return None  # reported as rank_failed
    if wanted is not None and other.plan and wanted not in other.plan:
        return f"rank {peer}'s plan has no {wanted}"
    if wanted is not None:
        code = run.catalog.code(wanted)
        done_rows = np.flatnonzero(
            (other.steps.code == code) & (other.steps.it == it) & (other.steps.end != OPEN)
        )
        if code >= 0 and len(done_rows):
            return (
                f"rank {peer} ran {wanted} without posting it (a custom step function that "
                "skips the message?)"
            )
    if other.status.state == RankState.FINISHED:
        return f"rank {peer} finished without {wanted or 'a counterpart'}"
    if (
        len(other.iterations)
        and int(other.iterations.it.max()) > it
        and (other.iterations.end[other.iterations.it == it] != OPEN).all()
    ):
        return f"rank {peer} moved on to later iterations without {wanted or 'a counterpart'}"
    return None


def _ref(run: Run, rank: int, row: int, note: str | None = None) -> StepRef:
    p = run.ranks[rank].p2p
    return StepRef(
        rank, run.catalog.texts[int(p.code[row])], int(p.it[row]), None, int(p.post[row]), note
    )


def _duplicate(run: Run, key: tuple[int, int, int], item: tuple) -> tuple:
    """An unmatched send, with the reason it has none when its micro-batch was sent twice
    (the peer's recv took the other copy: what it did or did not run is beside the point)."""
    rank, peer, ch = key
    row, it, mb, wanted, _ = item
    if _count_meant(run, rank, peer, ch, it, mb, True) <= 1:
        return item
    return (row, it, mb, wanted, f"micro-batch {mb} was sent more than once")


def _unmatched(run: Run, key: tuple[int, int, int], items: list, send: bool) -> Finding:
    rank, peer, ch = key
    row, it, _, wanted, _ = items[0]
    text = run.catalog.texts[int(run.ranks[rank].p2p.code[row])]
    what = "sent" if send else "waited to receive"
    more = f" (and {len(items) - 1} more on this channel)" if len(items) > 1 else ""
    direction = "to" if send else "from"
    items = [_duplicate(run, key, item) if send else item for item in items]
    cause = items[0][4]
    return Finding(
        fk.UNMATCHED_SEND if send else fk.UNMATCHED_RECV,
        fk.ERROR,
        f"rank {rank} {what} {text} (channel {_channel(ch)}, iteration {it}) {direction} "
        f"rank {peer} with no counterpart{more}",
        cause,
        ranks=[rank, peer],
        steps=[_ref(run, rank, r[0], r[4]) for r in items[:20]],
        microbatches=[r[2] for r in items if r[2] >= 0],
        iterations=sorted({r[1] for r in items}),
        time_ns=(int(run.ranks[rank].p2p.post[row]), int(run.ranks[rank].p2p.post[items[-1][0]])),
        details={
            "channel": _channel(ch),
            "count": len(items),
            "counterpart": wanted,
            "ops": [
                {"row": r[0], "iteration": r[1], "microbatch": r[2], "reason": r[4]}
                for r in items[:50]
            ],
        },
    )


def _count_meant(run: Run, rank: int, peer: int, ch: int, it: int, mb: int, send: bool) -> int:
    rows = _rows(run, rank, peer, OP_SEND if send else 1 - OP_SEND, ch, it)
    _, mbs = message_identity(run.ranks[rank], run.catalog)
    return int((mbs[rows] == mb).sum())


def _wire(run: Run, p: P2PTable, row: int) -> dict[str, object]:
    """What one side of a message put on the wire: shape, dtype and size."""
    return {
        "shape": list(run.shapes[int(p.shape[row])]),
        "dtype": run.dtypes[int(p.dtype[row])],
        "bytes": int(p.nbytes[row]),
    }


def _describe_wire(wire: dict[str, object]) -> str:
    return f"{wire['shape']} {wire['dtype']} ({wire['bytes']} bytes)"


def _mismatch(run: Run, key: tuple[int, int, int], pairs: list[tuple[int, int]]) -> Finding:
    sender, receiver, ch = key
    sp, rp = run.ranks[sender].p2p, run.ranks[receiver].p2p
    row, orow = pairs[0]
    sent, expected = _wire(run, sp, row), _wire(run, rp, orow)
    diffs = [
        name
        for name, a, b in (
            ("bytes", sp.nbytes[row], rp.nbytes[orow]),
            ("shape", sp.shape[row], rp.shape[orow]),
            ("dtype", sp.dtype[row], rp.dtype[orow]),
        )
        if a != b
    ]
    src, mbs = message_identity(run.ranks[sender], run.catalog)
    what = "output" if ch == 0 else "input gradient"
    return Finding(
        fk.MESSAGE_MISMATCH,
        fk.ERROR,
        f"rank {sender} sent {run.catalog.texts[int(sp.code[row])]} as {_describe_wire(sent)} "
        f"but rank {receiver} expected {_describe_wire(expected)} in "
        f"{run.catalog.texts[int(rp.code[orow])]}"
        + (f" ({len(pairs)} messages on this channel)" if len(pairs) > 1 else ""),
        f"the {'/'.join(diffs)} of stage {int(src[row])}'s {what} changed after the receiver "
        "learned it (or the two stages disagree on it)",
        ranks=[sender, receiver],
        steps=[_ref(run, sender, row), _ref(run, receiver, orow)],
        microbatches=sorted({int(mbs[r]) for r, _ in pairs if mbs[r] >= 0}),
        iterations=sorted({int(sp.it[r]) for r, _ in pairs}),
        time_ns=(int(sp.post[row]), int(max(rp.done[orow], sp.post[row]))),
        details={
            "channel": _channel(ch),
            "count": len(pairs),
            "differs": diffs,
            "send": sent,
            "recv": expected,
        },
    )


def _crossing(run: Run, key: tuple[int, int, int], items: list) -> Finding:
    sender, receiver, ch = key
    it, crossed = items[0]
    sends = [run.catalog.texts[int(run.ranks[sender].p2p.code[a])] for a, _, _, _ in crossed]
    recvs = [run.catalog.texts[int(run.ranks[receiver].p2p.code[b])] for _, b, _, _ in crossed]
    mbs = sorted({m for _, _, ia, ib in crossed for m in (ia[1], ib[1])})
    steps = [
        _ref(run, sender, a, f"posted as message {k}")
        for k, (a, _, _, _) in enumerate(crossed[:10])
    ]
    steps += [
        _ref(run, receiver, b, f"posted as message {k}")
        for k, (_, b, _, _) in enumerate(crossed[:10])
    ]
    return Finding(
        fk.ORDER_CROSSING,
        fk.ERROR,
        f"channel {_channel(ch)} rank {sender} -> rank {receiver}, iteration {it}: "
        f"sends in order {', '.join(sends[:6])} but receives in order {', '.join(recvs[:6])}"
        + (f" ({len(items)} iterations affected)" if len(items) > 1 else ""),
        "the sender's and receiver's plans order these messages differently; with order-matched "
        "P2P (NCCL, untagged gloo) the receiver gets the wrong micro-batch even when shapes agree",
        ranks=[sender, receiver],
        steps=steps,
        microbatches=mbs,
        iterations=sorted(i for i, _ in items),
        time_ns=(
            int(run.ranks[sender].p2p.post[crossed[0][0]]),
            int(run.ranks[receiver].p2p.post[crossed[-1][1]]),
        ),
        details={
            "channel": _channel(ch),
            "send_order": sends,
            "recv_order": recvs,
            "iterations": len(items),
        },
    )
