"""Step time of a torch.distributed.pipelining schedule recorded by pipetrace vs the same
schedule unrecorded: 1F1B and Interleaved1F1B on 4 CPU ranks (gloo).

One invocation, one process group, one schedule object per class: after warm-up, iterations
alternate recorded / unrecorded (`Recording.suspend` / `resume` put torch's own code back in
between), so machine noise hits both alike. An iteration is timed on rank 0 between two
barriers and includes the SGD step; the CPU time of every rank (all its threads, the
recorder's included) is summed for the same iteration. The figures are the ratios of medians,
recorded / unrecorded (target <= 1.03).

    .venv/bin/python bench/bench_torch_pipelining.py
    .venv/bin/python bench/bench_torch_pipelining.py --iterations 40 --width 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

CLASSES = (("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2))
ARGS_ENV = "PIPETRACE_BENCH_TORCH_ARGS"


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from pipetrace.recorder.setup import RecordSettings
    from pipetrace.runtime.config import DemoConfig
    from pipetrace.runtime.demo import demo_batch
    from pipetrace.torch_pipelining import record
    from pipetrace.torch_pipelining.demo import SEED, TorchCase, build_schedule

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    for name, per_rank in CLASSES:
        case = TorchCase(
            schedule=name,
            run_dir=os.path.join(args.out, name),
            microbatches=args.microbatches,
            stages_per_rank=per_rank,
            width=args.width,
            microbatch_size=args.microbatch_size,
        )
        schedule = build_schedule(case, rank, world_size)
        stages = schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]
        first = any(stage.is_first for stage in stages)
        last = any(stage.is_last for stage in stages)
        optimizer = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=1e-3)
        demo = DemoConfig(
            width=args.width, blocks_per_stage=1, microbatch_size=case.microbatch_size
        )
        inputs, targets = demo_batch(0, args.microbatches * case.microbatch_size, demo, seed=SEED)
        times: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        recording = record(schedule, settings=RecordSettings(run_dir=case.run_dir))
        assert recording.active, "recording did not start"
        for index in range(args.warmup + 2 * args.iterations):
            recorded = index % 2 == 0
            (recording.resume if recorded else recording.suspend)()
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            schedule.step(*((inputs,) if first else ()), target=targets if last else None)
            optimizer.step()
            optimizer.zero_grad()
            used = torch.tensor([time.process_time() - start_cpu], dtype=torch.float64)
            dist.barrier()
            elapsed = time.perf_counter() - start
            dist.all_reduce(used)  # CPU time of every rank (all its threads), outside the timing
            if index >= args.warmup:
                times[recorded].append(elapsed)
                cpu[recorded].append(float(used))
        recording.resume()
        recording.close()
        if rank == 0:
            on, off = statistics.median(times[True]), statistics.median(times[False])
            cpu_on, cpu_off = statistics.median(cpu[True]), statistics.median(cpu[False])
            print(
                json.dumps(
                    {
                        "schedule": name,
                        "ranks": world_size,
                        "microbatches": args.microbatches,
                        "width": args.width,
                        "recorded_ms": round(on * 1e3, 3),
                        "unrecorded_ms": round(off * 1e3, 3),
                        "overhead_pct": round((on / off - 1) * 100, 2),
                        "cpu_recorded_ms": round(cpu_on * 1e3, 3),
                        "cpu_unrecorded_ms": round(cpu_off * 1e3, 3),
                        "cpu_overhead_pct": round((cpu_on / cpu_off - 1) * 100, 2),
                    }
                ),
                flush=True,
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=30, help="timed pairs")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--out", default=None, help="run directories (default: a temp dir)")
    if ARGS_ENV in os.environ:
        args = argparse.Namespace(**json.loads(os.environ[ARGS_ENV]))
        _rank_main(args)
        return
    args = parser.parse_args()
    args.out = args.out or tempfile.mkdtemp(prefix="bench-torch-pp-")
    from pipetrace.torch_pipelining.demo import launch_local_ranks

    codes = launch_local_ranks(
        [sys.executable, os.path.abspath(__file__)],
        args.ranks,
        env={ARGS_ENV: json.dumps(vars(args))},
        timeout=900,
    )
    if codes != [0] * args.ranks:
        sys.exit(f"ranks exited with {codes}")


if __name__ == "__main__":
    main()
