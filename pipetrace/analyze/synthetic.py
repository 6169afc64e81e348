"""Synthetic run directories in the documented trace format, of any size, without a runtime.

A built-in schedule is lowered to steps with messages and timed by the shared executor
(`pipetrace.schedule.execution.execute`, eager sends) with per-kind costs; each rank's log is
then written line by line exactly as the recorder writes it (same header, same fields, same
key order, a shared id counter, per-(op, peer, channel) sequence numbers from 0 each
iteration, clock events with a per-rank offset). Used by bench/bench_analyze.py and by tests
that need large runs; fault tests drive the real Recorder instead.

    python -m pipetrace.analyze.synthetic OUT_DIR --ranks 64 --microbatches 32 --iterations 4
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import orjson

from pipetrace import __version__
from pipetrace.recorder import format as fmt
from pipetrace.recorder.recorder import write_meta
from pipetrace.schedule.builders import build_plan
from pipetrace.schedule.execution import compile_plan, execute
from pipetrace.schedule.ir import Plan, Step, StepKind, format_step, parse_step

DEFAULT_COSTS_NS = {"F": 1_000_000, "B": 2_000_000, "I": 1_000_000, "W": 1_000_000}
_T0 = 1_700_000_000_000_000_000


def _durations(
    plan: Plan, costs: dict[str, int], slow: dict[int, float], jitter: float, rng: random.Random
) -> list[list[float]]:
    out = []
    for row in plan.ranks:
        durations = []
        for step in row:
            if step is None:
                continue
            cost = 0.0
            for leaf in step.leaves():
                if leaf.kind.value in costs:
                    c = costs[leaf.kind.value] * slow.get(leaf.stage, 1.0)  # type: ignore[arg-type]
                    cost = max(cost, c * (1 + rng.uniform(-jitter, jitter)))
            durations.append(cost)
        out.append(durations)
    return out


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
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    plan = build_plan(
        schedule,
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        stages_per_rank=stages_per_rank,
        comms=True,
    )
    rng = random.Random(seed)
    costs = dict(DEFAULT_COSTS_NS if costs_ns is None else costs_ns)
    program = compile_plan(plan)
    timelines = []
    for _ in range(iterations if jitter else 1):
        outcome = execute(
            program,
            "eager",
            _durations(plan, costs, slow_stages or {}, jitter, rng),
            transfer=float(transfer_ns),
        )
        timelines.append((outcome.start, outcome.end))
    config = {
        "schedule": schedule,
        "num_microbatches": num_microbatches,
        "synthetic": True,
        "p2p": "plain",
        "seed": seed,
    }
    write_meta(
        run_dir,
        plan=plan,
        world_size=num_ranks,
        config=config,
        framework="synthetic",
        framework_version="0",
    )
    meta_path = run_dir / fmt.META_FILE
    meta = orjson.loads(meta_path.read_bytes())
    meta["created"] = _T0
    meta_path.write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2))
    offsets = clock_offsets_ns or [0] * num_ranks
    errors = clock_errors_ns or [0] * num_ranks
    period = max(max((e[-1] if e else 0.0) for e in ends) for _, ends in timelines) + 200_000
    jobs = [
        (
            str(run_dir),
            r,
            [format_step(x) for x in plan.steps(r)],
            plan.placement,
            plan.stages_of(r),
            [(starts[r], ends[r]) for starts, ends in timelines],
            period,
            iterations,
            config,
            offsets[r],
            errors[r],
            num_ranks,
        )
        for r in range(num_ranks)
    ]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(_write_rank, jobs, chunksize=max(1, len(jobs) // (4 * workers))))
    else:
        for job in jobs:
            _write_rank(job)
    return plan


def _write_rank(job: tuple) -> None:
    (
        run_dir,
        rank,
        texts,
        placement,
        stages,
        timelines,
        period,
        iterations,
        config,
        offset,
        error,
        world,
    ) = job
    steps: list[Step] = [parse_step(t) for t in texts]  # type: ignore[misc]
    dumps = orjson.dumps
    nl = orjson.OPT_APPEND_NEWLINE
    header = {
        "format": fmt.LOG_FORMAT,
        "schema_version": fmt.SCHEMA_VERSION,
        "rank": rank,
        "world_size": world,
        "pid": 1000 + rank,
        "host": socket.gethostname(),
        "pipetrace_version": __version__,
        "framework": "synthetic",
        "framework_version": "0",
        "record_mode": "steps",
        "t0": _T0 + offset,
    }
    out = bytearray(dumps(header, option=nl))
    t_base = _T0 + offset
    ids = 0
    out += dumps(
        {"e": fmt.RUN_START, "t": t_base, "config": config, "plan": texts, "stages": stages},
        option=nl,
    )
    if world > 1:
        out += dumps(
            {
                "e": fmt.CLOCK,
                "t": t_base + 1000,
                "phase": "start",
                "offset_ns": offset + error,
                "uncertainty_ns": 5_000,
                "reference_rank": 0,
            },
            option=nl,
        )
    comm = {
        StepKind.SEND_F: ("send", "F", 1),
        StepKind.SEND_B: ("send", "B", -1),
        StepKind.RECV_F: ("recv", "F", -1),
        StepKind.RECV_B: ("recv", "B", 1),
    }
    origin = 100_000
    with open(Path(run_dir) / fmt.rank_log_name(rank), "wb") as handle:
        for it in range(iterations):
            starts, ends = timelines[it % len(timelines)]
            base = t_base + origin + int(it * period)
            out += dumps({"e": fmt.ITER_BEGIN, "t": base, "it": it}, option=nl)
            seqs: dict[tuple[str, int, str], int] = {}
            last = base
            for pos, step in enumerate(steps):
                start = base + 10 + int(starts[pos])
                end = base + 10 + int(ends[pos])
                sid = ids
                ids += 1
                out += dumps(
                    {
                        "e": "step_begin",
                        "t": start,
                        "id": sid,
                        "it": it,
                        "pos": pos,
                        "step": texts[pos],
                        "th": "main",
                    },
                    option=nl,
                )
                info = comm.get(step.kind)
                if info is not None:
                    op, ch, direction = info
                    peer = placement[step.stage + direction]  # type: ignore[operator]
                    key = (op, peer, ch)
                    seq = seqs.get(key, 0)
                    seqs[key] = seq + 1
                    pid = ids
                    ids += 1
                    out += dumps(
                        {
                            "e": "p2p_post",
                            "t": start,
                            "id": pid,
                            "it": it,
                            "op": op,
                            "step": texts[pos],
                            "peer": peer,
                            "ch": ch,
                            "seq": seq,
                            "bytes": 4096,
                            "shape": [32, 32],
                            "dtype": "float32",
                        },
                        option=nl,
                    )
                    out += dumps({"e": "p2p_done", "t": end, "id": pid}, option=nl)
                out += dumps({"e": "step_end", "t": end, "id": sid}, option=nl)
                last = end
                if len(out) > 1 << 20:
                    handle.write(out)
                    out.clear()
            loss = 0.5 if rank == placement[-1] else None
            out += dumps({"e": fmt.ITER_END, "t": last + 20, "it": it, "loss": loss}, option=nl)
        end_t = last + 1000
        if world > 1:
            out += dumps(
                {
                    "e": fmt.CLOCK,
                    "t": end_t,
                    "phase": "end",
                    "offset_ns": offset + error,
                    "uncertainty_ns": 5_000,
                    "reference_rank": 0,
                },
                option=nl,
            )
        out += dumps({"e": fmt.RUN_END, "t": end_t + 10}, option=nl)
        handle.write(out)


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
