"""Small derived views of the run model that several analyzers share (all vectorized)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetrace.analyze.model import (
    IS_COMPOSITE,
    KIND_CODE,
    MAIN_THREAD,
    OP_SEND,
    RankTimeline,
    Run,
    StepCatalog,
)
from pipetrace.schedule.ir import StepKind

_RECV_F = KIND_CODE[StepKind.RECV_F]
_RECV_B = KIND_CODE[StepKind.RECV_B]
_SEND_F = KIND_CODE[StepKind.SEND_F]
_SEND_B = KIND_CODE[StepKind.SEND_B]


def top_level(rank: RankTimeline, catalog: StepCatalog) -> np.ndarray:
    """Row indices of the steps the rank's plan lists, in order: main-thread rows, without the
    sub-steps of a composite (they repeat the composite's position)."""
    cached = getattr(rank, "_top_level", None)
    if cached is not None and cached[0] is rank.steps:
        return cached[1]
    rows = _top_level(rank, catalog)
    rank._top_level = (rank.steps, rows)  # type: ignore[attr-defined]
    return rows


def _top_level(rank: RankTimeline, catalog: StepCatalog) -> np.ndarray:
    steps = rank.steps
    main = np.flatnonzero(steps.thread == MAIN_THREAD)
    if len(main) < 2:
        return main
    is_composite = IS_COMPOSITE[catalog.kind[steps.code[main]]]
    if not is_composite.any():
        return main
    pos, it = steps.pos[main], steps.it[main]
    # a sub-step follows its composite (or the composite's other sub-step) at the same position
    same = np.concatenate(([False], (pos[1:] == pos[:-1]) & (it[1:] == it[:-1])))
    # propagate "inside a composite" along runs of equal positions
    run_start = np.flatnonzero(~same)
    run_id = np.cumsum(~same) - 1
    sub = same & is_composite[run_start[run_id]]
    return main[~sub]


def message_identity(rank: RankTimeline, catalog: StepCatalog) -> tuple[np.ndarray, np.ndarray]:
    """Per P2P row, the message it means: (sending stage, micro-batch), from its step text.

    SEND_F s m and RECV_F s+1 m mean the activations of stage s; SEND_B s m and RECV_B s-1 m
    the input gradient of stage s. -1 where the text is not a SEND/RECV step.
    """
    src, mb = _messages_by_code(catalog)
    codes = rank.p2p.code
    return src[codes], mb[codes]


def _messages_by_code(catalog: StepCatalog) -> tuple[np.ndarray, np.ndarray]:
    """`message_identity` of every code of the catalog, made once: the analyzers ask it of
    every rank, several times, and a big run has thousands of ranks."""
    table = catalog.messages_by_code
    if table is None or len(table[0]) != len(catalog.kind):
        kinds = catalog.kind
        stage = catalog.stage.astype(np.int64)
        src = np.full(len(kinds), -1, np.int64)
        src = np.where((kinds == _SEND_F) | (kinds == _SEND_B), stage, src)
        src = np.where(kinds == _RECV_F, stage - 1, src)
        src = np.where(kinds == _RECV_B, stage + 1, src)
        mb = np.where(src >= 0, catalog.microbatch.astype(np.int64), -1)
        table = catalog.messages_by_code = (src, mb)
    return table


def counterpart_values(ranks: list[RankTimeline], column: str) -> dict[int, np.ndarray]:
    """Per rank and P2P row, the ``column`` ("post", "done", ...) of the op it was matched
    with, -1 when unmatched. ``ranks`` must hold every rank an op is matched to.

    One gather per rank from the ranks' concatenated columns: a loop over each rank's peers
    costs several numpy calls per peer, and a big run has thousands of ranks."""
    columns = [getattr(r.p2p, column) for r in ranks]
    flat = np.concatenate([*columns, [-1]]).astype(
        np.int64, copy=False
    )  # the -1 at the end: read by unmatched rows
    sizes = np.array([len(c) for c in columns], np.int64)
    first = np.zeros(
        max((r.rank for r in ranks), default=0) + 1, np.int64
    )  # by rank: its first row in flat
    first[[r.rank for r in ranks]] = np.cumsum(sizes) - sizes
    out = {}
    for r in ranks:
        p = r.p2p
        out[r.rank] = flat[
            np.where(p.match_rank >= 0, first[p.match_rank] + p.match_index, len(flat) - 1)
        ]
    return out


def counterpart_text(op: int, channel: int, src_stage: int, mb: int) -> str:
    """The step the peer must run to complete a message: its SEND for a recv, its RECV for a
    send."""
    ch = "FB"[channel] if channel in (0, 1) else "?"
    if op == OP_SEND:
        dst = src_stage + 1 if ch == "F" else src_stage - 1
        return f"{dst}RECV_{ch}{mb}"
    return f"{src_stage}SEND_{ch}{mb}"


@dataclass(frozen=True)
class StepMessage:
    """The message a SEND/RECV step means, and the rank at its other end."""

    op: int  # OP_SEND, or the recv's code
    channel: int  # 0 forward (activations), 1 backward (gradients)
    src: int  # the sending stage
    microbatch: int
    peer: int

    @property
    def counterpart(self) -> str:
        return counterpart_text(self.op, self.channel, self.src, self.microbatch)


def step_message(run: Run, rank: int, code: int) -> StepMessage | None:
    """What the step ``code`` of ``rank`` sends or receives, from its text and the plan's
    placement (None: not a SEND/RECV step, no plan, or a stage outside the placement)."""
    step = run.catalog.step(code)
    if step is None or not step.is_comm or run.plan is None:
        return None
    kind = step.kind.value
    channel = 0 if kind.endswith("F") else 1
    op = OP_SEND if kind.startswith("SEND") else 1 - OP_SEND
    direction = 1 if channel == 0 else -1
    src = step.stage if op == OP_SEND else step.stage - direction  # type: ignore[operator]
    other_stage = step.stage + direction if op == OP_SEND else src  # type: ignore[operator]
    if not 0 <= other_stage < len(run.plan.placement):
        return None
    peer = run.pipelines.peer(rank, run.plan.placement[other_stage])
    return StepMessage(op, channel, src, step.microbatch, peer)  # type: ignore[arg-type]


def counterpart_rows(run: Run, rank: int, message: StepMessage, it: int) -> np.ndarray:
    """Rows of the ops of ``message.peer`` that are the other side of ``rank``'s ``message``
    in iteration ``it``."""
    other = run.ranks[message.peer]
    osrc, omb = message_identity(other, run.catalog)
    ops = other.p2p
    return np.flatnonzero(
        (ops.op != message.op)
        & (ops.peer == rank)
        & (ops.ch == message.channel)
        & (ops.it == it)
        & (osrc == message.src)
        & (omb == message.microbatch)
    )


def run_starts(*keys: np.ndarray) -> np.ndarray:
    """Where each run of equal rows begins (row 0, then every row where any key changes):
    the groups of sorted keys. Empty for empty keys."""
    change = np.zeros(len(keys[0]), bool)
    change[:1] = True
    for key in keys:
        change[1:] |= key[1:] != key[:-1]
    return np.flatnonzero(change)


def run_bounds(starts: np.ndarray, n: int) -> list[int]:
    """`run_starts` of ``n`` rows and ``n``: run i is rows ``bounds[i]:bounds[i + 1]``."""
    return np.append(starts, n).tolist()


def position_in_run(starts: np.ndarray, n: int) -> np.ndarray:
    """Each of ``n`` rows' index within its run (``starts`` from `run_starts`)."""
    return np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))


def containing_rows(
    begin: np.ndarray, end: np.ndarray, times: np.ndarray, *, ending: bool = False
) -> np.ndarray:
    """For sorted, non-overlapping rows, the row containing each time (-1 when none). A time
    where one row ends and the next begins (one clock reading for both, as the recorder
    takes between two steps) is in the next row, or with ``ending`` (the times are ends,
    such as an op's completion waited for in a step) in the row that ends there."""
    if not len(begin):
        return np.full(len(times), -1, np.int64)
    idx = np.searchsorted(begin, times, side="left" if ending else "right") - 1
    safe = np.maximum(idx, 0)
    inside = (idx >= 0) & ((end[safe] >= times) | (end[safe] < 0))
    return np.where(inside, idx, -1)
