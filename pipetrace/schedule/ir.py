"""The step IR: the one language spoken by schedules, runtime, recorder and analyzers.

Vocabulary (used everywhere in pipetrace):

- *rank*: one process of the pipeline group.
- *stage*: one model chunk, numbered 0..S-1 in data-flow order. A rank holds one or more
  stages (its *virtual stages*); the placement maps stage -> rank.
- *micro-batch*: one slice of the global batch, numbered 0..M-1.
- *step*: one unit of work in a rank's plan, e.g. ``2F0`` (stage 2 forward of micro-batch 0).
- *bubble*: an explicit idle slot in a rank's plan, stored as ``None``.
- *channel*: the messages of one kind (activations ``F`` or gradients ``B``) between two ranks.

A step's canonical text is torch.distributed.pipelining's action string: ``{stage}{KIND}{mb}``
(``2F0``, ``1I3``, ``3SEND_F1``), ``{stage}{KIND}`` for the collective steps (``0UNSHARD``,
``0TIED_REDUCE``), and ``({sub};{sub})OVERLAP_F_B`` or ``({sub};{sub})OVERLAP_B_F`` for a
composite (an OVERLAP_B_F whose backward is split writes its three parts flat,
``(0I3;0W3;0F7)OVERLAP_B_F``). Activation swap steps use the simple form: ``0SWAP_GROUP3``,
``0OFFLOAD3``, ``0OFFLOAD_WAIT3``, ``0LOAD3``, ``0LOAD_WAIT3`` (see ``SWAP_KINDS``). This
module imports nothing heavy.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum


class StepKind(str, Enum):
    F = "F"  # forward
    B = "B"  # full backward (dx and dw together)
    I = "I"  # backward for inputs only ("dx")  # noqa: E741
    W = "W"  # backward for weights only ("dw")
    SEND_F = "SEND_F"  # send this stage's output activation to the next stage
    RECV_F = "RECV_F"  # receive this stage's input activation from the previous stage
    SEND_B = "SEND_B"  # send this stage's input gradient to the previous stage
    RECV_B = "RECV_B"  # receive this stage's output gradient from the next stage
    OVERLAP_F_B = "OVERLAP_F_B"  # a forward and a backward run concurrently (composite)
    OVERLAP_B_F = "OVERLAP_B_F"  # a backward and the next forward run concurrently (composite)
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    TIED_REDUCE = "TIED_REDUCE"  # sum a tied parameter's gradient with the stage sharing it
    # Activation swap of one (stage, micro-batch), in this order on its rank:
    SWAP_GROUP = "SWAP_GROUP"  # its next forward saves its activations into a swap group
    OFFLOAD = "OFFLOAD"  # launch the copy of the group's saved activations to host memory
    OFFLOAD_WAIT = "OFFLOAD_WAIT"  # wait for that copy; the device memory is free after it
    LOAD = "LOAD"  # launch the copy back from host memory, ahead of the backward
    LOAD_WAIT = "LOAD_WAIT"  # wait for it; the backward may run after it

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({StepKind.F, StepKind.B, StepKind.I, StepKind.W})
BACKWARD_KINDS = frozenset({StepKind.B, StepKind.I})  # the kinds that produce the input gradient
SEND_KINDS = frozenset({StepKind.SEND_F, StepKind.SEND_B})
RECV_KINDS = frozenset({StepKind.RECV_F, StepKind.RECV_B})
COMM_KINDS = SEND_KINDS | RECV_KINDS
FSDP_KINDS = frozenset({StepKind.UNSHARD, StepKind.RESHARD, StepKind.REDUCE_GRAD})
COLLECTIVE_KINDS = FSDP_KINDS | {StepKind.TIED_REDUCE}
"""Steps that take one stage and no micro-batch and synchronise with other ranks outside the
plan's messages (FSDP's gathers and reductions, the tied-weight reduction)."""
COMPOSITE_KINDS = frozenset({StepKind.OVERLAP_F_B, StepKind.OVERLAP_B_F})
SWAP_ORDER = (
    StepKind.SWAP_GROUP,
    StepKind.OFFLOAD,
    StepKind.OFFLOAD_WAIT,
    StepKind.LOAD,
    StepKind.LOAD_WAIT,
)
"""The swap steps of one (stage, micro-batch), in the order they run on its rank: the group
before its forward, the load and its wait before its first backward step (B or I)."""
SWAP_KINDS = frozenset(SWAP_ORDER)
SWAP_MOVES = frozenset({StepKind.OFFLOAD, StepKind.LOAD})
"""The swap steps that start a copy, and whose recorded ``step_end`` carries its bytes."""


class ScheduleError(ValueError):
    """A schedule, action string or schedule file that cannot be understood or built."""


@dataclass(frozen=True, slots=True, init=False)
class Step:
    """One step of a rank's plan.

    ``microbatch`` is None only for the `COLLECTIVE_KINDS`; ``stage`` is None only for a composite,
    whose work is in ``sub_steps``.
    """

    kind: StepKind
    stage: int | None = None
    microbatch: int | None = None
    sub_steps: tuple[Step, ...] = ()

    def __init__(
        self,
        kind: StepKind,
        stage: int | None = None,
        microbatch: int | None = None,
        sub_steps: tuple[Step, ...] = (),
    ) -> None:
        # A frozen dataclass's own __init__ assigns through object.__setattr__ by name; the
        # slot setters do the same at half the cost, and a lowered plan makes ~4e5 steps.
        _set_kind(self, kind)
        _set_stage(self, stage)
        _set_microbatch(self, microbatch)
        _set_sub_steps(self, sub_steps)

    def __str__(self) -> str:
        return format_step(self)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def is_swap(self) -> bool:
        return self.kind in SWAP_KINDS

    def leaves(self) -> Iterator[Step]:
        """The step itself, or a composite's sub-steps (flattened)."""
        if self.sub_steps:
            for sub in self.sub_steps:
                yield from sub.leaves()
        else:
            yield self


_set_kind = Step.kind.__set__  # type: ignore[attr-defined]  # slot descriptors
_set_stage = Step.stage.__set__  # type: ignore[attr-defined]
_set_microbatch = Step.microbatch.__set__  # type: ignore[attr-defined]
_set_sub_steps = Step.sub_steps.__set__  # type: ignore[attr-defined]
_new_object = object.__new__


def make_steps(
    kinds: Sequence[StepKind], stages: Iterable[int | None], microbatches: Iterable[int | None]
) -> list[Step]:
    """Simple steps (no sub-steps) from parallel columns: ``Step(kinds[i], stages[i],
    microbatches[i])`` for every i, equal to those.

    Made in bulk, one C-level ``map`` per field over uninitialised objects, with no Python
    call per step: builders and `lowering.lower` make ~4e5 steps for a large plan, and a
    ``Step(...)`` call each is about a third slower.
    """
    steps: list[Step] = list(map(_new_object, [Step] * len(kinds)))
    for setter, values in (
        (_set_kind, kinds),
        (_set_stage, stages),
        (_set_microbatch, microbatches),
        (_set_sub_steps, [()] * len(steps)),
    ):
        deque(map(setter, steps, values), maxlen=0)
    return steps


def F(stage: int, mb: int) -> Step:
    return Step(StepKind.F, stage, mb)


def B(stage: int, mb: int) -> Step:
    return Step(StepKind.B, stage, mb)


def I(stage: int, mb: int) -> Step:  # noqa: E743
    return Step(StepKind.I, stage, mb)


def W(stage: int, mb: int) -> Step:
    return Step(StepKind.W, stage, mb)


def overlap(forward: Step, backward: Step) -> Step:
    return Step(StepKind.OVERLAP_F_B, None, None, (forward, backward))


def overlap_bf(backward: Step, forward: Step, *, split: bool = False) -> Step:
    """A backward (B) paired with the next forward: ``(0B3;0F7)OVERLAP_B_F``; with ``split``,
    the backward as I then W of the same micro-batch: ``(0I3;0W3;0F7)OVERLAP_B_F``."""
    if not split:
        return Step(StepKind.OVERLAP_B_F, None, None, (backward, forward))
    s, mb = backward.stage, backward.microbatch
    return Step(StepKind.OVERLAP_B_F, None, None, (I(s, mb), W(s, mb), forward))  # type: ignore[arg-type]


def thread_parts(step: Step) -> tuple[tuple[Step, ...], ...]:
    """A composite's sub-steps grouped by the thread that runs them, each group in run order.

    The groups run concurrently, the steps of one group one after another: OVERLAP_B_F's
    backward parts (B, or I then W) share the worker thread while its forward runs on the
    main thread; each part of OVERLAP_F_B has a thread of its own. The simulator costs a
    group as the sum of its parts and the composite as its longest group.
    """
    if step.kind is StepKind.OVERLAP_B_F:
        return (step.sub_steps[:-1], step.sub_steps[-1:])
    return tuple((sub,) for sub in step.sub_steps)


# ---------------------------------------------------------------------------------------
# Text forms
# ---------------------------------------------------------------------------------------

_KIND_ALTERNATION = "|".join(
    sorted((k.value for k in StepKind if k not in COMPOSITE_KINDS), key=len, reverse=True)
)
# ASCII digits, at most 18 (an int64): int() of thousands of digits raises, and of other
# scripts' digits would accept a text no recorder writes.
STEP_NUMBER = "[0-9]{1,18}"
_SIMPLE_RE = re.compile(rf"^\s*({STEP_NUMBER})\s*({_KIND_ALTERNATION})\s*({STEP_NUMBER})?\s*$")
_COMPOSITE_RE = re.compile(r"^\s*\((.*)\)\s*(OVERLAP_F_B|OVERLAP_B_F)\s*$")


def format_step(step: Step | None) -> str:
    """The canonical text of a step ('' for a bubble)."""
    if step is None:
        return ""
    if step.sub_steps:
        return "(" + ";".join(format_step(s) for s in step.sub_steps) + ")" + step.kind.value
    if step.microbatch is None:
        return f"{step.stage}{step.kind.value}"
    return f"{step.stage}{step.kind.value}{step.microbatch}"


def parse_step(text: str) -> Step | None:
    """Parse one action string; an empty string is a bubble.

    Accepts every form torch.distributed.pipelining writes, e.g. ``2F0``, ``1I3``,
    ``3SEND_F1``, ``0UNSHARD``, ``(0F7;7B3)OVERLAP_F_B``, ``(0B3;0F7)OVERLAP_B_F`` and
    ``(0I3;0W3;0F7)OVERLAP_B_F``.
    """
    stripped = text.strip()
    if not stripped:
        return None
    composite = _COMPOSITE_RE.match(stripped)
    if composite:
        return _parse_composite(text, composite.group(1), StepKind(composite.group(2)))
    match = _SIMPLE_RE.match(stripped)
    if not match:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise ScheduleError(
            f"bad action {shown!r}: expected STAGE KIND MICROBATCH such as '2F0', '1SEND_B3', "
            "'0UNSHARD' or '(0F7;7B3)OVERLAP_F_B'"
        )
    stage, kind_text, mb_text = match.groups()
    kind = StepKind(kind_text)
    mb_text = mb_text or ""
    if kind in COLLECTIVE_KINDS:
        if mb_text:
            raise ScheduleError(f"bad action {text!r}: {kind} takes no micro-batch")
        return Step(kind, int(stage), None)
    if not mb_text:
        raise ScheduleError(f"bad action {text!r}: {kind} needs a micro-batch index")
    return Step(kind, int(stage), int(mb_text))


def _parse_composite(text: str, inner: str, kind: StepKind) -> Step:
    """``(0F7;7B3)OVERLAP_F_B``: two compute actions; ``(0B3;0F7)OVERLAP_B_F``: a full
    backward, then a forward; ``(0I3;0W3;0F7)OVERLAP_B_F``: the backward split into I and W
    of one micro-batch, then a forward."""
    subs = []
    for part in inner.split(";"):
        sub = parse_step(part)
        if sub is None or sub.kind not in COMPUTE_KINDS:
            raise ScheduleError(
                f"bad action {text!r}: {kind} holds compute actions like "
                + ("(0F7;7B3)" if kind is StepKind.OVERLAP_F_B else "(0B3;0F7)")
            )
        subs.append(sub)
    if kind is StepKind.OVERLAP_B_F:
        _check_overlap_bf(text, subs)
    elif len(subs) != 2:
        raise ScheduleError(f"bad action {text!r}: {kind} holds exactly two actions")
    return Step(kind, None, None, tuple(subs))


def _check_overlap_bf(text: str, subs: list[Step]) -> None:
    """OVERLAP_B_F holds B then F, or I then W of one (stage, micro-batch) then F."""
    kinds = [s.kind for s in subs]
    if kinds == [StepKind.B, StepKind.F]:
        return
    if kinds == [StepKind.I, StepKind.W, StepKind.F] and _same_work(subs[0], subs[1]):
        return
    raise ScheduleError(
        f"bad action {text!r}: OVERLAP_B_F holds a B, then an F: (0B3;0F7), "
        "or its split I and W, then an F: (0I3;0W3;0F7)"
    )


def _same_work(a: Step, b: Step) -> bool:
    """Whether two steps name the same (stage, micro-batch)."""
    return a.stage == b.stage and a.microbatch == b.microbatch


# ---------------------------------------------------------------------------------------
# Placement and plans
# ---------------------------------------------------------------------------------------


class Placement(str, Enum):
    LOOP = "loop"  # stage s on rank s % P (interleaved 1F1B)
    V = "v"  # stage s on rank s for s < P, rank 2P-1-s after (ZBV, DualPipeV)


def stage_to_rank(placement: Placement, num_ranks: int, num_stages: int) -> tuple[int, ...]:
    if placement is Placement.LOOP:
        return tuple(s % num_ranks for s in range(num_stages))
    if num_stages != 2 * num_ranks:
        raise ScheduleError(
            f"V placement needs 2 stages per rank: got {num_stages} stages on {num_ranks} ranks"
        )
    return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(num_stages))


@dataclass(slots=True)
class Plan:
    """Every rank's ordered steps, with ``None`` for an explicit bubble.

    ``placement[s]`` is the rank that holds stage ``s``. ``name`` and ``params`` say how the
    plan was made (a built-in schedule and its parameters, or a file).
    """

    num_microbatches: int
    placement: tuple[int, ...]
    ranks: list[list[Step | None]]
    name: str = "custom"
    params: dict[str, object] = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.placement) if r == rank]

    def steps(self, rank: int) -> list[Step]:
        """A rank's steps without bubbles."""
        return [s for s in self.ranks[rank] if s is not None]

    def has_comms(self) -> bool:
        return any(s is not None and s.is_comm for row in self.ranks for s in row)

    def without_bubbles(self) -> Plan:
        return Plan(
            self.num_microbatches,
            self.placement,
            [self.steps(r) for r in range(self.num_ranks)],
            self.name,
            dict(self.params),
        )

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "params": self.params,
            "num_microbatches": self.num_microbatches,
            "placement": list(self.placement),
            "ranks": [[format_step(s) for s in row] for row in self.ranks],
        }

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        return cls(
            num_microbatches=int(data["num_microbatches"]),
            placement=tuple(int(r) for r in data["placement"]),
            ranks=[[parse_step(t) for t in row] for row in data["ranks"]],
            name=str(data.get("name", "custom")),
            params=dict(data.get("params", {})),
        )


def infer_placement(ranks: Sequence[Iterable[Step | None]]) -> tuple[int, ...]:
    """Stage -> rank from the steps each rank holds (a stage on two ranks is an error)."""
    owner: dict[int, int] = {}
    for rank, row in enumerate(ranks):
        for step in row:
            if step is None:
                continue
            for leaf in step.leaves():
                if leaf.stage is None:
                    continue
                previous = owner.setdefault(leaf.stage, rank)
                if previous != rank:
                    raise ScheduleError(
                        f"stage {leaf.stage} appears on rank {previous} and rank {rank}; "
                        "each stage must live on one rank"
                    )
    if not owner:
        raise ScheduleError("the plan has no steps")
    num_stages = max(owner) + 1
    missing = [s for s in range(num_stages) if s not in owner]
    if missing:
        raise ScheduleError(f"no rank runs stage(s) {missing}: stages must be numbered 0..S-1")
    return tuple(owner[s] for s in range(num_stages))
