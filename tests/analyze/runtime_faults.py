"""Drive the real torch runtime (`pipetrace.runtime.launch`) with the real recorder, faults
injected as step functions (`tests.ranks`)."""

from __future__ import annotations

from pathlib import Path

from tests.ranks import Record


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
    kill_grace: float = 2.0,
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
        kill_grace=kill_grace,
    )


def run_many(run_dir: Path, configs: list[dict], *, ranks: int = 4):
    """One launch, several schedules; case n is recorded in ``run_dir/case-n``."""
    from pipetrace.runtime.config import RunConfig
    from pipetrace.runtime.launch import launch

    cases = [RunConfig(ranks=ranks, out=str(run_dir), timeout=30.0, **c) for c in configs]
    return launch(cases, make_recorder=Record(str(run_dir), several=True), kill_grace=2.0)
