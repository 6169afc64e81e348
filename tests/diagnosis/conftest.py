"""Recorded runs of the real runtime with injected faults (`pipetrace run --inject`), shared
by the diagnosis tests and launched lazily, a group at a time.

A launch costs a few seconds per rank (process start, `import torch`), so runs that end
cleanly share one launch per world size; a run that crashes or hangs ends its launch, so it
gets one of its own. Faults that hang are ended by the watchdog after ``stall + abort``
seconds (short here).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipetrace.runtime.config import RunConfig
from pipetrace.runtime.faults import FAULT_KINDS

# The schedules every fault is diagnosed on: 1F1B on 3 ranks (a middle rank with a
# neighbour on each side, chains of waiting ranks) and the zero-bubble V schedule on 2 (two
# stages per rank, messages both ways between the ranks).
SCHEDULES = {"1f1b": dict(schedule="1f1b", ranks=3), "zbv": dict(schedule="zbv", ranks=2)}
CLEAN = {  # schedule -> (ranks, stages per rank, overlapped P2P)
    "gpipe": (2, None, False),
    "1f1b": (3, None, False),
    "interleaved-1f1b": (2, 2, False),
    "zb1p": (2, 2, True),
    "zbv": (2, None, False),
    "dualpipev": (2, None, True),
}
BASE = dict(microbatches=4, steps=2)
HANGING = dict(
    timeout=20.0, stall_timeout=2.0, abort_timeout=1.5
)  # the watchdog ends a hang in ~4 s


SPECS = {"straggler": "straggler:factor=6"}
"""Faults injected with more than their defaults: 3x of a sub-millisecond step could drown
in a loaded machine's noise (the slow rank then read as waiting on its link)."""


def fault_case(kind: str, schedule: str) -> str:
    return f"{kind}-{schedule}"


def all_cases() -> dict[str, RunConfig]:
    """Every run of the suite by name (without its directory)."""
    cases = {}
    for schedule, (ranks, v, overlap) in CLEAN.items():
        cases[f"clean-{schedule}"] = RunConfig(
            schedule, ranks=ranks, stages_per_rank=v, overlap_p2p=overlap, **BASE
        )
    for kind in FAULT_KINDS:
        for schedule, run in SCHEDULES.items():
            hanging = HANGING if FAULT_KINDS[kind].HANGS else {}
            cases[fault_case(kind, schedule)] = RunConfig(
                **run, **BASE, **hanging, faults=(SPECS.get(kind, kind),)
            )
    return cases


class Runs:
    """Run directories by case name; a case's launch group is launched on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cases = {
            name: dataclasses.replace(case, out=str(root / name))
            for name, case in all_cases().items()
        }
        self.launched: dict[str, object] = {}

    def group_of(self, name: str) -> list[str]:
        case = self.cases[name]
        if any(f.ENDS_RUN for f in case.faults):
            return [name]
        return [
            n
            for n, c in self.cases.items()
            if c.world_size == case.world_size and not any(f.ENDS_RUN for f in c.faults)
        ]

    def path(self, name: str) -> Path:
        if name not in self.launched:
            from pipetrace.runtime.launch import launch

            group = self.group_of(name)
            result = launch([self.cases[n] for n in group], kill_grace=2.0)
            for n in group:
                self.launched[n] = result
        return Path(self.cases[name].out or "")

    def result(self, name: str):
        self.path(name)
        return self.launched[name]


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("diagnosis"))


def analyze_json(path: Path) -> dict:
    """`pipetrace analyze PATH --json`, as a user runs it."""
    from pipetrace.cli.analyze import analyze

    # as `pipetrace` runs it: outside standalone mode, the command returns the exit code
    result = CliRunner().invoke(
        analyze, [str(path), "--json", "--workers", "0"], standalone_mode=False
    )
    assert result.exception is None and result.return_value in (0, 1), result.output
    document = json.loads(result.output)
    assert (result.return_value == 1) == (document["counts"]["error"] > 0)
    return document
