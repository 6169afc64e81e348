"""Step time of pipetrace's runtime vs torch.distributed.pipelining, same model, data, schedule.

Every rank builds both runtimes over separate copies of the same stage modules, warms both
up, then alternates timed iterations (ours, torch, ours, torch, ...) so that machine noise
hits both alike. An iteration is timed on rank 0 between two barriers and includes the SGD
step. The figure is the ratio of medians, pipetrace / torch (lower is better; targets, issue
17: plain <= 1.00, overlap <= 0.95). Ours runs in three variants: plain P2P (the default),
overlapped P2P, and plain with every recv posted at its own step ("at-steps": no recv
ahead, as before issue 17 and in runs with injected faults).

    .venv/bin/python bench/bench_runtime.py                      # 4 ranks, M=8, all pairs
    .venv/bin/python bench/bench_runtime.py --iterations 30 --schedules zbv
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from datetime import timedelta

# Our variants: key -> overlapped P2P. "at-steps" is plain mode with every recv posted at
# its own step (no recv ahead): the runtime before recvs were posted ahead, and what a run
# with injected faults does.
OURS = {"plain": False, "overlap": True, "at-steps": False}

# (ours, torch class, stages per rank)
PAIRS = {
    "1f1b": ("Schedule1F1B", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
    "zbv": ("ScheduleZBVZeroBubble", 2),
    "dualpipev": ("ScheduleDualPipeV", 2),  # ours runs each OVERLAP_F_B on two threads
}


def _rank_main(rank: int, args: argparse.Namespace, port: int, results: object) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining

    from pipetrace.runtime.api import PipelineRunner
    from pipetrace.runtime.config import DemoConfig
    from pipetrace.runtime.demo import build_demo_model, demo_batch, demo_loss
    from pipetrace.runtime.torch_backend import split_sequential
    from pipetrace.schedule.builders import build_plan

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=args.ranks, timeout=timedelta(seconds=120)
    )
    demo = DemoConfig(width=args.width, microbatch_size=args.microbatch_size)
    inputs, targets = demo_batch(0, args.microbatches * demo.microbatch_size, demo, seed=0)
    rows = []
    for name in args.schedules:
        torch_class, v = PAIRS[name]
        plan = build_plan(
            name,
            num_ranks=args.ranks,
            num_microbatches=args.microbatches,
            stages_per_rank=v,
            comms=True,
        )
        chunks = split_sequential(build_demo_model(plan.num_stages, demo, seed=0), plan.num_stages)
        mine = plan.stages_of(rank)
        variants = {}
        for key, overlap in OURS.items():
            ours = PipelineRunner(
                {s: copy.deepcopy(chunks[s]) for s in mine},
                schedule=plan,
                loss_fn=demo_loss,
                overlap_p2p=overlap,
            )
            if key == "at-steps":
                ours.executor.post_recvs_at_steps()
            variants[key] = (
                lambda runner=ours: runner.step(inputs, targets),
                torch.optim.SGD(ours.parameters(), lr=0.01),
            )
        torch_stages = [
            pipelining.PipelineStage(
                copy.deepcopy(chunks[s]), s, plan.num_stages, torch.device("cpu")
            )
            for s in mine
        ]
        schedule_class = getattr(pipelining, torch_class)
        schedule = schedule_class(
            torch_stages if v > 1 else torch_stages[0],
            n_microbatches=args.microbatches,
            loss_fn=demo_loss,
        )
        torch_params = [p for st in torch_stages for p in st.submod.parameters()]
        variants["torch"] = (
            lambda schedule=schedule: schedule.step(inputs, target=targets),
            torch.optim.SGD(torch_params, lr=0.01),
        )

        times: dict[str, list[float]] = {key: [] for key in variants}
        order = list(variants.items())
        for iteration in range(args.warmup + args.iterations):
            shift = iteration % len(order)  # each runtime goes first as often: no order bias
            for key, (step, optimizer) in order[shift:] + order[:shift]:
                dist.barrier()
                start = time.perf_counter()
                step()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                dist.barrier()
                if iteration >= args.warmup:
                    times[key].append(time.perf_counter() - start)
        rows.append((name, torch_class, {key: statistics.median(t) for key, t in times.items()}))
    if rank == 0:
        results.put(rows)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def dispatch_cost_ns(num_steps: int = 40_000) -> float:
    """The executor's own cost per step: a one-rank plan of F/B steps whose handlers do
    nothing, run with the default NullRecorder; the best of 5 runs (the machine is shared)."""
    import torch

    from pipetrace.runtime.executor import Executor
    from pipetrace.runtime.stage import PipelineStage
    from pipetrace.schedule.ir import B, F, Plan

    num_microbatches = num_steps // 2
    plan = Plan(
        num_microbatches,
        (0,),
        [[s for mb in range(num_microbatches) for s in (F(0, mb), B(0, mb))]],
    )
    stage = PipelineStage(
        torch.nn.Identity(), stage_index=0, num_stages=1, loss_fn=lambda out, target: out
    )
    executor = Executor(plan=plan, rank=0, stages={0: stage}, p2p=None)
    for kind in ("F", "B"):
        executor.register_custom_function(kind, lambda step, context: None)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        executor.run_iteration([], None)
        best = min(best, time.perf_counter() - start)
    return best / num_steps * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--microbatch-size", type=int, default=32)
    parser.add_argument("--schedules", nargs="+", choices=sorted(PAIRS), default=list(PAIRS))
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from pipetrace.runtime.launch import free_port

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(
        _rank_main, args=(args, free_port(), results), nprocs=args.ranks, start_method="spawn"
    )
    rows = results.get()
    print(
        f"{args.ranks} ranks, M={args.microbatches}, width {args.width}, "
        f"micro-batch {args.microbatch_size}, "
        f"{args.iterations} timed iterations (median step time, ms)"
    )
    print(
        f"{'schedule':18} {'torch class':26} {'torch':>8} {'plain':>8} {'overlap':>8} "
        f"{'at-steps':>8} {'plain/torch':>12} {'overlap/torch':>14} {'at-steps/torch':>15}"
    )
    for name, torch_class, medians in rows:
        t = medians["torch"]
        plain, over, at_steps = (medians[key] for key in OURS)
        print(
            f"{name:18} {torch_class:26} {t * 1e3:8.2f} {plain * 1e3:8.2f} {over * 1e3:8.2f} "
            f"{at_steps * 1e3:8.2f} {plain / t:12.3f} {over / t:14.3f} {at_steps / t:15.3f}"
        )
    print(f"executor dispatch per step (no-op handlers, NullRecorder): {dispatch_cost_ns():.0f} ns")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
