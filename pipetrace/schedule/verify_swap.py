"""The verifier's activation swap checks: every swap group is complete and in order.

A swap group of (stage, micro-batch) is its five steps in `SWAP_ORDER` on the rank holding
the stage: ``SWAP_GROUP`` before its forward (so the forward saves into the group),
``OFFLOAD`` after it, ``OFFLOAD_WAIT`` before ``LOAD`` (the host buffer is in use until the
offload is waited), and ``LOAD`` then ``LOAD_WAIT`` before its first backward step (B or I),
which needs the activations back. Swap steps never block in an execution (they are local to
a rank), so these checks are static, on the plan as given.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .ir import BACKWARD_KINDS, SWAP_KINDS, SWAP_ORDER, Plan, Step, StepKind, format_step
from .verify import Finding, StepRef

# (earlier kind, later kind, the finding when the later one comes first, why), checked in
# this order; the forward and the first backward are the group's compute steps.
_RULES = (
    (
        StepKind.SWAP_GROUP,
        StepKind.F,
        "swap_without_activations",
        "a forward saves into its group only after the group is set",
    ),
    (
        StepKind.F,
        StepKind.OFFLOAD,
        "swap_without_activations",
        "there is nothing to offload before the forward",
    ),
    (StepKind.OFFLOAD, StepKind.OFFLOAD_WAIT, "swap_order", "a wait needs its launch first"),
    (
        StepKind.OFFLOAD_WAIT,
        StepKind.LOAD,
        "offload_not_waited",
        "the host buffer is in use until the offload is waited",
    ),
    (StepKind.LOAD, StepKind.LOAD_WAIT, "swap_order", "a wait needs its launch first"),
    (
        StepKind.LOAD_WAIT,
        StepKind.B,
        "load_late",
        "the backward needs the activations loaded back",
    ),
)


@dataclass(slots=True)
class _Group:
    """Where one (stage, micro-batch)'s steps are in its rank's row (positions with bubbles)."""

    swaps: dict[StepKind, list[int]] = field(default_factory=lambda: defaultdict(list))
    forward: int | None = None
    backward: int | None = None  # its first B or I


def check_swaps(plan: Plan) -> list[Finding]:
    """Every problem of the plan's swap groups, rank by rank."""
    findings: list[Finding] = []
    for rank, row in enumerate(plan.ranks):
        groups = _groups(row)
        for (stage, mb), group in sorted(groups.items()):
            if group.swaps:
                findings.extend(_check_group(plan, rank, row, stage, mb, group))
    return findings


def _groups(row: list[Step | None]) -> dict[tuple[int, int], _Group]:
    groups: dict[tuple[int, int], _Group] = defaultdict(_Group)
    for position, step in enumerate(row):
        if step is None:
            continue
        for leaf in step.leaves():
            key = (leaf.stage, leaf.microbatch)
            if leaf.kind in SWAP_KINDS:
                groups[key].swaps[leaf.kind].append(position)  # type: ignore[index]
            elif leaf.kind is StepKind.F and groups[key].forward is None:  # type: ignore[index]
                groups[key].forward = position  # type: ignore[index]
            elif leaf.kind in BACKWARD_KINDS and groups[key].backward is None:  # type: ignore[index]
                groups[key].backward = position  # type: ignore[index]
    return groups


def _check_group(
    plan: Plan, rank: int, row: list[Step | None], stage: int, mb: int, group: _Group
) -> list[Finding]:
    refs = tuple(
        StepRef(rank, p, format_step(row[p]))
        for kind in SWAP_ORDER
        for p in group.swaps.get(kind, ())
    )
    where = f"rank {rank}: the swap group of stage {stage} micro-batch {mb}"
    if group.forward is None or plan.placement[stage] != rank:
        return [
            Finding(
                "swap_without_activations",
                "error",
                f"{where} has no forward {stage}F{mb} on this rank: it has no saved "
                "activations to swap",
                (rank,),
                refs,
            )
        ]
    missing = [f"{stage}{kind.value}{mb}" for kind in SWAP_ORDER if not group.swaps.get(kind)]
    repeated = [f"{stage}{k.value}{mb}" for k in SWAP_ORDER if len(group.swaps.get(k, ())) > 1]
    if missing or repeated:
        what = [f"lacks {', '.join(missing)}"] if missing else []
        what += [f"repeats {', '.join(repeated)}"] if repeated else []
        return [Finding("swap_incomplete", "error", f"{where} {' and '.join(what)}", (rank,), refs)]
    return _order_findings(rank, row, group, where)


def _order_findings(rank: int, row: list[Step | None], group: _Group, where: str) -> list[Finding]:
    at = {kind: positions[0] for kind, positions in group.swaps.items()}
    at[StepKind.F] = group.forward  # type: ignore[assignment]
    if group.backward is not None:
        at[StepKind.B] = group.backward
    findings = []
    for first, then, kind, why in _RULES:
        if first in at and then in at and at[then] <= at[first]:
            early, late = (StepRef(rank, at[k], format_step(row[at[k]])) for k in (then, first))
            findings.append(
                Finding(
                    kind,
                    "error",
                    f"{where}: {early.text} (position {early.position}) comes before "
                    f"{late.text} (position {late.position}), but {why}",
                    (rank,),
                    (early, late),
                )
            )
    return findings
