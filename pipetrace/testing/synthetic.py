"""Synthetic run directories of any size: a clean fake cluster with a given cost model.

A built-in schedule is run by `pipetrace.testing.cluster.FakeCluster` (eager sends, per-kind
costs, optional jitter, slow stages and clock offsets) and recorded by real Recorders on
virtual time, so the logs are exactly what the recorder writes. Used by the benchmarks
(bench/bench_analyze.py writes 1024 ranks with a process pool) and by tests that need large
or deterministic runs. Composite steps are recorded without their sub-steps (fewer events).

    python -m pipetrace.testing.synthetic OUT_DIR --ranks 64 --microbatches 32 --iterations 4
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from pipetrace.schedule.ir import Plan
from pipetrace.testing.cluster import DEFAULT_COSTS_NS, Costs, FakeCluster


def write_synthetic_run(
    run_dir: str | Path,
    *,
    schedule: str = "1f1b",
    num_ranks: int = 4,
    num_microbatches: int = 8,
    stages_per_rank: int | None = None,
    iterations: int = 2,
    costs_ns: dict[str, int] | None = None,
    transfer_ns: int = 20_000,
    jitter: float = 0.0,
    slow_stages: dict[int, float] | None = None,
    clock_offsets_ns: list[int] | None = None,
    clock_errors_ns: list[int] | None = None,
    seed: int = 0,
    workers: int = 1,
) -> Plan:
    """Write meta.json and every rank's log into ``run_dir``; returns the plan.

    ``slow_stages`` multiplies a stage's compute costs (a straggler). ``clock_offsets_ns[r]``
    is rank r's true clock offset to rank 0, ``clock_errors_ns[r]`` the error of the offset it
    records (so that raw alignment can put a recv before its send).
    """
    cluster = FakeCluster.of(
        schedule,
        ranks=num_ranks,
        microbatches=num_microbatches,
        stages_per_rank=stages_per_rank,
        iterations=iterations,
        costs=Costs(
            compute_ns=dict(DEFAULT_COSTS_NS if costs_ns is None else costs_ns),
            transfer_ns=transfer_ns,
            jitter=jitter,
            slow_stages=slow_stages or {},
            seed=seed,
        ),
        clock_offsets_ns=clock_offsets_ns,
        clock_errors_ns=clock_errors_ns,
        substeps=False,
        config={
            "schedule": schedule,
            "num_microbatches": num_microbatches,
            "synthetic": True,
            "p2p": "plain",
            "seed": seed,
        },
    )
    return cluster.record(run_dir, workers=workers)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--stages-per-rank", type=int, default=None)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    write_synthetic_run(
        args.out,
        schedule=args.schedule,
        num_ranks=args.ranks,
        num_microbatches=args.microbatches,
        stages_per_rank=args.stages_per_rank,
        iterations=args.iterations,
        workers=args.workers,
    )
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
