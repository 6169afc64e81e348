"""The built-in schedules, written as step plans.

Each builder reproduces the per-rank compute order of the matching torch.distributed.pipelining
schedule class (see ``SCHEDULE_NAMES`` and ``resolve_schedule_name``), so that a plan built here
can be compared action for action with torch's ``pipeline_order``. The builders only decide the
*order* of compute steps; ``lowering.layout_bubbles`` places them on a time grid and
``lowering.lower`` adds the point-to-point messages.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np

from pipetrace.gc_pause import gc_paused
from pipetrace.limits import check_plan_size

from .ir import (
    B,
    F,
    I,
    Placement,
    Plan,
    ScheduleError,
    Step,
    StepKind,
    W,
    make_steps,
    overlap,
    overlap_bf,
    stage_to_rank,
)
from .lowering import add_fsdp_steps, add_tied_reduce, layout_bubbles, lower

_KIND_F, _KIND_B, _KIND_I, _KIND_W = StepKind.F, StepKind.B, StepKind.I, StepKind.W
_KINDS_BY_INDEX = np.array([_KIND_F, _KIND_B, _KIND_I, _KIND_W], dtype=object)
_F_INDEX, _B_INDEX, _I_INDEX, _W_INDEX = range(4)

SCHEDULE_NAMES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb1p", "zbv", "dualpipev")

Rows = list[list[Step]]


@dataclass(frozen=True)
class ScheduleInfo:
    """What the CLI and docs need to present a built-in schedule.

    ``stages_per_rank`` is the allowed V as text: ``"1"`` (exactly one), ``"1.."`` (one or more)
    or ``"2"`` (exactly two).
    """

    name: str
    aliases: tuple[str, ...]
    description: str
    placement: Placement
    stages_per_rank: str


_INFOS: tuple[ScheduleInfo, ...] = (
    ScheduleInfo(
        "gpipe",
        ("ScheduleGPipe", "GPipe"),
        "All forwards, then all backwards (torch ScheduleGPipe).",
        Placement.LOOP,
        "1",
    ),
    ScheduleInfo(
        "1f1b",
        ("Schedule1F1B", "1F1B"),
        "Warm-up forwards, then one forward / one backward, then cool-down backwards "
        "(torch Schedule1F1B).",
        Placement.LOOP,
        "1",
    ),
    ScheduleInfo(
        "interleaved-1f1b",
        ("ScheduleInterleaved1F1B", "Interleaved1F1B", "interleaved"),
        "1F1B over several looped stages per rank, depth first (torch ScheduleInterleaved1F1B).",
        Placement.LOOP,
        "1..",
    ),
    ScheduleInfo(
        "zb1p",
        ("ScheduleInterleavedZeroBubble", "InterleavedZeroBubble", "zb-h1", "zbh1"),
        "Zero bubble: backward split into input (I) and weight (W) parts, W deferred to fill "
        "bubbles; ZB-H1 with one stage per rank (torch ScheduleInterleavedZeroBubble).",
        Placement.LOOP,
        "1..",
    ),
    ScheduleInfo(
        "zbv",
        ("ScheduleZBVZeroBubble", "ZBVZeroBubble", "zb-v"),
        "Zero bubble on a V placement, two stages per rank (torch ScheduleZBVZeroBubble).",
        Placement.V,
        "2",
    ),
    ScheduleInfo(
        "dualpipev",
        ("ScheduleDualPipeV", "DualPipeV"),
        "DeepSeek's DualPipeV: overlapped forward/backward pairs on a V placement "
        "(torch ScheduleDualPipeV).",
        Placement.V,
        "2",
    ),
)


def describe_schedules() -> list[ScheduleInfo]:
    return list(_INFOS)


def _normalize(name: str) -> str:
    """Case and punctuation do not matter: 'ZB-H1', 'zb_h1' and 'zbh1' are one name."""
    return re.sub(r"[^0-9a-z]", "", name.lower())


_LOOKUP: dict[str, str] = {
    _normalize(alias): info.name for info in _INFOS for alias in (info.name, *info.aliases)
}


def resolve_schedule_name(name: str) -> str:
    canonical = _LOOKUP.get(_normalize(name))
    if canonical is None:
        raise ScheduleError(
            f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULE_NAMES)} "
            "(torch class names such as ScheduleInterleaved1F1B are accepted too)"
        )
    return canonical


# ---------------------------------------------------------------------------------------
# Parameter checks
# ---------------------------------------------------------------------------------------

_DEFAULT_V = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb1p": 1, "zbv": 2, "dualpipev": 2}


def _rounds(num_ranks: int, num_microbatches: int) -> int:
    return max(1, num_microbatches // num_ranks)


def _rounds_ok(num_ranks: int, num_microbatches: int) -> bool:
    return num_microbatches % _rounds(num_ranks, num_microbatches) == 0


def _check_rounds(name: str, num_ranks: int, num_microbatches: int) -> None:
    """torch's interleaved schedules split M into equal rounds of about P micro-batches."""
    if _rounds_ok(num_ranks, num_microbatches):
        return
    below = next(m for m in range(num_microbatches - 1, 0, -1) if _rounds_ok(num_ranks, m))
    above = next(m for m in range(num_microbatches + 1, 2**62) if _rounds_ok(num_ranks, m))
    rounds = _rounds(num_ranks, num_microbatches)
    raise ScheduleError(
        f"{name} with {num_ranks} ranks: {num_microbatches} micro-batches is not allowed; "
        "with M >= P the micro-batch count must be a multiple of the number of rounds "
        f"max(1, M // P) = {rounds}; try {below} or {above}"
    )


def _check_positive(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScheduleError(f"{what} must be a whole number >= 1, got {value!r}")
    return value


def _check_params(
    name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int | None
) -> int:
    """Validate the parameters of a built-in schedule and return its stages per rank."""
    _check_positive("num_ranks", num_ranks)
    _check_positive("num_microbatches", num_microbatches)
    v = _DEFAULT_V[name] if stages_per_rank is None else stages_per_rank
    _check_positive("stages_per_rank", v)
    if name in ("gpipe", "1f1b") and v != 1:
        raise ScheduleError(
            f"{name} runs exactly 1 stage per rank, got stages_per_rank={v}; "
            "use interleaved-1f1b or zb1p for several stages per rank"
        )
    if name in ("zbv", "dualpipev") and v != 2:
        raise ScheduleError(
            f"{name} runs exactly 2 stages per rank (a V placement), got stages_per_rank={v}"
        )
    if name == "interleaved-1f1b" or (name == "zb1p" and v > 1):
        _check_rounds(name, num_ranks, num_microbatches)
    if name == "dualpipev" and num_microbatches < 2 * num_ranks:
        raise ScheduleError(
            f"dualpipev with {num_ranks} ranks needs at least as many micro-batches as stages, "
            f"2 * {num_ranks} = {2 * num_ranks}; got {num_microbatches}"
        )
    return v


# ---------------------------------------------------------------------------------------
# The schedules: each returns one rank's compute steps, in order, without bubbles
# ---------------------------------------------------------------------------------------


def _gpipe_rank(rank: int, p: int, m: int, v: int) -> list[Step]:
    return [F(rank, mb) for mb in range(m)] + [B(rank, mb) for mb in range(m)]


def _1f1b_rank(rank: int, p: int, m: int, v: int) -> list[Step]:
    warmup = min(p - 1 - rank, m)
    steps = [F(rank, mb) for mb in range(warmup)]
    for k in range(m - warmup):
        steps.append(F(rank, warmup + k))
        steps.append(B(rank, k))
    steps.extend(B(rank, mb) for mb in range(m - warmup, m))
    return steps


def _interleaved_rank(rank: int, p: int, m: int, v: int, *, zero_bubble: bool) -> list[Step]:
    """torch's ``_get_1f1b_rank_ops`` for Interleaved1F1B (2 warm-up ops per hop) and
    InterleavedZeroBubble (1 per hop, backward split into I and W, W deferred by ``rank`` ops).

    Op k runs the k-th forward (k < v*m), then the (k - warmup)-th backward (k >= warmup)
    and, with zero bubble, the W of the backward ``rank`` ops before; the W still pending
    run at the end. Each op's steps are laid out with arrays, one row per op, and made in
    bulk (`make_steps`): a Python loop and a call per step cost about three times as much.
    """
    mpr = m // _rounds(p, m)
    per_hop = 1 if zero_bubble else 2
    work = v * m  # forwards, and as many backwards
    warmup = min((v - 1) * mpr + per_hop * (p - 1 - rank), work)
    chunk = np.arange(work) // mpr % v  # the k-th forward's local stage (backwards: reversed)
    forward, backward = _numbered(chunk, v), _numbered(v - 1 - chunk, v)
    kinds = np.full((work + warmup, 3), -1)  # per op: its forward, backward and W
    stages = np.zeros((work + warmup, 3), np.int64)
    mbs = np.zeros((work + warmup, 3), np.int64)
    kinds[:work, 0], stages[:work, 0], mbs[:work, 0] = _F_INDEX, forward[0] * p + rank, forward[1]
    kinds[warmup:, 1] = _I_INDEX if zero_bubble else _B_INDEX
    stages[warmup:, 1], mbs[warmup:, 1] = backward[0] * p + rank, backward[1]
    done_w = max(work - rank, 0) if zero_bubble else 0  # Ws run by an op, not at the end
    kinds[warmup + rank :, 2][:done_w] = _W_INDEX
    stages[warmup + rank :, 2][:done_w] = stages[warmup:, 1][:done_w]
    mbs[warmup + rank :, 2][:done_w] = mbs[warmup:, 1][:done_w]
    kept = kinds.ravel() >= 0
    tail = slice(warmup + done_w, None) if zero_bubble else slice(0)  # the pending Ws
    return make_steps(
        [*_KINDS_BY_INDEX[kinds.ravel()[kept]].tolist(), *[_KIND_W] * len(kinds[tail])],
        [*stages.ravel()[kept].tolist(), *stages[tail, 1].tolist()],
        [*mbs.ravel()[kept].tolist(), *mbs[tail, 1].tolist()],
    )


def _numbered(local: np.ndarray, v: int) -> tuple[np.ndarray, np.ndarray]:
    """Per op in order, its local stage and its micro-batch: how many ops before it ran
    the same local stage (a per-stage counter, computed with one stable sort)."""
    order = np.argsort(local, kind="stable")
    counts = np.bincount(local, minlength=v)
    mb = np.empty_like(local)
    mb[order] = np.arange(len(local)) - (np.cumsum(counts) - counts)[local[order]]
    return local, mb


def _zbv_rank(rank: int, p: int, m: int, v: int) -> list[Step]:
    """torch's ScheduleZBVZeroBubble: run as if there were at least 2P-1 micro-batches, then
    drop the ones that do not exist (that is how torch supports M < 2P-1)."""
    n_micro = max(2 * p - 1, m)
    c0, c1 = rank, 2 * p - 1 - rank
    f0 = f1 = b0 = b1 = 0
    ops: list[tuple[Callable[[int, int], Step], int, int]] = []  # (F/I/W, stage, mb)
    for _ in range(2 * (p - rank) - 1):
        ops.append((F, c0, f0))
        f0 += 1
    for _ in range(rank):
        ops += [(F, c1, f1), (F, c0, f0)]
        f1 += 1
        f0 += 1
    for _ in range(p - rank):
        ops += [(F, c1, f1), (I, c1, b1), (W, c1, b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n_micro:
        if f0 < n_micro:
            ops.append((F, c0, f0))
            f0 += 1
        ops += [(I, c0, b0), (W, c0, b0), (F, c1, f1), (I, c1, b1), (W, c1, b1)]
        f1 += 1
        b0 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [(I, c0, b0), (I, c1, b1)]
        b0 += 1
        b1 += 1
    for _ in range(p - rank):
        ops += [(I, c0, b0), (W, c0, w0)]
        b0 += 1
        w0 += 1
    ops.extend((W, c1, mb) for mb in range(w1, b1))
    ops.extend((W, c0, mb) for mb in range(w0, b0))
    return [make(stage, mb) for make, stage, mb in ops if mb < m]


class _DualPipeVRank:
    """Counters and the pending-W queue of one rank of torch's ScheduleDualPipeV."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.fwd: dict[int, int] = {}
        self.bwd: dict[int, int] = {}  # full B and I share the counter, as in torch
        self.pending_w: deque[tuple[int, int]] = deque()

    def _next(self, counter: dict[int, int], stage: int) -> int:
        mb = counter.get(stage, 0)
        counter[stage] = mb + 1
        return mb

    def forward(self, stage: int) -> Step:
        return F(stage, self._next(self.fwd, stage))

    def backward(self, stage: int, *, split: bool) -> Step:
        """A full B, or an I whose W is queued for later when ``split``."""
        mb = self._next(self.bwd, stage)
        if split:
            self.pending_w.append((stage, mb))
            return I(stage, mb)
        return B(stage, mb)

    def add(self, *steps: Step) -> None:
        self.steps.extend(steps)

    def add_overlap(self, fwd_stage: int, bwd_stage: int) -> None:
        self.steps.append(overlap(self.forward(fwd_stage), self.backward(bwd_stage, split=False)))

    def add_pending_w(self) -> None:
        if self.pending_w:
            self.steps.append(W(*self.pending_w.popleft()))


def _dualpipev_rank(rank: int, p: int, m: int, v: int) -> list[Step]:
    """torch's ScheduleDualPipeV, step by step (the numbered steps of its source)."""
    c0, c1 = rank, 2 * p - 1 - rank
    st = _DualPipeVRank()
    for _ in range((p - rank - 1) * 2):  # 1: F0
        st.add(st.forward(c0))
    for _ in range(rank + 1):  # 2: F0 F1
        st.add(st.forward(c0))
        st.add(st.forward(c1))
    for _ in range(p - rank - 1):  # 3: I1 W1 F1
        st.add(st.backward(c1, split=True))
        st.add_pending_w()
        st.add(st.forward(c1))
    for i in range(m - 2 * p + rank + 1):  # 4: F0B1 F1B0, overlapped
        if i == 0 and rank == p - 1:
            st.add(st.forward(c0))
            st.add(st.backward(c1, split=False))
        else:
            st.add_overlap(c0, c1)
        st.add_overlap(c1, c0)
    for _ in range(p - rank - 1):  # 5: B1 F1B0
        st.add(st.backward(c1, split=False))
        st.add_overlap(c1, c0)
    split = False
    switch = (rank + 1) // 2
    for i in range(rank + 1):  # 6: B1 B0, zero bubble from the middle on
        if i == switch and rank % 2 == 1:
            split = True
        st.add(st.backward(c1, split=split))
        if i == switch and rank % 2 == 0:
            split = True
        st.add(st.backward(c0, split=split))
    for _ in range(p - rank - 1):  # 7: W B0
        st.add_pending_w()
        st.add(st.backward(c0, split=split))
    for _ in range(rank + 1):  # 8: W
        st.add_pending_w()
    return st.steps


RankBuilder = Callable[[int, int, int, int], list[Step]]

OVERLAP_BF_SCHEDULES = ("1f1b", "interleaved-1f1b")
"""The schedules that take ``overlap_bf``: their steady state alternates B and F."""


def _pair_backward_forward(steps: list[Step], split: bool) -> list[Step]:
    """Each full backward directly followed by a forward becomes one OVERLAP_B_F step (the
    steady state of 1F1B and interleaved 1F1B); the order of the work does not change. With
    ``split`` the pair's backward is its I then its W (`overlap_bf`)."""
    paired: list[Step] = []
    i = 0
    while i < len(steps):
        step = steps[i]
        if step.kind is StepKind.B and i + 1 < len(steps) and steps[i + 1].kind is StepKind.F:
            paired.append(overlap_bf(step, steps[i + 1], split=split))
            i += 2
        else:
            paired.append(step)
            i += 1
    return paired


_BUILDERS: dict[str, RankBuilder] = {
    "gpipe": _gpipe_rank,
    "1f1b": _1f1b_rank,
    "interleaved-1f1b": lambda r, p, m, v: _interleaved_rank(r, p, m, v, zero_bubble=False),
    "zb1p": lambda r, p, m, v: _interleaved_rank(r, p, m, v, zero_bubble=True),
    "zbv": _zbv_rank,
    "dualpipev": _dualpipev_rank,
}


def _build_order(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int | None,
    overlap_bf: bool = False,
    overlap_bf_split: bool = False,
) -> Plan:
    """The compute-only plan without bubbles: the order each rank runs its steps in."""
    canonical = resolve_schedule_name(name)
    v = _check_params(canonical, num_ranks, num_microbatches, stages_per_rank)
    check_plan_size(num_ranks, num_microbatches, v)
    info = next(i for i in _INFOS if i.name == canonical)
    build = _BUILDERS[canonical]
    rows = [build(r, num_ranks, num_microbatches, v) for r in range(num_ranks)]
    params: dict[str, object] = {
        "num_ranks": num_ranks,
        "num_microbatches": num_microbatches,
        "stages_per_rank": v,
    }
    if overlap_bf or overlap_bf_split:
        if canonical not in OVERLAP_BF_SCHEDULES:
            option = "overlap_bf_split" if overlap_bf_split else "overlap_bf"
            raise ScheduleError(
                f"{option} (OVERLAP_B_F steps) is an option of "
                f"{' and '.join(OVERLAP_BF_SCHEDULES)}, not of {canonical}"
            )
        rows = [_pair_backward_forward(row, overlap_bf_split) for row in rows]
        params["overlap_bf"] = True
        if overlap_bf_split:
            params["overlap_bf_split"] = True
    return Plan(
        num_microbatches=num_microbatches,
        placement=stage_to_rank(info.placement, num_ranks, v * num_ranks),
        ranks=cast("list[list[Step | None]]", rows),  # rows that happen to hold no bubbles
        name=canonical,
        params=params,
    )


def build_compute_plan(
    name: str, *, num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None
) -> Plan:
    """A built-in schedule's compute steps, with explicit bubbles on a unit-time grid."""
    with gc_paused():
        return layout_bubbles(_build_order(name, num_ranks, num_microbatches, stages_per_rank))


def build_plan(
    name: str,
    *,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int | None = None,
    comms: bool = False,
    fsdp: bool = False,
    overlap_bf: bool = False,
    overlap_bf_split: bool = False,
    tie_weights: bool = False,
) -> Plan:
    """A built-in schedule: compute-only with bubbles (as `build_compute_plan`), or lowered
    with its messages (and FSDP steps when ``fsdp``), ready for a runtime. ``overlap_bf``
    pairs each steady-state backward with the next forward in one OVERLAP_B_F step;
    ``overlap_bf_split`` does too, with each pair's backward split into I then W;
    ``tie_weights`` adds the first and the last stage's ``TIED_REDUCE``
    (`lowering.add_tied_reduce`)."""
    with gc_paused():
        order = _build_order(
            name, num_ranks, num_microbatches, stages_per_rank, overlap_bf, overlap_bf_split
        )
        if comms:
            plan = lower(order, fsdp=fsdp)
        else:
            plan = layout_bubbles(order)
            plan = add_fsdp_steps(plan) if fsdp else plan
    return add_tied_reduce(plan) if tie_weights else plan
