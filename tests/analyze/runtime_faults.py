"""Drive the real torch runtime (`pipetrace.runtime.launch`) with the real recorder, and
inject faults through `register_custom_function`. Everything here is module-level and
picklable: ranks are separate processes that unpickle it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from pipetrace.schedule.ir import Step


@dataclass
class Record:
    """Recorder factory: the real torch recorder writing into ``run_dir``; with several
    cases in one launch, case n records into ``run_dir/case-n`` (each rank process counts
    its own calls, and every rank runs the cases in the same order). A timeout given as a
    tuple is per rank."""

    run_dir: str
    stall_timeout: float | tuple[float, ...] = 30.0
    abort_timeout: float | tuple[float, ...] = 30.0
    several: bool = False
    calls: int = 0

    def __call__(self, rank: int, world_size: int):
        from pipetrace.recorder.setup import RecordSettings, torch_recorder

        where = Path(self.run_dir) / f"case-{self.calls}" if self.several else Path(self.run_dir)
        self.calls += 1
        return torch_recorder(
            RecordSettings(
                run_dir=str(where),
                stall_timeout=_of_rank(self.stall_timeout, rank),
                abort_timeout=_of_rank(self.abort_timeout, rank),
                flush_interval=0.05,
            )
        )


def _of_rank(timeout: float | tuple[float, ...], rank: int) -> float:
    return timeout[rank] if isinstance(timeout, tuple) else timeout


@dataclass(frozen=True)
class SlowRank:
    """Compute steps of ``rank`` sleep ``seconds`` longer (a straggler)."""

    rank: int
    seconds: float

    def __call__(self, step: Step, ctx) -> None:
        if ctx.rank == self.rank:
            time.sleep(self.seconds)
        ctx.default(step)


@dataclass(frozen=True)
class RaiseAt:
    """``rank`` raises in the step with text ``text`` (first iteration)."""

    rank: int
    text: str

    def __call__(self, step: Step, ctx) -> None:
        if ctx.rank == self.rank and str(step) == self.text:
            raise RuntimeError(f"injected failure in {step}")
        ctx.default(step)


@dataclass(frozen=True)
class BlockAt:
    """``rank`` never returns from the step ``text`` (sleeps until killed)."""

    rank: int
    text: str

    def __call__(self, step: Step, ctx) -> None:
        if ctx.rank == self.rank and str(step) == self.text:
            time.sleep(3600)
        ctx.default(step)


@dataclass(frozen=True)
class SkipAt:
    """``rank`` skips the step ``text`` (e.g. drops a recv)."""

    rank: int
    text: str

    def __call__(self, step: Step, ctx) -> None:
        if ctx.rank == self.rank and str(step) == self.text:
            return
        ctx.default(step)


def run(
    run_dir: Path,
    *,
    schedule: str = "1f1b",
    ranks: int = 2,
    microbatches: int = 4,
    steps: int = 2,
    stages_per_rank: int | None = None,
    overlap_p2p: bool = False,
    timeout: float = 20.0,
    custom=(),
    stall_timeout: float | tuple[float, ...] = 30.0,
    abort_timeout: float | tuple[float, ...] = 30.0,
):
    from pipetrace.runtime.config import RunConfig
    from pipetrace.runtime.launch import launch

    config = RunConfig(
        schedule,
        ranks=ranks,
        microbatches=microbatches,
        steps=steps,
        stages_per_rank=stages_per_rank,
        overlap_p2p=overlap_p2p,
        timeout=timeout,
        out=str(run_dir),
    )
    return launch(
        [config],
        make_recorder=Record(str(run_dir), stall_timeout, abort_timeout),
        custom_functions=custom,
        kill_grace=2.0,
    )


def run_many(run_dir: Path, configs: list[dict], *, ranks: int = 4):
    """One launch, several schedules; case n is recorded in ``run_dir/case-n``."""
    from pipetrace.runtime.config import RunConfig
    from pipetrace.runtime.launch import launch

    cases = [RunConfig(ranks=ranks, out=str(run_dir), timeout=30.0, **c) for c in configs]
    return launch(cases, make_recorder=Record(str(run_dir), several=True), kill_grace=2.0)


@dataclass
class SwapSends:
    """``rank`` posts the send ``first`` only after the send ``second`` (a reordered pair)."""

    rank: int
    first: str
    second: str
    held: object = None

    def __call__(self, step: Step, ctx) -> None:
        if ctx.rank == self.rank and str(step) == self.first:
            self.held = step
            return
        ctx.default(step)
        if ctx.rank == self.rank and str(step) == self.second and self.held is not None:
            ctx.default(self.held)
            self.held = None
