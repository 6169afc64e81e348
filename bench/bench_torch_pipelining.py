"""Step time of a torch.distributed.pipelining schedule recorded by pipetrace vs the same
schedule unrecorded: 1F1B and Interleaved1F1B on 4 CPU ranks (gloo).

One invocation, one process group, one schedule object per class: after warm-up, iterations
alternate recorded / unrecorded (`Recording.suspend` / `resume` put torch's own code back in
between), so machine noise hits both alike. An iteration is timed on rank 0 between two
barriers and includes the SGD step; the CPU time of every rank (all its threads, the
recorder's included) is summed for the same iteration. The figures are the ratios of medians,
recorded / unrecorded (target <= 1.03), for the wall time, the CPU time of all threads and
that of the main threads alone (which is where the adapter's wrappers run).

    .venv/bin/python bench/bench_torch_pipelining.py
    .venv/bin/python bench/bench_torch_pipelining.py --iterations 40 --width 512
    .venv/bin/python bench/bench_torch_pipelining.py --aa   # both halves unrecorded
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

CLASSES = (("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2))
ARGS_ENV = "PIPETRACE_BENCH_TORCH_ARGS"


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from pipetrace.runtime.backend import Replicas
    from pipetrace.runtime.config import DemoConfig
    from pipetrace.runtime.demo import demo_batch
    from pipetrace.runtime.torch_backend import TorchBackend
    from pipetrace.torch_pipelining import record
    from pipetrace.torch_pipelining.demo import TorchCase, build_schedule
    from pipetrace.torch_pipelining.instrument import stages_of

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    replicas = Replicas(TorchBackend(torch.device("cpu")), rank)
    demo = DemoConfig(width=args.width, blocks_per_stage=1, microbatch_size=args.microbatch_size)
    for name, per_rank in CLASSES:
        case = TorchCase(
            schedule=name,
            run_dir=os.path.join(args.out, name),
            microbatches=args.microbatches,
            stages_per_rank=per_rank,
            demo=demo,
        )
        schedule = build_schedule(case, replicas, world_size)
        stages = stages_of(schedule)
        first = any(stage.is_first for stage in stages)
        last = any(stage.is_last for stage in stages)
        optimizer = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=1e-3)
        inputs, targets = demo_batch(
            0, args.microbatches * args.microbatch_size, demo, seed=case.seed
        )
        recording = record(schedule, settings=case.record_settings())
        assert recording.active, "recording did not start"
        batch = ((inputs,) if first else (), targets if last else None)
        samples = _alternate(schedule, optimizer, batch, recording, args)
        recording.resume()
        recording.close()
        if rank == 0:
            print(json.dumps(_summary(name, world_size, args, samples)), flush=True)
    dist.destroy_process_group()


Samples = dict[bool, dict[str, list[float]]]  # recorded? -> measure -> one value per iteration
MEASURES = ("wall", "cpu", "main_cpu")


def _alternate(
    schedule: Any,
    optimizer: Any,
    batch: tuple[tuple[Any, ...], Any],
    recording: Any,
    args: argparse.Namespace,
) -> Samples:
    """Time a step (``schedule.step(*inputs, target=target)`` with ``batch`` = (inputs,
    target), then SGD) alternately recorded and not: the wall time on this rank between
    barriers, and the CPU time summed over every rank, of all threads (``cpu``) and of the
    main thread alone (``main_cpu``: torch's loop, the adapter's wrappers and the recorder's
    hot path; the rest is the recorder's flush and watchdog threads)."""
    import torch
    import torch.distributed as dist

    samples: Samples = {mode: {m: [] for m in MEASURES} for mode in (True, False)}
    for index in range(args.warmup + 2 * args.iterations):
        recorded = index % 2 == 0  # with --aa, the half that would be: the noise floor
        (recording.resume if recorded and not args.aa else recording.suspend)()
        dist.barrier()
        start, start_cpu, start_main = time.perf_counter(), time.process_time(), time.thread_time()
        schedule.step(*batch[0], target=batch[1])
        optimizer.step()
        optimizer.zero_grad()
        used = torch.tensor(
            [time.process_time() - start_cpu, time.thread_time() - start_main],
            dtype=torch.float64,
        )
        dist.barrier()
        elapsed = time.perf_counter() - start
        dist.all_reduce(used)  # every rank's CPU time, outside the timing
        if index >= args.warmup:
            for measure, value in zip(MEASURES, (elapsed, *used.tolist())):
                samples[recorded][measure].append(value)
    return samples


def _summary(name: str, world_size: int, args: argparse.Namespace, samples: Samples) -> dict:
    """Medians of each measure, recorded and unrecorded, and their ratio as a percentage."""
    out: dict[str, Any] = {
        "schedule": name,
        "ranks": world_size,
        "microbatches": args.microbatches,
        "width": args.width,
    }
    for measure in MEASURES:
        on = statistics.median(samples[True][measure])
        off = statistics.median(samples[False][measure])
        out[f"{measure}_recorded_ms"] = round(on * 1e3, 3)
        out[f"{measure}_unrecorded_ms"] = round(off * 1e3, 3)
        out[f"{measure}_overhead_pct"] = round((on / off - 1) * 100, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=30, help="timed pairs")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument(
        "--aa", action="store_true", help="A/A: both halves unrecorded (the noise floor)"
    )
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
