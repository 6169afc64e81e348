"""The timing simulator: run a plan with step costs and report makespan, idle time and memory.

It is the shared executor (:mod:`.execution`) with durations: compute steps take their cost
on the rank's CPU, SEND and RECV take none there, and a message spends
``comm + message_bytes / bandwidth`` on the wire. Under ``eager`` a recv ends once its
message has arrived; under ``rendezvous`` and ``fifo`` both ends finish together, one
transfer after the later of the two arrived. Analyzers call it with measured costs:
``simulate(plan, Costs(per_stage=measured))``.

Memory proxy: a rank's in-flight activations go up by one when an F ends and down by one
when the B of that (stage, micro-batch) ends, or its W when the backward is split (the
activations are needed until the weight gradient is done). Within an OVERLAP_F_B step the
forward is counted first, so the peak includes both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from numbers import Integral

import numpy as np

from pipetrace.records import JsonRecord, record_json

from .execution import (
    CODES,
    SEMANTICS,
    Outcome,
    Program,
    compile_plan,
    execute,
    planned_outcome,
    stalls,
    with_messages,
)
from .ir import COMPUTE_KINDS, Plan, ScheduleError, Step, StepKind, format_step, thread_parts
from .swap_timing import has_swap_waits, settle_swap_waits

__all__ = ["Costs", "RankStats", "SimResult", "SimStep", "peak_inflight_by_stage", "simulate"]

_COMPUTE_NAMES = ("F", "B", "I", "W")
_SCALARS = ("F", "B", "I", "W", "comm", "bandwidth", "message_bytes")
_SWAP_SCALARS = ("swap_bandwidth", "swap_bytes")  # in the JSON only when a copy takes time


@dataclass
class Costs:
    """Step costs in any time unit (the simulator's outputs use the same unit).

    ``per_stage[(stage, "F")]`` overrides the kind's cost for one stage (measured costs).
    """

    F: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741
    W: float = 1.0
    comm: float = 0.0
    bandwidth: float = math.inf
    message_bytes: float = 0.0
    swap_bandwidth: float = math.inf
    swap_bytes: float = 0.0  # the activations of one swap group
    per_stage: dict[tuple[int, str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for stage, kind in self.per_stage:
            if kind not in _COMPUTE_NAMES or not isinstance(stage, Integral) or stage < 0:
                raise ScheduleError(
                    f"bad per-stage cost key {(stage, kind)!r}: expected (stage, kind) with a "
                    "stage index >= 0 and kind F, B, I or W"
                )

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Parse ``"F=1,B=2,I=1,W=1,comm=0.5"``; ``"3:F=1.5"`` sets stage 3's forward cost."""
        costs = cls()
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value_text = (s.strip() for s in item.partition("="))
            if not sep:
                raise ScheduleError(f"bad cost {item!r}: expected KEY=VALUE, e.g. 'B=2'")
            try:
                value = float(value_text)
            except ValueError:
                raise ScheduleError(f"bad cost {item!r}: {value_text!r} is not a number") from None
            stage_text, colon, kind = key.rpartition(":")
            if colon and stage_text.isdigit() and kind in _COMPUTE_NAMES:
                costs.per_stage[(int(stage_text), kind)] = _checked(item, kind, value)
            elif not colon and key in _SCALARS + _SWAP_SCALARS:
                setattr(costs, key, _checked(item, key, value))
            else:
                raise ScheduleError(
                    f"bad cost {item!r}: unknown key {key!r}; expected one of "
                    f"{', '.join(_SCALARS + _SWAP_SCALARS)} or STAGE:KIND such as '3:F'"
                )
        return costs

    @property
    def transfer(self) -> float:
        """A message's time on the wire."""
        return self.comm + self.message_bytes / self.bandwidth

    @property
    def swap_transfer(self) -> float:
        """One activation swap copy's time on the rank's side resource (`swap_timing`)."""
        return self.swap_bytes / self.swap_bandwidth

    def cost_of(self, step: Step) -> float:
        """CPU time of one step, FSDP and comm steps 0. A composite takes its longest
        thread: the parts one thread runs one after another add up (`thread_parts`)."""
        if step.sub_steps:
            return max(sum(map(self.cost_of, group)) for group in thread_parts(step))
        if step.kind not in COMPUTE_KINDS:
            return 0.0
        kind = step.kind.value
        return self.per_stage.get((step.stage, kind), getattr(self, kind))

    def to_json(self) -> dict[str, object]:
        return {
            **{key: _finite(getattr(self, key)) for key in _SCALARS},
            **{key: _finite(getattr(self, key)) for key in _SWAP_SCALARS if self.swap_transfer > 0},
            "per_stage": [
                {"stage": s, "kind": k, "cost": c} for (s, k), c in sorted(self.per_stage.items())
            ],
        }


def _checked(item: str, key: str, value: float) -> float:
    if key in ("bandwidth", "swap_bandwidth") and not value > 0:
        raise ScheduleError(f"bad cost {item!r}: bandwidth must be positive")
    if math.isnan(value) or value < 0 or ("bandwidth" not in key and math.isinf(value)):
        raise ScheduleError(f"bad cost {item!r}: expected a finite non-negative number")
    return value


def _finite(value: float) -> float | None:
    """JSON has no infinity: an unbounded value is written as null."""
    return None if math.isinf(value) else value


@dataclass(frozen=True, slots=True)
class SimStep(JsonRecord):
    rank: int
    position: int  # index into plan.ranks[rank], bubbles included
    step: str  # its text, e.g. "2F3" (as a finding's StepRef.step)
    kind: str
    start: float
    end: float


@dataclass(slots=True)
class RankStats:
    """``busy`` is compute time; waiting in a SEND or RECV counts as idle, like a bubble."""

    rank: int
    busy: float
    idle: float
    idle_fraction: float  # idle / makespan
    bubble_ratio: float  # idle / busy
    peak_inflight_activations: int

    def to_json(self) -> dict[str, object]:
        return record_json(self, bubble_ratio=_finite(self.bubble_ratio))


@dataclass
class SimResult:
    """The simulated run of ``plan`` (the lowered plan when a compute-only one was given).

    ``timeline`` is built from the executor's arrays on first access: a large plan has
    hundreds of thousands of steps, and most callers only want the statistics.
    """

    plan: Plan
    semantics: str
    costs: Costs
    makespan: float
    per_rank: list[RankStats]
    idle_fraction: float  # sum idle / (ranks * makespan)
    bubble_ratio: float  # sum idle / sum busy
    _outcome: Outcome = field(repr=False)
    _timeline: list[SimStep] | None = field(default=None, init=False, repr=False)

    @property
    def timeline(self) -> list[SimStep]:
        if self._timeline is None:
            self._timeline = [
                SimStep(rank, position, format_step(step), step.kind.value, start, end)
                for rank in range(len(self._outcome.program.steps))
                for step, position, start, end in zip(*self.rank_steps(rank))
            ]
        return self._timeline

    def rank_steps(self, rank: int) -> tuple[list[Step], Sequence[int], list[float], list[float]]:
        """One rank's simulated steps as columns: the steps, their positions in the rank's
        plan (bubbles included), starts and ends; as many as the rank ran. What `timeline`
        holds for one rank, without making a `SimStep` of every step of every rank."""
        outcome = self._outcome
        steps, positions = outcome.program.steps[rank], outcome.program.positions[rank]
        start, end = outcome.start[rank], outcome.end[rank]
        n = min(len(steps), len(positions), len(start), len(end))
        return steps[:n], positions[:n], start[:n], end[:n]

    def to_json(self, *, timeline: bool = False) -> dict[str, object]:
        data: dict[str, object] = {
            "plan": {
                "name": self.plan.name,
                "params": self.plan.params,
                "num_ranks": self.plan.num_ranks,
                "num_stages": self.plan.num_stages,
                "num_microbatches": self.plan.num_microbatches,
            },
            "semantics": self.semantics,
            "costs": self.costs.to_json(),
            "makespan": self.makespan,
            "idle_fraction": self.idle_fraction,
            "bubble_ratio": _finite(self.bubble_ratio),
            "per_rank": [r.to_json() for r in self.per_rank],
        }
        if timeline:
            data["timeline"] = [s.to_json() for s in self.timeline]
        return data


def simulate(plan: Plan, costs: Costs | None = None, *, semantics: str = "eager") -> SimResult:
    """Time a plan; a compute-only plan is lowered first. A plan that cannot finish raises
    ScheduleError naming the blocked ranks (``verify`` explains every problem)."""
    if semantics not in SEMANTICS:
        raise ScheduleError(f"unknown semantics {semantics!r}; expected one of {SEMANTICS}")
    from pipetrace.gc_pause import gc_paused

    costs = costs if costs is not None else Costs()
    with gc_paused():
        executed = plan if plan.has_comms() else with_messages(plan)
        program = compile_plan(executed)
        durations = _durations(program, costs)
        if costs.swap_transfer > 0 and has_swap_waits(program):
            outcome = settle_swap_waits(
                program,
                durations,
                costs.swap_transfer,
                lambda timed: execute(program, semantics, timed, costs.transfer),
            )
        else:
            outcome = _planned(program, costs, semantics) or execute(
                program, semantics, durations, costs.transfer
            )
        if outcome.blocked():
            blocked = sorted(outcome.blocked())
            raise ScheduleError(
                f"the plan cannot finish under {semantics}: ranks {blocked} are blocked ("
                + "; ".join(s.message for s in stalls(outcome))
                + "); run verify for every problem"
            )
        return _result(executed, semantics, costs, outcome, durations)


def _planned(program: Program, costs: Costs, semantics: str) -> Outcome | None:
    """The eager outcome the lowering already computed (`execution.planned_outcome`), when
    these costs can be the ones it simulated with: one cost per kind, nothing on the wire.
    A built plan simulated with the default costs needs no run of its ~4e5 steps."""
    if semantics != "eager" or costs.per_stage or costs.transfer != 0:
        return None
    return planned_outcome(program, (costs.F, costs.B, costs.I, costs.W))


def _durations(program: Program, costs: Costs) -> list[list[float]]:
    """Per rank, each step's CPU time, looked up by step id (a composite by `cost_of`)."""
    table = [costs.F, costs.B, costs.I, costs.W, 0.0, 0.0, 0.0, 0.0]  # by id & 7 (-1 & 7 = 7)
    one_stage = 8 * program.mb_stride
    per_stage = {
        stage * 8 + _COMPUTE_NAMES.index(kind): cost
        for (stage, kind), cost in costs.per_stage.items()
    }  # codes 0..3 are F, B, I, W
    ids = program.arrays.ids
    if per_stage and ids.dtype == object:  # ids past int64: looked up one by one
        rows = [
            [
                per_stage.get((k // one_stage) * 8 + (k & 7), table[k & 7]) if k >= 0 else 0.0
                for k in row
            ]
            for row in program.ids
        ]
    else:  # one lookup over every step (object arrays: costs keep their type)
        if per_stage:
            keys = np.where(ids >= 0, (ids // one_stage) * 8 + (ids & 7), -1)
            lookup = _stage_cost_table(table, per_stage, int(keys.max(initial=-1)) + 1)
        else:
            keys, lookup = (ids & 7).astype(np.int64), np.array(table, dtype=object)
        rows = list(program.rank_slices(lookup[keys].tolist()))
    for steps, ids_of_rank, row in zip(program.steps, program.ids, rows):
        if -1 in ids_of_rank:  # FSDP or composite steps
            for i in [i for i, step in enumerate(steps) if step.sub_steps]:
                row[i] = costs.cost_of(steps[i])
    return rows


def _stage_cost_table(table: list[float], per_stage: dict[int, float], size: int) -> np.ndarray:
    """The cost of each key ``stage * 8 + code`` below ``size`` (the kind's when the stage
    has none of its own), then 0.0 at the end: key -1 (a step without an id) reads it."""
    lookup = np.array([table[key & 7] for key in range(size)] + [0.0], dtype=object)
    for key, cost in per_stage.items():
        if 0 <= key < size:
            lookup[key] = cost
    return lookup


_ACTIVATIONS = (1, -1, 0, -1, 0, 0, 0, 0)  # by step code: F holds one, B or W frees it


def _peak_inflights(program: Program) -> list[int]:
    """Per rank, the running maximum (from 0) of +1 per F end and -1 per B or W end, in the
    rank's order: one cumulative sum over every step's code, cut at the ranks' starts. A
    rank with composite steps counts their leaves instead (`_peak_inflight`)."""
    sizes = np.array([len(row) for row in program.ids], dtype=np.int64)
    codes = (program.arrays.ids & 7).astype(np.int64)  # -1 & 7 is 7: FSDP steps count 0
    running = np.cumsum(np.array(_ACTIVATIONS, dtype=np.int64)[codes])
    starts = np.cumsum(sizes) - sizes
    before = np.where(starts > 0, running[np.maximum(starts - 1, 0)], 0)
    nonempty = sizes > 0
    peaks = np.zeros(len(sizes), dtype=np.int64)
    if nonempty.any():
        highest = np.maximum.reduceat(running, starts[nonempty])
        peaks[nonempty] = np.maximum(highest - before[nonempty], 0)
    result = peaks.tolist()
    for rank, ids in enumerate(program.ids):
        if -1 in ids and any(s.sub_steps for s in program.steps[rank]):
            result[rank] = _peak_inflight(program, rank)
    return result


def _held_changes(steps: list[Step]) -> list[tuple[int, int]]:
    """(stage, +1 / -1 / 0) per compute leaf in order; an overlap's forward counts first."""
    return [
        (leaf.stage, _ACTIVATIONS[CODES[leaf.kind]])  # type: ignore[misc]
        for s in steps
        for leaf in sorted(s.leaves(), key=lambda x: x.kind is not StepKind.F)
        if leaf.kind in CODES
    ]


def _peak_inflight(program: Program, rank: int) -> int:
    """`_peak_inflights` of a rank with composite steps: its leaves' changes."""
    changes = [change for _, change in _held_changes(program.steps[rank])]
    return max(accumulate(changes, initial=0))


def peak_inflight_by_stage(plan: Plan) -> dict[int, int]:
    """The memory proxy above per stage: the most micro-batches whose activations a stage
    holds at once, following its rank's step order (no timing needed). 1F1B's stage s of P
    holds P - s, GPipe's every stage M."""
    held: dict[int, int] = {}
    peak: dict[int, int] = {}
    for rank in range(plan.num_ranks):
        for stage, change in _held_changes(plan.steps(rank)):
            held[stage] = held.get(stage, 0) + change
            peak[stage] = max(peak.get(stage, 0), held[stage])
    return peak


def _result(
    plan: Plan, semantics: str, costs: Costs, outcome: Outcome, durations: list[list[float]]
) -> SimResult:
    program = outcome.program
    makespan = max((ends[-1] for ends in outcome.end if ends), default=0.0)
    per_rank = []
    peaks = _peak_inflights(program)
    for rank, row in enumerate(durations):
        busy = math.fsum(row)
        idle = max(makespan - busy, 0.0)
        per_rank.append(
            RankStats(
                rank,
                busy,
                idle,
                idle / makespan if makespan else 0.0,
                _ratio(idle, busy),
                peaks[rank],
            )
        )
    busy = math.fsum(r.busy for r in per_rank)
    idle = math.fsum(r.idle for r in per_rank)
    span = makespan * len(per_rank)
    return SimResult(
        plan,
        semantics,
        costs,
        makespan,
        per_rank,
        idle / span if span else 0.0,
        _ratio(idle, busy),
        outcome,
    )


def _ratio(idle: float, busy: float) -> float:
    """idle / busy; a rank with idle time and no work has an infinite ratio."""
    if busy:
        return idle / busy
    return math.inf if idle else 0.0
