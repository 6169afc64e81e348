"""Helpers the MindSpore worker processes import (they are pickled to the ranks): a recorder
factory writing each case of a launch to its own run directory, and step functions that
raise or never return; plus process checks for the tests. Module-level and picklable,
importable without MindSpore. (No __init__.py in this directory: a package named
``mindspore`` here would shadow the real one.)"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from pipetrace.schedule.ir import Step


@dataclass
class RecordCases:
    """Recorder factory: the real MindSpore recorder; case n of a launch records into
    ``run_dir/case-n`` (each rank process counts its own calls; ranks run the cases in order)."""

    run_dir: str
    stall_timeout: float = 30.0
    abort_timeout: float = 30.0
    calls: int = 0

    def __call__(self, rank: int, world_size: int):
        from pipetrace.recorder.setup import RecordSettings, mindspore_recorder

        where = Path(self.run_dir) / f"case-{self.calls}"
        self.calls += 1
        return mindspore_recorder(
            RecordSettings(
                run_dir=str(where),
                stall_timeout=self.stall_timeout,
                abort_timeout=self.abort_timeout,
                flush_interval=0.05,
            )
        )


@dataclass(frozen=True)
class RaiseAt:
    """``rank`` raises in the step ``text`` (every iteration)."""

    rank: int
    text: str

    def __call__(self, step: Step, ctx) -> None:
        if ctx.rank == self.rank and str(step) == self.text:
            raise RuntimeError(f"injected failure in {step}")
        ctx.default(step)


@dataclass(frozen=True)
class BlockAt:
    """``rank`` never returns from the step ``text`` in iteration ``iteration``."""

    rank: int
    text: str
    iteration: int = 1

    def __call__(self, step: Step, ctx) -> None:
        if ctx.rank == self.rank and ctx.iteration == self.iteration and str(step) == self.text:
            while True:  # only the watchdog (or the launcher) ends this
                time.sleep(0.5)
        ctx.default(step)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def children_of_this_process() -> list[int]:
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == me and alive(int(stat.parent.name)):
            found.append(int(stat.parent.name))
    return found
