"""Activation swap: which (stage, micro-batch) activations to offload, and the plan transform
that inserts their swap steps into any plan.

A swapped forward saves its activations into a *swap group* (``SWAP_GROUP`` before it); the
group is copied to host memory after the forward (``OFFLOAD``, waited by ``OFFLOAD_WAIT``,
after which its device memory is free) and copied back before the backward (``LOAD``, waited
by ``LOAD_WAIT``). The transform places the steps so that the copies overlap compute:

- ``SWAP_GROUP`` right before the forward, ``OFFLOAD`` right after it;
- ``OFFLOAD_WAIT`` right after the next compute step on the rank (the offload overlaps it);
- ``LOAD`` right after the compute step two before the backward, so the load overlaps the
  compute step (and any message waits) just before the backward;
- ``LOAD_WAIT`` right before the backward (the first of B / I, or the composite holding it).

When forward and backward are close, the steps share a gap, always in `SWAP_ORDER`. The
transform is pure: it works on compute-only plans (bubbles kept) and on lowered ones.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from itertools import chain

import numpy as np

from .execution import Program
from .ir import BACKWARD_KINDS, SWAP_KINDS, SWAP_ORDER, Plan, ScheduleError, Step, StepKind

SWAP_EXAMPLES = "all, stage=0, stage=0-1, microbatches=0-3, stage=0,microbatches=0-3"
"""Policy texts, for help and error messages."""

_KEYS = {"stage": "stages", "stages": "stages", "mb": "microbatches"}
_KEYS["microbatch"] = _KEYS["microbatches"] = "microbatches"
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


@dataclass(frozen=True)
class SwapPolicy:
    """The (stage, micro-batch) pairs whose activations are swapped: every pair whose stage is
    in ``stages`` and micro-batch in ``microbatches`` (an inclusive range; None: any)."""

    stages: tuple[int, int] | None = None
    microbatches: tuple[int, int] | None = None

    @classmethod
    def parse(cls, text: str) -> SwapPolicy:
        """``all``, or comma-separated ``stage=A[-B]`` and ``microbatches=A[-B]`` (both
        must hold). Raises ScheduleError naming the bad item."""
        if text.strip().lower() == "all":
            return cls()
        ranges: dict[str, tuple[int, int]] = {}
        for item in (part.strip() for part in text.split(",")):
            key, sep, value = (s.strip() for s in item.partition("="))
            name = _KEYS.get(key.lower())
            match = _RANGE.match(value)
            if not sep or name is None or match is None:
                raise ScheduleError(
                    f"bad swap policy item {item!r}: expected stage=A[-B] or "
                    f"microbatches=A[-B]; e.g. {SWAP_EXAMPLES}"
                )
            low, high = int(match.group(1)), int(match.group(2) or match.group(1))
            if high < low or name in ranges:
                raise ScheduleError(
                    f"bad swap policy item {item!r}: "
                    + ("an empty range" if high < low else f"{name} given twice")
                )
            ranges[name] = (low, high)
        return cls(ranges.get("stages"), ranges.get("microbatches"))

    def selects(self, stage: int, mb: int) -> bool:
        return all(
            bounds is None or bounds[0] <= value <= bounds[1]
            for bounds, value in ((self.stages, stage), (self.microbatches, mb))
        )


def swap_problem(text: str) -> str | None:
    """What is wrong with a policy text (the `RunConfig` check), or None."""
    try:
        SwapPolicy.parse(text)
    except ScheduleError as exc:
        return f"is not a swap policy: {exc}"
    return None


def add_swap_steps(plan: Plan, policy: SwapPolicy) -> Plan:
    """``plan`` with the swap steps of every (stage, micro-batch) the policy selects (see the
    module docstring for where they go). Raises ScheduleError when it selects none, or when a
    selected pair has no forward or no backward on its rank."""
    rows = [_swapped_row(row, policy) for row in plan.ranks]
    if rows == plan.ranks:
        raise ScheduleError(
            f"the swap policy selects no (stage, micro-batch) of {plan.name} "
            f"({plan.num_stages} stages, {plan.num_microbatches} micro-batches)"
        )
    params = {**plan.params, "swap": _describe(policy)}
    return Plan(plan.num_microbatches, plan.placement, rows, plan.name, params)


def _describe(policy: SwapPolicy) -> str:
    parts = [
        f"{name}={low}-{high}"
        for name, bounds in (("stage", policy.stages), ("microbatches", policy.microbatches))
        if bounds is not None
        for low, high in (bounds,)
    ]
    return ",".join(parts) or "all"


def _swapped_row(row: list[Step | None], policy: SwapPolicy) -> list[Step | None]:
    """One rank's steps with the swap steps of its selected pairs inserted."""
    computes = [i for i, step in enumerate(row) if step is not None and _is_compute(step)]
    forward_at: dict[tuple[int, int], int] = {}
    backward_at: dict[tuple[int, int], int] = {}
    for k, index in enumerate(computes):
        for leaf in row[index].leaves():  # type: ignore[union-attr]
            key = (leaf.stage, leaf.microbatch)
            if leaf.kind is StepKind.F:
                forward_at.setdefault(key, k)  # type: ignore[arg-type]
            elif leaf.kind in BACKWARD_KINDS:
                backward_at.setdefault(key, k)  # type: ignore[arg-type]
    before: dict[int, list[Step]] = defaultdict(list)  # row index -> steps right before it
    after: dict[int, list[Step]] = defaultdict(list)  # row index -> steps right after it
    for (stage, mb), f in sorted(forward_at.items()):
        if not policy.selects(stage, mb):
            continue
        b = backward_at.get((stage, mb))
        if b is None or b <= f:
            raise ScheduleError(
                f"cannot swap stage {stage} micro-batch {mb}: its backward does not follow "
                "its forward on its rank"
            )
        group, offload, offload_wait, load, load_wait = (
            Step(kind, stage, mb) for kind in SWAP_ORDER
        )
        wait_after = min(f + 1, b - 1)
        load_after = max(b - 2, wait_after)
        before[computes[f]].append(group)
        after[computes[f]].append(offload)
        after[computes[wait_after]].append(offload_wait)
        after[computes[load_after]].append(load)
        before[computes[b]].append(load_wait)
    if not before:
        return row
    new_row: list[Step | None] = []
    for index, step in enumerate(row):
        new_row.extend(_in_order(before.get(index, [])))
        new_row.append(step)
        new_row.extend(_in_order(after.get(index, [])))
    return new_row


def has_swap_steps(program: Program, kinds: Collection[StepKind] = SWAP_KINDS) -> bool:
    """Whether a compiled plan holds steps of these swap kinds: only its steps without an id
    (swap, FSDP and composite steps) are looked at, so a plan without any costs an array
    comparison."""
    unnamed = np.flatnonzero(program.arrays.ids == -1)
    if not len(unnamed):
        return False
    steps = list(chain.from_iterable(program.steps))
    return any(steps[i].kind in kinds for i in unnamed.tolist())


def _is_compute(step: Step) -> bool:
    return step.is_compute or bool(step.sub_steps)


def _in_order(steps: list[Step]) -> list[Step]:
    """Swap steps sharing a gap, in `SWAP_ORDER` (a group's own steps keep their order)."""
    return sorted(steps, key=lambda s: SWAP_ORDER.index(s.kind))
