"""A fake cluster: a plan run by real Recorders on virtual time, with injected faults.

Every rank walks its plan. When each step starts and ends, and where a rank blocks for
good, comes from the schedule executor (`pipetrace.schedule.execution.execute`) under
``eager`` (isend/irecv: a send never blocks) or ``rendezvous`` semantics, with per-kind
compute costs; messages are matched by their identity (gloo's tags). Each rank's part is
then played into a real `Recorder` on a `VirtualClock` (`pipetrace.testing.replay`), so the
logs are what the recorder writes, with any clock offsets, and nothing sleeps.

Faults are the runtime's own declarations (`pipetrace.runtime.faults`, as ``pipetrace run
--inject`` resolves them: every field given). Each strikes in its ``step`` (the iteration),
stragglers from it on:

- ``Crash`` / ``Hang``: the rank raises in (records the exception) / never returns from its
  target step; ``DropRecv`` / ``DropSend``: the step posts nothing; ``ExtraSend``: the
  message is posted twice, the copy never waited; ``ShapeMismatch``: the send declares
  ``shape``; ``SwapOrder``: the first send of the pair runs right after the second, each
  under its own tag (so under rendezvous the pair can deadlock, unlike the runtime's
  re-tagged swap); ``Deadlock``: the held send runs right after the recv it waits for;
  ``Straggler``: the phase's compute costs ``factor`` times as much.

A rank that stops (blocked, crashed or hung) leaves its log as a killed process does: the
open step (and its op) never ends, no ``run_end``; with ``stall_after_ns`` a blocked or hung
rank first records the watchdog's ``stall`` event. Later iterations do not run.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pipetrace.recorder import run_dir as run_dir_module
from pipetrace.runtime import faults as ft
from pipetrace.runtime.fault_plan import StepOrder, consecutive_sends
from pipetrace.schedule.builders import build_plan
from pipetrace.schedule.execution import Outcome, compile_plan, execute
from pipetrace.schedule.ir import Plan, Step, format_step
from pipetrace.testing.replay import (
    BLOCKED,
    CRASHED,
    DROP,
    EXTRA,
    FINISHED,
    HUNG,
    IterationScript,
    Message,
    Playback,
    RankJob,
    WireFault,
    play_rank,
)

DEFAULT_COSTS_NS = {"F": 1_000_000, "B": 2_000_000, "I": 1_000_000, "W": 1_000_000}
ITERATION_GAP_NS = 200_000
"""From the slowest rank's last step of an iteration to the next iteration's start."""

_MODELLED = (
    ft.Crash,
    ft.Hang,
    ft.DropRecv,
    ft.DropSend,
    ft.ExtraSend,
    ft.ShapeMismatch,
    ft.SwapOrder,
    ft.Deadlock,
    ft.Straggler,
)


@dataclass
class Costs:
    """What steps cost on virtual time."""

    compute_ns: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_COSTS_NS))
    """Per step kind (F, B, I, W); a composite costs its dearest sub-step."""
    transfer_ns: int = 20_000
    """A message's time on the wire."""
    jitter: float = 0.0
    """Each compute cost varies by up to this fraction (drawn per iteration)."""
    slow_stages: dict[int, float] = field(default_factory=dict)
    """Stage -> factor on its compute costs."""
    seed: int = 0


@dataclass
class FakeCluster:
    """A run to record: the plan, how it is timed, and what goes wrong."""

    plan: Plan
    iterations: int = 2
    costs: Costs = field(default_factory=Costs)
    semantics: str = "eager"
    faults: Sequence[ft.Fault] = ()
    rank_steps: dict[int, list[Step]] = field(default_factory=dict)
    """Ranks launched with other steps than the plan gives them (a plan divergence)."""
    clock_offsets_ns: Sequence[int] | None = None
    """Each rank's true wall-clock offset to rank 0."""
    clock_errors_ns: Sequence[int] | None = None
    """The error of the offset each rank records (so raw alignment can misorder a pair)."""
    clock_skews: Sequence[float] | None = None
    """How fast each rank's clock runs (20e-6: 20 ppm fast); its offset drifts with it."""
    hosts: Sequence[str] | None = None
    """Each rank's host name (None: all on this machine). Give ranks of one host the same
    clock offset and skew: they share its clock."""
    overlap: bool = False
    """Post every recv at the iteration's start and drain sends at its end (overlapped P2P)."""
    substeps: bool = True
    """Record a composite's sub-steps, as the runtime does."""
    stall_after_ns: int | None = None
    """A rank that blocks or hangs records a watchdog stall this long after it stopped."""
    message: Message = field(default_factory=Message)
    config: dict[str, Any] | None = None
    """The run's config as recorded (default: schedule, P2P mode, synthetic)."""
    framework: str = "synthetic"
    record_mode: str = "steps"
    """The recorder's mode ("full": also the Python stack of each P2P post)."""
    activation_bytes: int = 0
    """Bytes a forward keeps for its micro-batch's backward; above 0 the ranks record
    ``memory`` samples as the runtime does (`pipetrace.testing.replay.MemoryModel`)."""
    losses: Sequence[float] = ()
    """The last stage's loss in each iteration (0.5 past the end of this)."""

    @classmethod
    def of(
        cls,
        schedule: str = "1f1b",
        *,
        ranks: int = 4,
        microbatches: int = 4,
        stages_per_rank: int | None = None,
        **options: Any,
    ) -> FakeCluster:
        """A cluster running a built-in schedule (``options``: the other fields)."""
        plan = build_plan(
            schedule,
            num_ranks=ranks,
            num_microbatches=microbatches,
            stages_per_rank=stages_per_rank,
            comms=True,
        )
        return cls(plan, **options)

    def __post_init__(self) -> None:
        for fault in self.faults:
            if not isinstance(fault, _MODELLED):
                raise ValueError(f"the fake cluster does not model {fault.KIND} faults")
            # one pipeline: a fault's replica stays None, as resolving leaves it
            unset = [
                f.name
                for f in fields(fault)
                if getattr(fault, f.name) is None and f.name != "replica"
            ]
            if unset:
                raise ValueError(f"{fault.spec}: give {', '.join(unset)} (faults come resolved)")

    def record(self, run_dir: str | Path, *, workers: int = 1) -> Plan:
        """Write meta.json and every rank's log into ``run_dir``; returns the plan."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        jobs = self.jobs(str(run_dir))
        if workers > 1:
            # one run id for this process and its pool (each worker's parent is this process,
            # this process's is not): the run directory is claimed once, by all of them
            own = run_dir_module.RUN_ID_ENV not in os.environ
            if own:
                os.environ[run_dir_module.RUN_ID_ENV] = run_dir_module.current_run_id()
            try:
                self._play_in_pool(jobs, workers)
            finally:
                if own:
                    del os.environ[run_dir_module.RUN_ID_ENV]
        else:
            for job in jobs:
                play_rank(job)
        return self.plan

    @staticmethod
    def _play_in_pool(jobs: list[RankJob], workers: int) -> None:
        with ProcessPoolExecutor(workers) as pool:
            chunk = max(1, len(jobs) // (4 * workers))
            played = pool.map(play_rank, jobs[1:], chunksize=chunk)
            play_rank(jobs[0])  # here: its job holds the whole plan (for meta.json)
            list(played)

    def jobs(self, run_dir: str) -> list[RankJob]:
        """One job per rank, in rank order."""
        world = self.plan.num_ranks
        given = self._given_plan()
        texts = [[format_step(s) for s in given.steps(r)] for r in range(world)]
        iterations = self._iterations(given, texts)
        period = max(_last_end(s) for scripts in iterations for s in scripts) + ITERATION_GAP_NS
        offsets = self.clock_offsets_ns or [0] * world
        errors = self.clock_errors_ns or [0] * world
        skews = self.clock_skews or [0.0] * world
        hosts = self.hosts or [None] * world
        config = self.config or {
            "schedule": self.plan.name,
            "p2p": "overlap" if self.overlap else "plain",
            "synthetic": True,
        }
        run = Playback(
            str(run_dir),
            world,
            self.plan.placement,
            self.plan.num_microbatches,
            config,
            period,
            self.message,
            self.overlap,
            self.substeps,
            self.stall_after_ns,
            self.framework,
            self.record_mode,
            self.activation_bytes,
            tuple(self.losses),
        )
        meta_plan = None if self.rank_steps.get(0) else self.plan
        return [
            RankJob(
                run,
                r,
                texts[r],
                [scripts[r] for scripts in iterations],
                offsets[r],
                offsets[r] + errors[r],
                meta_plan if r == 0 else None,
                skews[r],
                hosts[r],
            )
            for r in range(world)
        ]

    # -- timing ----------------------------------------------------------------------------

    def _given_plan(self) -> Plan:
        plan = self.plan
        if not self.rank_steps:
            return plan
        rows = [self.rank_steps.get(r, plan.steps(r)) for r in range(plan.num_ranks)]
        return Plan(plan.num_microbatches, plan.placement, rows, plan.name, dict(plan.params))  # type: ignore[arg-type]

    def _iterations(self, given: Plan, texts: list[list[str]]) -> list[list[IterationScript]]:
        """Per iteration, every rank's script; stops after an iteration where a rank stops.
        ``texts``: each rank's step texts (shared by the scripts of unchanged rows)."""
        rng = random.Random(self.costs.seed)
        clean_rows = [list(enumerate(given.steps(r))) for r in range(given.num_ranks)]
        result: list[list[IterationScript]] = []
        previous: tuple | None = None
        for it in range(self.iterations):
            active = tuple(f for f in self.faults if _active(f, it))
            if previous is not None and previous[0] == active and not self.costs.jitter:
                scripts = previous[1]  # nothing differs from the last iteration: same timing
            else:
                scripts = self._iteration(given, clean_rows, texts, active, rng)
            result.append(scripts)
            previous = (active, scripts)
            if any(s.ending != FINISHED for s in scripts):
                break
        return result

    def _iteration(
        self,
        given: Plan,
        clean_rows: list[list[tuple[int, Step]]],
        texts: list[list[str]],
        active: tuple[ft.Fault, ...],
        rng: random.Random,
    ) -> list[IterationScript]:
        rows = [_moved(given, r, row, active) for r, row in enumerate(clean_rows)]
        struck = {f.rank: f for f in active if isinstance(f, (ft.Crash, ft.Hang))}
        stops = {}
        for rank, fault in struck.items():
            target = fault.target(given)  # type: ignore[union-attr]
            stop = next(i for i, (_, s) in enumerate(rows[rank]) if target in s.leaves())
            rows[rank] = rows[rank][: stop + 1]
            stops[rank] = (stop, CRASHED if isinstance(fault, ft.Crash) else HUNG, target)
        durations = self._durations(rows, active, rng)
        for rank, (stop, _, _) in stops.items():
            durations[rank][stop] = 0.0
        wire = [_wire(given, r, rows[r], active) for r in range(given.num_ranks)]
        outcome = self._execute(given, rows, wire, durations)
        scripts = []
        for r, row in enumerate(rows):
            clean = row is clean_rows[r]
            script = IterationScript(
                positions=[p for p, _ in row],
                texts=texts[r] if clean else [format_step(s) for _, s in row],
                start=outcome.start[r],
                end=outcome.end[r],
                stop=outcome.cursors[r],
                wire=wire[r],
            )
            if r in stops:
                script.stop, script.ending, target = stops[r]
                script.struck = format_step(target)
            elif script.stop < len(row):
                script.ending = BLOCKED
            scripts.append(script)
        return scripts

    def _durations(
        self, rows: list[list[tuple[int, Step]]], active: tuple[ft.Fault, ...], rng: random.Random
    ) -> list[list[float]]:
        """Each step's cost: its dearest sub-step's, by kind, stage and stragglers."""
        costs, slow, jitter = self.costs.compute_ns, self.costs.slow_stages, self.costs.jitter
        stragglers = [f for f in active if isinstance(f, ft.Straggler)]
        out = []
        for rank, row in enumerate(rows):
            factors = {
                kind: f.factor or 1.0 for f in stragglers if f.rank == rank for kind in f.kinds
            }
            durations = []
            for _, step in row:
                cost = 0.0
                for leaf in step.leaves():
                    if leaf.kind.value in costs:
                        c = costs[leaf.kind.value] * slow.get(leaf.stage, 1.0)  # type: ignore[arg-type]
                        c *= factors.get(leaf.kind, 1.0)
                        cost = max(cost, c * (1 + rng.uniform(-jitter, jitter)))
                durations.append(cost)
            out.append(durations)
        return out

    def _execute(
        self,
        given: Plan,
        rows: list[list[tuple[int, Step]]],
        wire: list[dict[int, WireFault]],
        durations: list[list[float]],
    ) -> Outcome:
        ran = Plan(
            given.num_microbatches,
            given.placement,
            [[s for _, s in row] for row in rows],  # type: ignore[misc]
            given.name,
            dict(given.params),
        )
        program = compile_plan(ran)
        for rank, faults in enumerate(wire):
            for index, what in faults.items():
                if what == DROP:  # nothing posted: the step neither waits nor is waited for
                    program.keys[rank][index] = -1
        return execute(program, self.semantics, durations, transfer=float(self.costs.transfer_ns))


def _active(fault: ft.Fault, it: int) -> bool:
    if isinstance(fault, ft.Straggler):
        return it >= (fault.step or 0)
    return it == fault.step


def _moved(
    given: Plan, rank: int, row: list[tuple[int, Step]], active: tuple[ft.Fault, ...]
) -> list[tuple[int, Step]]:
    """The rank's steps in the order it runs them: a swapped or held send runs right after
    the step it waits for (``row`` itself when nothing moves)."""
    steps = given.steps(rank)
    order = StepOrder(steps)
    for fault in active:
        if fault.rank != rank:
            continue
        if isinstance(fault, ft.SwapOrder):
            first, second = next(
                (a, b)
                for a, b in consecutive_sends(given, rank, fault.channel or "F")
                if a.microbatch == fault.microbatch
            )
            order.move(0, first, after=second)
        elif isinstance(fault, ft.Deadlock):
            send, recv = fault.hold(given, overlap=False)
            order.move(0, send, after=recv)
    moved = order(0)
    return row if moved is None else [row[i] for i in moved]


def _wire(
    given: Plan, rank: int, row: list[tuple[int, Step]], active: tuple[ft.Fault, ...]
) -> dict[int, WireFault]:
    """Index in ``row`` -> what happens to that step's message."""
    out: dict[int, WireFault] = {}
    for fault in active:
        if fault.rank != rank:
            continue
        if isinstance(fault, (ft.DropRecv, ft.DropSend)):
            what: WireFault = DROP
        elif isinstance(fault, ft.ExtraSend):
            what = EXTRA
        elif isinstance(fault, ft.ShapeMismatch):
            what = tuple(fault.shape or ())
        else:
            continue
        target = fault.target(given)
        out[next(i for i, (_, s) in enumerate(row) if s == target)] = what
    return out


def _last_end(script: IterationScript) -> float:
    return script.end[script.stop - 1] if script.stop else 0.0
