"""Pairing sends with recvs across ranks.

The rule (docs/trace-format.md, `seq`): a send on rank a to peer b on channel c in iteration
i with sequence number k matches the recv on rank b from peer a on channel c in iteration i
with sequence number k. All ops of the run are sorted once by that key (numpy), so pairing
costs O(n log n) with no Python loop over ops. When a key occurs more than once on a side
(a damaged log), the j-th send with that key pairs with the j-th recv, in post order.
"""

from __future__ import annotations

import numpy as np

from pipetrace.analyze.derive import position_in_run, run_bounds, run_starts
from pipetrace.analyze.model import OP_SEND, RankTimeline


def match_messages(ranks: list[RankTimeline]) -> int:
    """Fill every P2P table's ``match_rank`` / ``match_index``; returns the number of pairs."""
    for rank in ranks:
        rank.p2p.match_rank = np.full(len(rank.p2p), -1, np.int32)
        rank.p2p.match_index = np.full(len(rank.p2p), -1, np.int64)
    parts = [r for r in ranks if len(r.p2p)]
    if not parts:
        return 0
    if all(_packable(r.p2p) for r in parts):
        return _match_by_channel(parts)
    return _match_general(parts)


_SEQ_BITS, _IT_BITS = 31, 29


def _packable(p) -> bool:
    return bool(
        p.seq.min() >= 0
        and p.seq.max() < 2**_SEQ_BITS
        and p.it.min() >= 0
        and p.it.max() < 2**_IT_BITS
        and p.ch.min() >= -1
        and p.ch.max() <= 1
    )


def _packed(p) -> np.ndarray:
    """(iteration, channel, seq) of every row as one int64."""
    return (
        (p.it.astype(np.int64) << (_SEQ_BITS + 2))
        | ((p.ch.astype(np.int64) + 1) << _SEQ_BITS)
        | p.seq
    )


def _occurrence(sorted_keys: np.ndarray) -> np.ndarray:
    """For sorted keys, how many equal keys precede each one."""
    return position_in_run(run_starts(sorted_keys), len(sorted_keys))


def _match_by_channel(parts: list[RankTimeline]) -> int:
    """Pair rank by rank pair: each side's ops on a (sender, receiver) pair sorted by their
    packed key, the j-th occurrence of a key on one side with the j-th on the other. Small
    sorts per pair instead of one sort of every op of the run."""
    by_id = {r.rank: r for r in parts}
    packed = {r.rank: _packed(r.p2p) for r in parts}
    groups: dict[tuple[int, int, int], np.ndarray] = {}
    for r in parts:
        p = r.p2p
        key = p.op.astype(np.int64) * 2**33 + (p.peer.astype(np.int64) + 2**31)
        order = np.argsort(key, kind="stable")  # stable: rows stay in post order
        k = key[order]
        bounds = run_bounds(run_starts(k), len(k))
        for lo, hi in zip(bounds, bounds[1:]):
            row = order[lo]
            groups[(r.rank, int(p.op[row]), int(p.peer[row]))] = order[lo:hi]
    pairs = 0
    for (rank, op, peer), send_rows in groups.items():
        if op != OP_SEND:
            continue
        recv_rows = groups.get((peer, 1 - OP_SEND, rank))
        if recv_rows is None:
            continue
        a, b = by_id[rank].p2p, by_id[peer].p2p
        ka, kb = packed[rank][send_rows], packed[peer][recv_rows]
        oa, ob = np.argsort(ka, kind="stable"), np.argsort(kb, kind="stable")
        ka, kb = ka[oa], kb[ob]
        if np.array_equal(ka, kb):  # the usual case: every message has its two sides, once
            sends, recvs = send_rows[oa], recv_rows[ob]
        else:
            pos = np.searchsorted(kb, ka) + _occurrence(ka)
            ok = pos < len(kb)
            ok[ok] = kb[pos[ok]] == ka[ok]
            sends, recvs = send_rows[oa[ok]], recv_rows[ob[pos[ok]]]
        a.match_rank[sends], a.match_index[sends] = peer, recvs
        b.match_rank[recvs], b.match_index[recvs] = rank, sends
        pairs += len(sends)
    return pairs


def _match_general(parts: list[RankTimeline]) -> int:
    """The same pairing for any key values (one global sort)."""
    rank_col = np.concatenate([np.full(len(r.p2p), r.rank, np.int64) for r in parts])
    row_col = np.concatenate([np.arange(len(r.p2p), dtype=np.int64) for r in parts])
    op = np.concatenate([r.p2p.op for r in parts]).astype(np.int64)
    peer = np.concatenate([r.p2p.peer for r in parts]).astype(np.int64)
    is_send = op == OP_SEND
    sender = np.where(is_send, rank_col, peer)
    receiver = np.where(is_send, peer, rank_col)
    it = np.concatenate([r.p2p.it for r in parts]).astype(np.int64)
    ch = np.concatenate([r.p2p.ch for r in parts]).astype(np.int64)
    seq = np.concatenate([r.p2p.seq for r in parts])
    post = np.concatenate([r.p2p.post for r in parts])
    keys, order = _message_order(sender, receiver, it, ch, seq, op, post)
    send_at, recv_at = _pair_in_groups([k[order] for k in keys], op[order])
    s_idx, r_idx = order[send_at], order[recv_at]
    by_rank = {r.rank: r for r in parts}
    for a, b in ((s_idx, r_idx), (r_idx, s_idx)):
        _write_matches(by_rank, rank_col, row_col, a, b)
    return len(send_at)


def _message_order(
    sender: np.ndarray,
    receiver: np.ndarray,
    it: np.ndarray,
    ch: np.ndarray,
    seq: np.ndarray,
    op: np.ndarray,
    post: np.ndarray,
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The ops sorted by message (sender, receiver, iteration, channel, seq), sends first in
    each message, each rank's rows in post order; and the keys that tell the messages apart."""
    if (
        len(seq)
        and seq.min() >= 0
        and seq.max() < 2**31
        and it.min() >= 0
        and it.max() < 2**30
        and ch.min() >= -1
        and ch.max() < 2
        and sender.min() >= 0
        and receiver.min() >= 0
        and receiver.max() < 2**31
    ):
        # Two int64 keys sort much faster than five; the op goes in the lowest bit so that
        # sends come first in a group, and stable sorts keep each rank's rows (post order).
        pair = sender * (receiver.max() + 1) + receiver
        packed = (it << 34) | ((ch + 1) << 32) | (seq << 1)
        first = np.argsort(packed | op, kind="stable")
        return (pair, packed), first[np.argsort(pair[first], kind="stable")]
    keys = (sender, receiver, it, ch, seq)
    return keys, np.lexsort((post, op, seq, ch, it, receiver, sender))


def _pair_in_groups(
    sorted_keys: list[np.ndarray], op_sorted: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """In each group of equal keys (sends first), the k-th send pairs with the k-th recv:
    the sorted positions of each paired send and of its recv."""
    n = len(op_sorted)
    new_group = np.zeros(n, bool)
    new_group[:1] = True
    for k in sorted_keys:
        new_group[1:] |= k[1:] != k[:-1]
    group = np.cumsum(new_group) - 1
    group_start = np.flatnonzero(new_group)
    sends_in_group = np.add.reduceat((op_sorted == OP_SEND).astype(np.int64), group_start)
    position = np.arange(n) - group_start[group]  # index within the group (sends come first)
    num_sends = sends_in_group[group]
    is_recv_sorted = op_sorted != OP_SEND
    occurrence = np.where(is_recv_sorted, position - num_sends, position)
    group_size = np.diff(np.r_[group_start, n])[group]
    num_recvs = group_size - num_sends
    send_at = np.flatnonzero((~is_recv_sorted) & (occurrence < num_recvs))
    recv_at = group_start[group[send_at]] + num_sends[send_at] + occurrence[send_at]
    return send_at, recv_at


def _write_matches(
    by_rank: dict[int, RankTimeline],
    rank_col: np.ndarray,
    row_col: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
) -> None:
    """Each op ``a`` (an index into the concatenated ops) is matched with ``b``: written
    into its own rank's table, rank by rank."""
    by_owner = np.argsort(rank_col[a], kind="stable")
    a, b = a[by_owner], b[by_owner]
    owner = rank_col[a]
    cuts = np.flatnonzero(owner[1:] != owner[:-1]) + 1
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(a)]):
        if hi <= lo:
            continue
        table = by_rank[int(owner[lo])].p2p
        rows = row_col[a[lo:hi]]
        table.match_rank[rows] = rank_col[b[lo:hi]]
        table.match_index[rows] = row_col[b[lo:hi]]
