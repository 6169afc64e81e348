"""The small parity-checked runs that the multi-process tests launch by the dozen.

One definition of "a short run of this schedule checked against a single-process reference",
so that the tests of every schedule, of swap and overlapped pairs, and of tied weights differ
only in the options they are about.
"""

from __future__ import annotations

from typing import Any

from pipetrace.runtime.config import RunConfig


def parity_case(
    schedule: str, ranks: int, stages_per_rank: int | None = None, *, steps: int = 2, **options: Any
) -> RunConfig:
    """``schedule`` on ``ranks`` ranks with two micro-batches per rank, gradients compared
    with a single-process run after step 1; ``options`` are further `RunConfig` fields."""
    return RunConfig(
        schedule=schedule,
        ranks=ranks,
        microbatches=2 * ranks,
        stages_per_rank=stages_per_rank,
        steps=steps,
        check_parity=True,
        timeout=60,
        **options,
    )
