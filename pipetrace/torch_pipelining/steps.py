"""Finding the plan's own `Step` for what torch is doing.

The recorder caches each step's text by object identity (plans keep their steps alive), so
every hook call must pass the plan's `Step` objects, never fresh ones; this index maps what
torch's calls say (an action string, or kind + stage + micro-batch) to them, with their
plan positions.
"""

from __future__ import annotations

from pipetrace.schedule.ir import Plan, Step, StepKind, format_step

Key = tuple[StepKind, int | None, int | None]
Entry = tuple[int, Step]  # (plan position, the plan's step)


def key_of(step: Step) -> Key:
    return (step.kind, step.stage, step.microbatch)


class StepIndex:
    """One rank's steps by text (torch's action strings) and by (kind, stage, micro-batch);
    a composite's sub-steps are found through `sub_step`."""

    def __init__(self, plan: Plan, rank: int) -> None:
        self.by_text: dict[str, Entry] = {}
        self.by_key: dict[Key, Entry] = {}
        self.has_composites = False
        for position, step in enumerate(plan.steps(rank)):
            self.by_text[format_step(step)] = (position, step)
            if step.sub_steps:
                self.has_composites = True
            else:
                self.by_key[key_of(step)] = (position, step)

    def of_stage(self, kind: StepKind, stage: int) -> dict[int | None, Entry]:
        """The ``kind`` steps of ``stage`` by micro-batch: a hook made for one stage and kind
        then finds its step with one lookup of the micro-batch it is called with."""
        return {mb: entry for (k, s, mb), entry in self.by_key.items() if k is kind and s == stage}

    def sub_step(self, composite: Entry, key: Key) -> Entry | None:
        """The sub-step of an open composite that ``key`` names, at the composite's position."""
        position, step = composite
        for sub in step.sub_steps:
            if key_of(sub) == key:
                return position, sub
        return None
