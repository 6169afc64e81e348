"""The annotations of every slice, gathered from the run model's tables in bulk.

Both writers show the same annotations, under these names:

- steps: ``stage``, ``microbatch``, ``iteration``, ``position`` (plan position);
- P2P ops: ``op``, ``peer``, ``channel``, ``seq``, ``bytes``, ``shape``, ``dtype``, ``iteration``;
- bubbles: ``iteration``; iterations: ``loss`` where recorded;
- any slice: ``unfinished`` (true when it never ended) and ``finding`` (what an analyzer
  found at this step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetrace.export.columns import SLICE_BUBBLE, SLICE_ITERATION, SLICE_P2P, SLICE_STEP, Layout

STAGE, MICROBATCH, ITERATION, POSITION = "stage", "microbatch", "iteration", "position"
OP, PEER, CHANNEL, SEQ, BYTES, SHAPE, DTYPE = (
    "op",
    "peer",
    "channel",
    "seq",
    "bytes",
    "shape",
    "dtype",
)
LOSS, UNFINISHED, FINDING = "loss", "unfinished", "finding"
NAMES = (
    STAGE,
    MICROBATCH,
    ITERATION,
    POSITION,
    OP,
    PEER,
    CHANNEL,
    SEQ,
    BYTES,
    SHAPE,
    DTYPE,
    LOSS,
    UNFINISHED,
    FINDING,
)


@dataclass
class SliceArgs:
    """Per slice of `Layout.slices`; -1 (NaN for loss) where a value does not apply."""

    stage: np.ndarray
    microbatch: np.ndarray
    iteration: np.ndarray
    position: np.ndarray
    op: np.ndarray  # OP_SEND / OP_RECV
    peer: np.ndarray
    channel: np.ndarray  # index into CHANNELS
    seq: np.ndarray
    nbytes: np.ndarray
    shape: np.ndarray  # index into Run.shapes
    dtype: np.ndarray  # index into Run.dtypes
    loss: np.ndarray


def slice_args(layout: Layout) -> SliceArgs:
    s, run = layout.slices, layout.run
    n = len(s)
    cols = {
        name: np.full(n, -1, np.int64)
        for name in (
            "stage",
            "microbatch",
            "iteration",
            "position",
            "op",
            "peer",
            "channel",
            "seq",
            "nbytes",
            "shape",
            "dtype",
        )
    }
    loss = np.full(n, np.nan)
    steps = np.flatnonzero(s.kind == SLICE_STEP)
    cols["stage"][steps] = run.catalog.stage[s.name[steps]]
    cols["microbatch"][steps] = run.catalog.microbatch[s.name[steps]]
    bubbles = np.flatnonzero((s.kind == SLICE_BUBBLE) | (s.kind == SLICE_ITERATION))
    cols["iteration"][bubbles] = s.row[bubbles]
    for rank in run.present_ranks:
        mine = s.rank == rank.rank
        rows = np.flatnonzero(mine & (s.kind == SLICE_STEP))
        table = rank.steps
        cols["iteration"][rows] = table.it[s.row[rows]]
        cols["position"][rows] = table.pos[s.row[rows]]
        rows = np.flatnonzero(mine & (s.kind == SLICE_P2P))
        p2p, r = rank.p2p, s.row[rows]
        for name, column in (
            ("iteration", p2p.it),
            ("op", p2p.op),
            ("peer", p2p.peer),
            ("channel", p2p.ch),
            ("seq", p2p.seq),
            ("nbytes", p2p.nbytes),
            ("shape", p2p.shape),
            ("dtype", p2p.dtype),
        ):
            cols[name][rows] = column[r]
        rows = np.flatnonzero(mine & (s.kind == SLICE_ITERATION))
        if len(rows) and len(rank.iterations):
            at = np.searchsorted(rank.iterations.it, s.row[rows])
            loss[rows] = rank.iterations.loss[np.minimum(at, len(rank.iterations) - 1)]
    return SliceArgs(loss=loss, **cols)
