"""The timeline filter: which ranks to show and which steps to keep bright.

Syntax (the filter bar and the command palette): space-separated ``key=values`` terms, values
comma-separated, integer ranges with a dash::

    rank=0,2  stage=1-3  mb=0  kind=F,B,send

Keys: ``rank`` (alias ``r``), ``stage`` (``s``), ``mb`` (``microbatch``, ``m``), ``kind`` (``k``).
Kinds are step kinds (F, B, I, W, SEND_F, RECV_B, OVERLAP_F_B, UNSHARD, ...) or the groups
``send``, ``recv``, ``comm``, ``compute``, ``fsdp``. A rank filter hides other ranks; the
others dim the steps they do not match (times stay in place, so the context is kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipetrace.analyze.model import StepCatalog
from pipetrace.schedule.ir import (
    COMM_KINDS,
    COMPUTE_KINDS,
    FSDP_KINDS,
    RECV_KINDS,
    SEND_KINDS,
    StepKind,
)

_KEYS = {
    "rank": "rank",
    "r": "rank",
    "stage": "stage",
    "s": "stage",
    "mb": "mb",
    "m": "mb",
    "microbatch": "mb",
    "kind": "kind",
    "k": "kind",
}
_GROUPS = {
    "send": SEND_KINDS,
    "recv": RECV_KINDS,
    "comm": COMM_KINDS,
    "compute": COMPUTE_KINDS,
    "fsdp": FSDP_KINDS,
    "overlap": frozenset({StepKind.OVERLAP_F_B}),
}


class FilterError(ValueError):
    """A filter text that cannot be understood (the message says what to type instead)."""


@dataclass(frozen=True)
class StepFilter:
    ranks: frozenset[int] | None = None
    stages: frozenset[int] | None = None
    microbatches: frozenset[int] | None = None
    kinds: frozenset[StepKind] | None = None

    @property
    def empty(self) -> bool:
        return self.ranks is None and not self.dims

    @property
    def dims(self) -> bool:
        """Does it dim steps (anything beyond a rank filter)?"""
        return not (self.stages is None and self.microbatches is None and self.kinds is None)

    def describe(self) -> str:
        parts = []
        for name, values in (
            ("rank", self.ranks),
            ("stage", self.stages),
            ("mb", self.microbatches),
        ):
            if values is not None:
                parts.append(f"{name}={','.join(map(str, sorted(values)))}")
        if self.kinds is not None:
            parts.append("kind=" + ",".join(sorted(k.value for k in self.kinds)))
        return " ".join(parts)

    def matching_codes(self, catalog: StepCatalog) -> np.ndarray | None:
        """Bool per catalog code: does the step match (a composite matches when one of its
        sub-steps does)? None when the filter dims nothing."""
        if not self.dims:
            return None
        out = np.zeros(len(catalog.texts), bool)
        for code in range(len(catalog.texts)):
            step = catalog.step(code)
            if step is None:
                continue
            leaves = [step, *step.leaves()] if step.sub_steps else [step]
            out[code] = any(
                self._leaf_matches(leaf.kind, leaf.stage, leaf.microbatch) for leaf in leaves
            )
        return out

    def _leaf_matches(self, kind: StepKind, stage: int | None, mb: int | None) -> bool:
        return (
            (self.kinds is None or kind in self.kinds)
            and (self.stages is None or stage in self.stages)
            and (self.microbatches is None or mb in self.microbatches)
        )


def parse_filter(text: str) -> StepFilter:
    """Parse the filter syntax above; an empty text is no filter."""
    values: dict[str, frozenset] = {}
    for term in text.split():
        key, sep, rest = term.partition("=")
        name = _KEYS.get(key.strip().lower())
        if not sep or name is None:
            raise FilterError(
                f"bad filter term {term!r}: "
                "expected rank=, stage=, mb= or kind=, e.g. 'rank=0,2 kind=F'"
            )
        if not rest:
            raise FilterError(f"bad filter term {term!r}: no value after '='")
        if name == "kind":
            values[name] = values.get(name, frozenset()) | _kinds(rest)
        else:
            values[name] = values.get(name, frozenset()) | _ints(term, rest)
    return StepFilter(values.get("rank"), values.get("stage"), values.get("mb"), values.get("kind"))


def _ints(term: str, text: str) -> frozenset[int]:
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, dash, hi = part.partition("-")
        try:
            if dash:
                a, b = int(lo), int(hi)
                if b < a or b - a > 100_000:
                    raise ValueError
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise FilterError(
                f"bad filter term {term!r}: {part!r} is not a number or a range like 0-3"
            ) from None
    return frozenset(out)


def _kinds(text: str) -> frozenset[StepKind]:
    out: set[StepKind] = set()
    for part in filter(None, text.split(",")):
        group = _GROUPS.get(part.lower())
        if group is not None:
            out.update(group)
            continue
        try:
            out.add(StepKind(part.upper()))
        except ValueError:
            names = ", ".join([k.value for k in StepKind] + sorted(_GROUPS))
            raise FilterError(f"unknown kind {part!r}; expected one of {names}") from None
    return frozenset(out)
