"""Putting spans on tracks: slices on one Perfetto track must nest, so spans that overlap
without nesting need tracks of their own.

Both functions agree with the order `pipetrace.export.perfetto` writes events in at equal
timestamps: ends of earlier spans, then zero-length spans, then begins. So a span that
begins exactly when another ends does not overlap it.
"""

from __future__ import annotations

import heapq

import numpy as np


def nest_lanes(begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per span, a lane (0, 1, ...) such that the spans of one lane nest properly.

    Recorded steps of one thread nest (a composite holds its forward sub-step), so nearly
    everything gets lane 0; a span that would cross its enclosing one (a damaged log) moves
    to the lowest lane where it nests. Spans are ordered by (begin, longest first, row).
    Zero-length spans nest anywhere and stay in lane 0.
    """
    lanes = np.zeros(len(begin), np.int32)
    spans = np.flatnonzero(end > begin)
    if len(spans) < 2:
        return lanes
    order = spans[np.lexsort((spans, -end[spans], begin[spans]))]
    b, e = begin[order], end[order]
    reach = np.maximum.accumulate(e)
    fresh = np.r_[True, b[1:] >= reach[:-1]]  # nothing is open when this span begins
    cluster = np.cumsum(fresh) - 1
    starts = np.flatnonzero(fresh)
    head = starts[cluster]
    # No loop for the usual shapes: a span alone, or one span holding spans that follow each other.
    follows = np.r_[True, fresh[:-1] | (b[1:] >= e[:-1])]
    bad = ~fresh & ~((e <= e[head]) & follows)
    bounds = np.r_[starts, len(order)]
    for c in np.unique(cluster[bad]).tolist():
        lo, hi = bounds[c], bounds[c + 1]
        stacks: list[list[int]] = [[]]
        for row, bk, ek in zip(order[lo:hi].tolist(), b[lo:hi].tolist(), e[lo:hi].tolist()):
            for lane, stack in enumerate(stacks):
                while stack and stack[-1] <= bk:
                    stack.pop()
                if not stack or ek <= stack[-1]:
                    stack.append(ek)
                    lanes[row] = lane
                    break
            else:
                stacks.append([ek])
                lanes[row] = len(stacks) - 1
    return lanes


def pool_lanes(begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per span, the lowest lane free when it begins: one span per lane at any time.

    A lane is free only strictly after its last span ended, so no two spans of a lane
    share a timestamp (the completion instant inside a recv stays unambiguous).
    """
    n = len(begin)
    lanes = np.zeros(n, np.int32)
    if n < 2:
        return lanes
    order = np.lexsort((np.arange(n), begin))
    b, e = begin[order], end[order]
    reach = np.maximum.accumulate(e)
    fresh = np.r_[True, b[1:] > reach[:-1]]  # every lane is free again
    bounds = np.r_[np.flatnonzero(fresh), n]
    sizes = np.diff(bounds)
    lanes[order[bounds[:-1][sizes == 2] + 1]] = 1  # a pair overlaps: the second takes lane 1
    for lo, hi in zip(bounds[:-1][sizes > 2].tolist(), bounds[1:][sizes > 2].tolist()):
        free: list[int] = []
        busy: list[tuple[int, int]] = []
        count = 0
        for i, bi, ei in zip(order[lo:hi].tolist(), b[lo:hi].tolist(), e[lo:hi].tolist()):
            while busy and busy[0][0] < bi:
                heapq.heappush(free, heapq.heappop(busy)[1])
            if free:
                lane = heapq.heappop(free)
            else:
                lane = count
                count += 1
            lanes[i] = lane
            heapq.heappush(busy, (ei, lane))
    return lanes
