"""Recorder cost: per event on the hot path, and step-time overhead on the 4-rank demo.

    .venv/bin/python bench/bench_recorder.py [--events N] [--skip-demo] [--iterations N] [--aa]

Part 1 drives the real Recorder (writer thread running) through begin_step/end_step and
p2p_posted/p2p_completed, timing batches of 1,000 events; it prints the median and p95 cost
per event on the hot path, the all-in cost including encoding and writing, and the cost of the
same calls on NullRecorder as the in-process baseline.

Part 2 runs the 4-rank 1F1B demo once per rank, switching recording between off and
`steps` between timed iterations (ABBA), and prints the step-time and CPU ratios (recording
includes the memory samples); ``--aa`` runs it again with recording off on both sides, to
show the noise floor.

Part 3 prices the memory samples alone, in one process: a demo stage's forward + backward
with and without counting what autograd saves (alternating, ratio of medians), and the
Recorder's `memory_sample` per call (changed values, so each writes an event).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pipetrace.recorder.hooks import NullRecorder
from pipetrace.recorder.recorder import Recorder
from pipetrace.recorder.setup import RecordSettings
from pipetrace.schedule.builders import build_plan

BATCH = 1000


def drive(recorder, plan, events: int) -> list[float]:
    """Per-event cost (ns) of each batch of BATCH events: half steps, half P2P ops."""
    steps = plan.steps(0)
    per_event: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(events // BATCH):
        t0 = clock()
        for i in range(BATCH // 4):
            step = steps[i % len(steps)]
            token = recorder.begin_step(i, step)
            ticket = recorder.p2p_posted(
                op="send",
                step=step,
                peer=1,
                channel="F",
                seq=i,
                nbytes=4096,
                shape=(32, 32),
                dtype="float32",
            )
            recorder.p2p_completed(ticket)
            recorder.end_step(token)
        per_event.append((clock() - t0) / BATCH)
    return per_event


def hot_path(events: int) -> None:
    plan = build_plan("1f1b", num_ranks=4, num_microbatches=8, comms=True)
    baseline = drive(NullRecorder(), plan, events)
    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(RecordSettings(Path(tmp), stall_timeout=0))
        recorder.begin_run(rank=0, world_size=1, plan=plan, config={})
        recorder.begin_iteration(0)
        t0 = time.perf_counter_ns()
        costs = drive(recorder, plan, events)
        recorder.end_iteration(0, None)
        recorder.end_run()
        all_in = (time.perf_counter_ns() - t0) / events
        size = sum(p.stat().st_size for p in Path(tmp).glob("rank-*.ndjson"))
    q = statistics.quantiles(costs, n=20)
    print(
        f"hot path, {events} events: median {statistics.median(costs) / 1000:.2f} us/event, "
        f"p95 {q[-1] / 1000:.2f} us (target: median <= 2 us)"
    )
    print(
        f"all-in incl. background encoding + write: {all_in / 1000:.2f} us/event, "
        f"{size / events:.0f} bytes/event on disk"
    )
    print(f"NullRecorder baseline: median {statistics.median(baseline) / 1000:.3f} us/event")


def _forward_backward_ns(stage, x, rounds: int) -> float:
    """Median ns of one forward + backward of micro-batch 0 on ``stage``."""
    import torch

    times = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        out = stage.forward(0, x)
        stage.backward(0, torch.ones_like(out))
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times)


def memory_costs(rounds: int = 200, samples: int = 100_000) -> None:
    import torch

    from pipetrace.runtime.config import DemoConfig
    from pipetrace.runtime.demo import build_demo_model, demo_batch
    from pipetrace.runtime.stage import PipelineStage
    from pipetrace.runtime.torch_backend import split_sequential

    torch.set_num_threads(1)
    demo = DemoConfig()
    chunk = split_sequential(build_demo_model(4, demo, seed=0), 4)[1]
    stage = PipelineStage(chunk, stage_index=1, num_stages=4)
    x, _ = demo_batch(0, demo.microbatch_size, demo, seed=0)
    plain, counted = [], []
    for i in range(20):
        for count in (False, True) if i % 2 else (True, False):  # ABBA
            stage.count_saved = count
            (counted if count else plain).append(_forward_backward_ns(stage, x, rounds // 20))
    off, on = statistics.median(plain), statistics.median(counted)
    print(
        f"demo stage F+B (width {demo.width}, {demo.microbatch_size} rows): {off / 1000:.1f} us, "
        f"counting saved tensors {on / 1000:.1f} us: {on / off - 1:+.1%}"
    )
    plan = build_plan("1f1b", num_ranks=4, num_microbatches=8, comms=True)
    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(RecordSettings(Path(tmp), stall_timeout=0))
        recorder.begin_run(rank=0, world_size=1, plan=plan, config={})
        t0 = time.perf_counter_ns()
        for i in range(samples):
            recorder.memory_sample(i, [i * 4096], [4096], None)
        cost = (time.perf_counter_ns() - t0) / samples
        recorder.end_run()
    print(f"Recorder.memory_sample, a changed sample: {cost / 1000:.2f} us/call")


class Switch:
    """A recorder that is either the real one or `NullRecorder`, switched between iterations.

    One runner over one copy of the model, so both sides run the same modules, tensors and
    memory: two runners over deep copies differed by 3-5 % with recording off on both (an
    A/A run), more than the recording's own cost. Switching rebinds the hooks themselves
    (no delegating call): the executor and the P2P look them up on this object.
    """

    _HOOKS = (
        "begin_iteration",
        "end_iteration",
        "begin_step",
        "end_step",
        "p2p_posted",
        "p2p_enqueued",
        "p2p_completed",
        "exception",
        "memory_sample",
    )

    def __init__(self, recorder, record: bool) -> None:
        self.recorder = recorder
        self.null = NullRecorder()
        self.begin_run = recorder.begin_run
        self.end_run = recorder.end_run
        # Read once by the executor: it samples memory on both sides, and `use` turns the
        # stages' counting of saved tensors on and off with the recording.
        self.records_memory = recorder.records_memory
        self.stages: list = []
        self.use(record)

    def use(self, record: bool) -> None:
        target = self.recorder if record else self.null
        for name in self._HOOKS:
            setattr(self, name, getattr(target, name))
        for stage in self.stages:
            stage.count_saved = record


def _demo_rank(rank: int, iterations: int, port: int, results: object, sides: tuple) -> None:
    """Each rank runs the demo once, switching recording between timed iterations (ABBA,
    between barriers) so machine noise hits both sides alike. ``sides`` names what each side
    records: ``("off", "steps")``, or ``("off", "off")`` for an A/A run."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from pipetrace.recorder.setup import RecordSettings, torch_recorder
    from pipetrace.runtime.api import PipelineRunner
    from pipetrace.runtime.config import DemoConfig
    from pipetrace.runtime.demo import build_demo_model, demo_batch, demo_loss
    from pipetrace.runtime.torch_backend import split_sequential

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timedelta(seconds=120))
    plan = build_plan("1f1b", num_ranks=4, num_microbatches=8, comms=True)
    demo = DemoConfig()
    inputs, targets = demo_batch(0, 8 * demo.microbatch_size, demo, seed=0)
    chunks = split_sequential(build_demo_model(plan.num_stages, demo, seed=0), plan.num_stages)
    with tempfile.TemporaryDirectory() as tmp:
        switch = Switch(torch_recorder(RecordSettings(run_dir=tmp, mode="steps")), False)
        runner = PipelineRunner(
            {s: chunks[s] for s in plan.stages_of(rank)},
            schedule=plan,
            loss_fn=demo_loss,
            recorder=switch,
        )
        switch.stages = list(runner.stages.values())
        keys = [f"{i}:{side}" for i, side in enumerate(sides)]
        times: dict[str, list[float]] = {key: [] for key in keys}
        cpu: dict[str, list[float]] = {key: [] for key in keys}
        for iteration in range(5 + iterations):
            order = list(zip(keys, sides))
            for key, side in order if iteration % 2 else order[::-1]:  # ABBA: no order bias
                switch.use(side == "steps")
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                runner.step(inputs, targets)
                end_cpu = time.process_time()  # this rank's CPU, background threads included
                dist.barrier()
                if iteration >= 5:
                    times[key].append(time.perf_counter() - start)
                    cpu[key].append(end_cpu - start_cpu)
        switch.use(True)
        runner.close()
    results.put((rank, times, cpu))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def demo_overhead(iterations: int, sides: tuple[str, str]) -> None:
    import torch.multiprocessing as mp

    from pipetrace.runtime.launch import free_port

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(
        _demo_rank, args=(iterations, free_port(), results, sides), nprocs=4, start_method="spawn"
    )
    reports = sorted(results.get() for _ in range(4))
    a, b = reports[0][1]
    off, on = statistics.median(reports[0][1][a]), statistics.median(reports[0][1][b])
    label = f"{a.split(':')[1]} vs {b.split(':')[1]}"
    print(
        f"4-rank 1f1b demo (M=8), {iterations} alternating iterations, {label}: median step "
        f"time {off * 1e3:.2f} ms vs {on * 1e3:.2f} ms, {on / off - 1:+.1%} (target <= 1 %)"
    )
    cpu_off = sum(statistics.median(cpu[a]) for _, _, cpu in reports)
    cpu_on = sum(statistics.median(cpu[b]) for _, _, cpu in reports)
    print(
        f"CPU per step, all 4 ranks, {label}: {cpu_off * 1e3:.2f} ms vs {cpu_on * 1e3:.2f} ms, "
        f"{cpu_on / cpu_off - 1:+.1%} (target <= 2 %)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument(
        "--iterations", type=int, default=60, help="timed demo iterations per variant"
    )
    parser.add_argument(
        "--aa", action="store_true", help="also run the demo with recording off on both sides"
    )
    args = parser.parse_args()
    hot_path(args.events)
    memory_costs()
    if args.skip_demo:
        return
    demo_overhead(args.iterations, ("off", "steps"))
    if args.aa:
        demo_overhead(args.iterations, ("off", "off"))


if __name__ == "__main__":
    main()
