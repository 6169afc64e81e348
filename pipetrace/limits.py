"""The sizes pipetrace accepts before it starts any work, in one place.

A size typed by hand (``-p 1000000``), inferred from a CSV (a micro-batch index of 10^9) or
read from a damaged ``meta.json`` (``world_size`` 10^9) must not make a command build
gigabytes or run for hours before failing. Each limit below says what it bounds and how to go
past it on purpose (an environment variable); the checks raise one-line `PipetraceError`s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipetrace.errors import PipetraceError
from pipetrace.settings import at_least, check_settings, read_environment, setting, whole_number

PLAN_STEPS_ENV = "PIPETRACE_MAX_PLAN_STEPS"
MAX_PLAN_STEPS = 8_000_000
"""Grid cells a plan may lay out: ranks x stages per rank x 3 (F, B, W) x (micro-batches +
ranks), the last term for the warm-up and cool-down bubbles of a deep pipeline. Measured: 1F1B
with P = M = 1000 (6M cells) takes ~45 s and ~1.7 GB to build, lower and verify on one core."""

BYTES_PER_PLAN_STEP = 512
"""Peak memory per grid cell of a plan built, lowered with its messages and verified (~280 B
measured, rounded up)."""

MAX_LINE_BYTES = 16 << 20
"""The longest line a rank log may hold (the header included); a longer one (a file of zero
bytes, a runaway write) is skipped as corrupt instead of being gathered in memory. The largest
events, stall dumps with every thread's stack, take tens of kilobytes."""

ABSENT_RANKS_ENV = "PIPETRACE_MAX_ABSENT_RANKS"
MAX_ABSENT_RANKS = 4096
"""Ranks a run directory may lack a log for: a ``world_size`` far beyond the logs present is
damage, and each absent rank still costs a timeline."""


def _optional_count(value: int | None) -> str | None:
    return None if value is None else at_least(1)(value)


@dataclass(frozen=True)
class LimitSettings:
    """The limits as the environment sets them (`read_environment`); unset: the defaults."""

    max_plan_steps: int | None = setting(
        None, _optional_count, env=PLAN_STEPS_ENV, parse=whole_number
    )
    """None: `MAX_PLAN_STEPS`, lowered to what a quarter of this machine's memory holds."""
    max_absent_ranks: int = setting(
        MAX_ABSENT_RANKS, at_least(1), env=ABSENT_RANKS_ENV, parse=whole_number
    )

    def __post_init__(self) -> None:
        check_settings(self)


def plan_step_limit() -> int:
    """The most grid cells a plan may lay out here (see `LimitSettings.max_plan_steps`)."""
    chosen = read_environment(LimitSettings).max_plan_steps
    if chosen is not None:
        return chosen
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on this platform: the fixed bound
        return MAX_PLAN_STEPS
    return min(MAX_PLAN_STEPS, memory // (4 * BYTES_PER_PLAN_STEP))


def check_plan_size(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> None:
    """Refuse a plan too big to build here, before any of it is built (the runtime's launcher
    calls this too)."""
    steps = num_ranks * stages_per_rank * 3 * (num_microbatches + num_ranks)
    limit = plan_step_limit()
    if steps > limit:
        raise PipetraceError(
            f"a plan of {num_ranks:,} ranks x {stages_per_rank:,} stages x "
            f"{num_microbatches:,} micro-batches lays out ~{steps:,} steps and bubbles, over the "
            f"{limit:,} this machine can build; set {PLAN_STEPS_ENV} to go past it"
        )


def check_world_size(world_size: int, logs_present: int, source: str) -> None:
    """Refuse a run whose world size is far beyond the rank logs it holds (damage, or the
    wrong directory) before a timeline is made for each absent rank."""
    limit = read_environment(LimitSettings).max_absent_ranks
    if world_size - logs_present > limit:
        raise PipetraceError(
            f"{source}: world_size {world_size:,} but only {logs_present:,} rank logs are "
            f"present (at most {limit:,} may be absent); set {ABSENT_RANKS_ENV} to go past it"
        )
