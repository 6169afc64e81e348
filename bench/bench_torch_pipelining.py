"""Step time of a torch.distributed.pipelining schedule recorded by pipetrace vs the same
schedule unrecorded: 1F1B and Interleaved1F1B on 4 CPU ranks (gloo), and the hooks' own
work per iteration replayed in one process.

Ranks: one invocation, one process group, one schedule object per class. After warm-up the
iterations run in three arms, recorded, unrecorded and unrecorded again (`Recording.suspend`
/ `resume` put torch's own code back in between), in blocks of ``--block`` iterations, the
arms in order then in reverse each round (R U U' U' U R ...), so that a drift of the load hits
every arm alike; the first iteration after a switch is dropped. An iteration is timed on
rank 0 between two barriers and includes the SGD step; the CPU time of every rank is summed
for the same iteration, of all threads and of the main threads alone. The figures are
medians: the overhead is recorded / unrecorded (target <= 1.03), the noise floor unrecorded
again / unrecorded (an A/A comparison in the same minutes: an overhead below it is not
shown).

Hooks: Schedule1F1B's iteration of a middle stage replayed against a fake stage
(`pipetrace.torch_pipelining.replay`), recorded and not, in the same arm order: microseconds
of main-thread CPU per iteration and per recorded event, free of the machine's noise.

    .venv/bin/python bench/bench_torch_pipelining.py
    .venv/bin/python bench/bench_torch_pipelining.py --rounds 20 --width 512
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


ARMS = ("recorded", "unrecorded", "unrecorded_again")
"""The third arm is the first again, unrecorded: its distance from it is the noise floor."""
MEASURES = ("wall", "cpu", "main_cpu")
Samples = dict[str, dict[str, list[float]]]  # arm -> measure -> one value per iteration


def arm_order(rounds: int, block: int) -> list[str]:
    """The arm of each timed iteration: blocks of ``block`` iterations, the arms in order
    then in reverse (R U U' U' U R ...), so that a drift of the machine's load hits every
    arm alike and each arm follows each other as often."""
    order: list[str] = []
    for index in range(rounds):
        arms = ARMS if index % 2 == 0 else ARMS[::-1]
        order += [arm for arm in arms for _ in range(block)]
    return order


def _alternate(
    schedule: Any,
    optimizer: Any,
    batch: tuple[tuple[Any, ...], Any],
    recording: Any,
    args: argparse.Namespace,
) -> Samples:
    """Time a step (``schedule.step(*inputs, target=target)`` with ``batch`` = (inputs,
    target), then SGD) in each arm: the wall time on this rank between barriers, and the
    CPU time summed over every rank, of all threads (``cpu``) and of the main thread alone
    (``main_cpu``: torch's loop, the adapter's wrappers and the recorder's hot path; the
    rest is gloo's and the recorder's flush and watchdog threads). The first iteration of a
    block, right after the switch, is not kept."""
    import torch
    import torch.distributed as dist

    samples: Samples = {arm: {m: [] for m in MEASURES} for arm in ARMS}
    order = ["unrecorded"] * args.warmup + arm_order(args.rounds, args.block)
    previous = None
    for index, arm in enumerate(order):
        (recording.resume if arm == "recorded" else recording.suspend)()
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
        if index >= args.warmup and arm == previous:
            for measure, value in zip(MEASURES, (elapsed, *used.tolist())):
                samples[arm][measure].append(value)
        previous = arm
    return samples


def _summary(name: str, world_size: int, args: argparse.Namespace, samples: Samples) -> dict:
    """Medians of each measure in each arm; the overhead (recorded against unrecorded) and
    the noise floor (unrecorded again against unrecorded) as percentages."""
    out: dict[str, Any] = {
        "schedule": name,
        "ranks": world_size,
        "microbatches": args.microbatches,
        "width": args.width,
        "samples_per_arm": len(samples["recorded"]["wall"]),
    }
    for measure in MEASURES:
        on, off, again = (statistics.median(samples[arm][measure]) for arm in ARMS)
        out[f"{measure}_recorded_ms"] = round(on * 1e3, 3)
        out[f"{measure}_unrecorded_ms"] = round(off * 1e3, 3)
        out[f"{measure}_overhead_pct"] = round((on / off - 1) * 100, 2)
        out[f"{measure}_noise_floor_pct"] = round((again / off - 1) * 100, 2)
    return out


def hook_cost(args: argparse.Namespace) -> dict:
    """The adapter's and the recorder's own work per iteration, apart from the machine's
    noise: Schedule1F1B's iteration of a middle stage (stage 1; every hook kind) replayed
    against a fake stage in this process (`pipetrace.torch_pipelining.replay`: no model, no
    peers), recorded and not, in the same arm order as the ranks; medians of main-thread
    CPU per iteration. The hooks run here from hot caches: in a run, between compute that
    evicts them, the same work costs several times more (docs/performance.md)."""
    from pipetrace.torch_pipelining import record
    from pipetrace.torch_pipelining.plan import plan_of
    from pipetrace.torch_pipelining.replay import FakeStage, fake_p2p, fake_schedule

    stage = FakeStage(1, args.ranks, (args.microbatch_size, args.width))
    schedule = fake_schedule("Schedule1F1B", stage, args.microbatches)
    steps = plan_of(schedule).steps(stage.group_rank)
    events = 2 + 2 * len(steps) + 2 * sum(step.is_comm for step in steps)  # one op a message
    samples: dict[str, list[float]] = {arm: [] for arm in ARMS}
    previous = None
    with fake_p2p(), record(schedule, os.path.join(args.out, "hooks")) as recording:
        for arm in arm_order(args.hook_rounds, args.block):
            (recording.resume if arm == "recorded" else recording.suspend)()
            start = time.thread_time()
            schedule.step()
            used = time.thread_time() - start
            if arm == previous:
                samples[arm].append(used)
            previous = arm
    on, off, again = (statistics.median(samples[arm]) for arm in ARMS)
    return {
        "figure": "hooks, replayed against a fake stage in one process",
        "schedule": "Schedule1F1B",
        "stage": stage.stage_index,
        "microbatches": args.microbatches,
        "events_per_iteration": events,
        "hooks_us_per_iteration": round((on - off) * 1e6, 1),
        "hooks_us_per_event": round((on - off) * 1e6 / events, 2),
        "noise_floor_us": round((again - off) * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=12, help="rounds of the three arms")
    parser.add_argument("--block", type=int, default=4, help="iterations per arm and round")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument(
        "--hook-rounds", type=int, default=200, help="rounds of the in-process hook replay"
    )
    parser.add_argument("--out", default=None, help="run directories (default: a temp dir)")
    if ARGS_ENV in os.environ:
        args = argparse.Namespace(**json.loads(os.environ[ARGS_ENV]))
        _rank_main(args)
        return
    args = parser.parse_args()
    args.out = args.out or tempfile.mkdtemp(prefix="bench-torch-pp-")
    print(json.dumps(hook_cost(args)), flush=True)
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
