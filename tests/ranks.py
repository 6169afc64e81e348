"""What the tests of real rank processes share, for the torch and the MindSpore runtime
alike: the recorder factory and the step functions that make a rank fail (module-level and
picklable: each rank process unpickles them), and the checks that no process is left."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from pipetrace.schedule.ir import Step


@dataclass
class Record:
    """Recorder factory: the real recorder of ``backend`` ("torch" or "mindspore") writing
    into ``run_dir``; with several cases in one launch, case n records into
    ``run_dir/case-n`` (each rank process counts its own calls, and every rank runs the
    cases in the same order). A timeout given as a tuple is per rank."""

    run_dir: str
    stall_timeout: float | tuple[float, ...] = 30.0
    abort_timeout: float | tuple[float, ...] = 30.0
    several: bool = False
    backend: str = "torch"
    calls: int = 0

    def __call__(self, rank: int, world_size: int):
        from pipetrace.recorder.setup import RecordSettings, mindspore_recorder, torch_recorder

        where = Path(self.run_dir) / f"case-{self.calls}" if self.several else Path(self.run_dir)
        self.calls += 1
        make = torch_recorder if self.backend == "torch" else mindspore_recorder
        return make(
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
    """``rank`` raises in the step with text ``text`` (every iteration)."""

    rank: int
    text: str

    def __call__(self, step: Step, ctx) -> None:
        if ctx.rank == self.rank and str(step) == self.text:
            raise RuntimeError(f"injected failure in {step}")
        ctx.default(step)


@dataclass(frozen=True)
class BlockAt:
    """``rank`` never returns from the step ``text`` (only the watchdog or the launcher ends
    it): in iteration ``iteration``, or the first time it gets there when None."""

    rank: int
    text: str
    iteration: int | None = None

    def __call__(self, step: Step, ctx) -> None:
        if (
            ctx.rank == self.rank
            and str(step) == self.text
            and self.iteration in (None, ctx.iteration)
        ):
            while True:
                time.sleep(0.5)
        ctx.default(step)


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


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def children_of_this_process() -> list[int]:
    """The live child processes of the test process (a launch must leave none)."""
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == me and alive(int(stat.parent.name)):
            found.append(int(stat.parent.name))
    return found
