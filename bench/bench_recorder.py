"""Recorder cost: per event on the hot path, and step-time overhead on the 4-rank demo.

    .venv/bin/python bench/bench_recorder.py [--events N] [--skip-demo] [--rounds N] [--parts]
    .venv/bin/python bench/bench_recorder.py --baseline 6a2ddca --skip-demo   # hot path only

Part 1 drives the real Recorder (writer thread running) through begin_step/end_step and
p2p_posted/p2p_completed, timing batches of 1,000 events; it prints the median and p95 cost
per event on the hot path, the all-in cost including encoding and writing, and the cost of the
same calls on NullRecorder as the in-process baseline. ``--baseline REV`` runs part 1 in child
processes with this tree and with REV's pipetrace alternately (A B B A per round) and prints
the ratio of their medians.

Part 2 runs the 4-rank 1F1B demo once per rank, one runner whose recorder is switched between
three sides: ``off``, ``off'`` (off again: the A/A noise floor, measured in the same minutes
as the A/B figure) and ``steps`` (recording, memory samples included). The run is a series of
short blocks of ``--block-steps`` iterations, ordered in rounds of A A' B B A' A (rotated each
round, so every side takes every position alike); each round gives one ratio per side against
``off``, so a drift of the machine's load cancels within it. It prints the median ratio over
the rounds with its interquartile range and standard error, for the job's wall time per block
(first rank's start to last rank's end, one host's monotonic clock) and for the CPU time of
all 4 processes (every thread, the writer's encoding included: each block ends with a flush),
and where the CPU went: training thread (and of it the block's closing flush: the block's
events encoded and written, one write every block where a run writes every 0.1 s), writer
thread, the rest (gloo, watchdog), and the time spent in garbage collections on each side.
``--parts`` adds sides that record with some hooks left to `NullRecorder`: ``no-memory`` (no
memory samples, so the stages do not count what they save either), ``steps-only`` (no
memory samples and no P2P events) and ``counting`` (nothing recorded, but the runtime counts
what a memory sample reads: the stages' saved bytes, the mailboxes' bytes): what each part
of the recording costs in the same rounds. With ``--block-steps`` above 1 it also prints each
measure without each block's first iteration (the one after a switch, which pays for turning
recording and counting on or off and for the other side's code leaving the caches: a run
recording every iteration pays that once), and the training threads' first and later
iterations per side.

Part 3 prices the memory samples alone, in one process: a demo stage's forward + backward
with and without counting what autograd saves (alternating, ratio of medians), and the
Recorder's `memory_sample` per call (changed values, so each writes an event).

Part 4 prices an event where a run pays for it: after other work that left the caches cold
(the demo stage's forward + backward, a sweep over memory, small numpy calls), recorded
against NullRecorder in one thread, alternating. The hot-path loop of part 1 runs warm.
It then times single calls after the demo stage's forward + backward, one kind of call
after each, in turn: the step hooks of `NullRecorder` and of the recorder (with and without
the memory sample, and the executor's one `next_step` for all three), a P2P op on each, and
the stage's and executor's counting (a tensor's ``nbytes``, the saved-bytes lookup).

Part 5 is the demo's recording in one process, where a load on the machine hits both sides
alike: one rank holding the demo's four stages (interleaved-1f1b, M=8: 64 steps, their
hand-offs local), iterations recorded (`steps`), unrecorded (`off`) and unrecorded again
(`off'`, the A/A floor) in rounds of A A' B B A' A, the training thread's CPU per iteration;
and where the recorded iteration's end goes (its flush: encoding and the write).
``--inprocess-rounds 0`` skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pipetrace.recorder.hooks import NullRecorder
from pipetrace.recorder.recorder import Recorder
from pipetrace.recorder.setup import RecordSettings
from pipetrace.schedule.builders import build_plan

BATCH = 1000
DEMO_SIDES = ("off", "off'", "steps")  # A, A' (the noise floor), B
MEMORY_HOOKS = ("memory_sample", "memory_watch", "records_memory")
PART_SIDES = {  # --parts: recording with some hooks left to NullRecorder, to price each part
    "no-memory": MEMORY_HOOKS,
    "steps-only": (*MEMORY_HOOKS, "p2p_posted", "p2p_enqueued", "p2p_completed"),
}
COUNTING = "counting"  # --parts: records nothing, but the runtime counts what a sample reads
WRITER_THREAD = "pipetrace-flush"  # the EventWriter's thread, whose CPU is priced apart


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


def measure_hot_path(events: int) -> dict[str, float]:
    """Hot-path median and p95, all-in and NullRecorder cost per event (µs), bytes/event."""
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
    return {
        "median": statistics.median(costs) / 1000,
        "p95": statistics.quantiles(costs, n=20)[-1] / 1000,
        "all_in": all_in / 1000,
        "null": statistics.median(baseline) / 1000,
        "bytes": size / events,
    }


def hot_path(events: int) -> None:
    m = measure_hot_path(events)
    print(
        f"hot path, {events} events: median {m['median']:.2f} us/event, "
        f"p95 {m['p95']:.2f} us (target: median <= 2 us)"
    )
    print(
        f"all-in incl. background encoding + write: {m['all_in']:.2f} us/event, "
        f"{m['bytes']:.0f} bytes/event on disk"
    )
    print(f"NullRecorder baseline: median {m['null']:.3f} us/event")


def hot_path_against(revision: str, events: int, rounds: int) -> None:
    """Part 1 in child processes, this tree and ``revision`` alternating A B B A per round;
    the median over the children of each figure, and this tree's over the baseline's."""
    from baseline import ROOT, checkout

    sides = {"this tree": ROOT, f"baseline {revision}": checkout(revision)}
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    load_before = os.getloadavg()[0]
    try:
        for round_ in range(rounds):
            order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
            for side in order + order[::-1]:
                env = {**os.environ, "PYTHONPATH": str(sides[side])}
                command = [sys.executable, __file__, "--hot-path-json", f"--events={events}"]
                out = subprocess.run(command, env=env, check=True, capture_output=True).stdout
                runs[side].append(json.loads(out))
    finally:
        shutil.rmtree(sides[f"baseline {revision}"], ignore_errors=True)
    print(
        f"hot path, {events} events per child, {rounds} rounds A B B A "
        f"(load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after)"
    )
    medians = {
        side: {key: statistics.median(m[key] for m in measured) for key in measured[0]}
        for side, measured in runs.items()
    }
    ours, theirs = medians.values()
    for key, label in (("median", "hot path median"), ("all_in", "all-in"), ("null", "null")):
        print(
            f"  {label:<16} this tree {ours[key]:.3f} us, baseline {theirs[key]:.3f} us, "
            f"ratio {ours[key] / theirs[key]:.3f}"
        )


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


def _demo_stage():
    """The demo's second stage (of 4), its micro-batch input and the demo's settings."""
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
    return stage, x, demo


def memory_costs(rounds: int = 200, samples: int = 100_000) -> None:
    stage, x, demo = _demo_stage()
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


def _between_work(recorder, plan, work, iterations: int) -> float:
    """Main-thread CPU ns per iteration of 8 units of ``work``, each followed by a step and
    a P2P op (4 events), the iteration's flush included."""
    steps = plan.steps(0)
    recorder.begin_iteration(0)
    t0 = time.thread_time_ns()
    for _ in range(iterations):
        for i in range(8):
            work(i)
            step = steps[i % len(steps)]
            token = recorder.begin_step(i, step)
            ticket = recorder.p2p_posted(
                op="send",
                step=step,
                peer=1,
                channel="F",
                seq=i,
                nbytes=4096,
                shape=(32, 128),
                dtype="float32",
            )
            recorder.p2p_completed(ticket)
            recorder.end_step(token)
    recorder.end_iteration(0, None)
    return (time.thread_time_ns() - t0) / iterations


def between_work_costs(rounds: int = 400) -> None:
    """The recorder's cost per event when other work runs between events, as in a run:
    the demo stage's forward + backward, a sweep over 16 MB (evicts the caches, little
    code), a loop of small numpy calls (interpreter work, little data), and nothing (the
    hot-path loop's warm caches). Recorded vs `NullRecorder`, alternating (A B B A)."""
    import numpy as np
    import torch

    stage, x, _ = _demo_stage()
    big, small = np.ones(2_000_000), np.ones(1000)

    def forward_backward(mb: int) -> None:
        out = stage.forward(mb, x)
        stage.backward(mb, torch.ones_like(out))

    def small_calls(_: int) -> None:
        for _ in range(200):
            small.sum()

    works = {
        "demo stage F+B": forward_backward,
        "16 MB sweep": lambda _: big.sum(),
        "small numpy calls": small_calls,
        "nothing": lambda _: None,
    }
    plan = build_plan("1f1b", num_ranks=4, num_microbatches=8, comms=True)
    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(RecordSettings(Path(tmp), stall_timeout=0))
        recorder.begin_run(rank=0, world_size=1, plan=plan, config={})
        sides = (recorder, NullRecorder())
        for name, work in works.items():
            cost: dict[int, list[float]] = {0: [], 1: []}
            for r in range(rounds):
                for side in (0, 1) if r % 2 else (1, 0):
                    cost[side].append(_between_work(sides[side], plan, work, 5))
            extra = statistics.median(a - b for a, b in zip(cost[0], cost[1])) / 32
            print(
                f"  between events: {name:<18} {statistics.median(cost[1]) / 1000:7.1f} us "
                f"per 8 units; recording {extra / 1000:.2f} us per event"
            )
        recorder.end_run()


def cold_call_costs(rounds: int = 400) -> None:
    """Part 4's single calls (see the module's docstring): median ns of each, timed with
    two clock reads around it after the demo stage's forward + backward."""
    import torch

    stage, x, _ = _demo_stage()
    plan = build_plan("1f1b", num_ranks=4, num_microbatches=8, comms=True)
    steps = plan.steps(0)
    post = dict(peer=1, channel="F", nbytes=4096, shape=(32, 128), dtype="float32", stream=None)
    saved = {(x.shape, x.dtype): 1}
    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(RecordSettings(Path(tmp), stall_timeout=0))
        recorder.begin_run(rank=0, world_size=1, plan=plan, config={})
        recorder.begin_iteration(0)
        null = NullRecorder()
        sample = recorder.memory_watch([{0: 4096}], [0], [0])
        token = recorder.begin_step(0, steps[0])

        def next_step(step) -> None:
            nonlocal token
            token = recorder.next_step(token, True, 0, step)

        def step_pair(hooks, step, then=None) -> None:
            ended = hooks.begin_step(0, step)
            hooks.end_step(ended)
            if then is not None:
                then(ended)

        def p2p(hooks, step) -> None:
            hooks.p2p_completed(hooks.p2p_posted(op="send", step=step, seq=0, **post))

        calls = {
            "two clock reads (the floor)": lambda step: None,
            "NullRecorder begin_step + end_step": lambda step: step_pair(null, step),
            "begin_step + end_step": lambda step: step_pair(recorder, step),
            "begin_step + end_step + memory sample": lambda step: step_pair(recorder, step, sample),
            "next_step (the three at once)": next_step,
            "NullRecorder p2p_posted + p2p_completed": lambda step: p2p(null, step),
            "p2p_posted + p2p_completed": lambda step: p2p(recorder, step),
            "a tensor's nbytes": lambda step: x.nbytes,
            "saved bytes lookup (shape, dtype)": lambda step: saved.get((x.shape, x.dtype)),
        }
        times: dict[str, list[int]] = {name: [] for name in calls}
        clock = time.perf_counter_ns
        for r in range(rounds * len(calls)):
            out = stage.forward(0, x)
            stage.backward(0, torch.ones_like(out))
            name = list(calls)[r % len(calls)]
            step = steps[r % len(steps)]
            t0 = clock()
            calls[name](step)
            times[name].append(clock() - t0)
            if r % 200 == 199:
                recorder.flush()
        recorder.end_run()
    print("  single calls after the demo stage's forward + backward, median:")
    for name, values in times.items():
        print(f"    {name:<42} {statistics.median(values):6.0f} ns")


class Switch:
    """A recorder that is either the real one or `NullRecorder`, switched between iterations.

    One runner over one copy of the model, so both sides run the same modules, tensors and
    memory: two runners over deep copies differed by 3-5 % with recording off on both (an
    A/A run), more than the recording's own cost. Switching rebinds the hooks themselves
    (no delegating call): the executor and the P2P look them up on this object, and the
    executor asks `records_memory` at each iteration, so the off side neither samples memory
    nor counts saved tensors.
    """

    _HOOKS = (
        "begin_iteration",
        "end_iteration",
        "begin_step",
        "end_step",
        "next_step",
        "p2p_posted",
        "p2p_enqueued",
        "p2p_completed",
        "exception",
        "memory_sample",
        "memory_watch",
        "records_memory",
    )

    def __init__(self, recorder, side: str) -> None:
        self.recorder = recorder
        self.null = NullRecorder()
        self.begin_run = recorder.begin_run
        self.end_run = recorder.end_run
        self.use(side)

    def use(self, side: str) -> None:
        """``side``: "steps" records, a `PART_SIDES` side records but for its hooks, any
        other side ("off", "off'", `COUNTING`) records nothing."""
        recorded, left_off = side == "steps" or side in PART_SIDES, PART_SIDES.get(side, ())
        for name in self._HOOKS:
            target = self.recorder if recorded and name not in left_off else self.null
            setattr(self, name, getattr(target, name, None))  # NullRecorder: no memory_watch
        if side == COUNTING:  # the executor and stages count, the sample does nothing
            self.records_memory = True
            self.memory_watch = lambda *counts: _no_sample


def _no_sample(token) -> None:
    pass


@dataclass(frozen=True)
class Block:
    """One rank's measures of one block of iterations on one side."""

    side: str
    start: float  # perf_counter (CLOCK_MONOTONIC: one clock for every process of the host)
    end: float
    cpu: float  # the process's CPU seconds, every thread
    main: float  # the training thread's
    writer: float  # the recorder's writer thread's
    gc: float  # seconds in garbage collections (any thread), part of the above
    flush: float  # the training thread's in the block's closing flush (encode + write)
    first_end: float  # perf_counter at the end of the block's first iteration
    first_cpu: float  # the process's CPU seconds in the first iteration
    first_main: float  # the training thread's in the first iteration


class GcTime:
    """Seconds this process spends in garbage collections, summed by `gc.callbacks`.

    Which side of an alternating comparison a collection lands on depends on where the
    process's count of live container objects crosses the collector's threshold, not only
    on what each side allocates; this shows where it landed."""

    def __init__(self) -> None:
        import gc

        self.total = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start


def block_order(sides: Sequence[str], rounds: int) -> list[str]:
    """Round r runs the sides rotated by r, then backwards (A A' B B A' A, A' B A A B A', ...):
    a side's two blocks in a round are centred on its middle, so a steady drift of the load
    cancels in the round's ratios, and every side takes every position equally often."""
    order: list[str] = []
    for round_ in range(rounds):
        k = round_ % len(sides)
        rotated = [*sides[k:], *sides[:k]]
        order += rotated + rotated[::-1]
    return order


def _thread_cpu(name: str) -> float:
    """CPU seconds of this process's thread called ``name`` (0 when there is none)."""
    import threading

    for thread in threading.enumerate():
        if thread.name == name and thread.ident is not None:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return 0.0


def _run_blocks(runner, switch, batch, order: list[str], block_steps: int) -> list[Block]:
    """Every block of ``order``, between barriers; the writer is flushed before a block's
    CPU is read, so the encoding of its events is counted in it, not in the next block."""
    import torch.distributed as dist

    blocks = []
    gc_time = GcTime()
    for side in order:
        switch.use(side)
        dist.barrier()
        start, cpu, main, writer, gc = (
            time.perf_counter(),
            time.process_time(),
            time.thread_time(),
            _thread_cpu(WRITER_THREAD),
            gc_time.total,
        )
        runner.step(*batch)
        first_end, first_cpu, first_main = (
            time.perf_counter(),
            time.process_time() - cpu,
            time.thread_time() - main,
        )
        for _ in range(block_steps - 1):
            runner.step(*batch)
        end = time.perf_counter()
        dist.barrier()
        before_flush = time.thread_time()
        switch.recorder.flush()
        flush = time.thread_time() - before_flush
        blocks.append(
            Block(
                side,
                start,
                end,
                time.process_time() - cpu,
                time.thread_time() - main,
                _thread_cpu(WRITER_THREAD) - writer,
                gc_time.total - gc,
                flush,
                first_end,
                first_cpu,
                first_main,
            )
        )
    return blocks


def _demo_rank(rank: int, order: list[str], block_steps: int, port: int, results) -> None:
    """One rank of the demo, recorded or not block by block as ``order`` says."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from pipetrace.recorder.setup import torch_recorder
    from pipetrace.runtime.api import PipelineRunner
    from pipetrace.runtime.config import DemoConfig
    from pipetrace.runtime.demo import build_demo_model, demo_batch, demo_loss
    from pipetrace.runtime.torch_backend import split_sequential

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timedelta(seconds=120))
    plan = build_plan("1f1b", num_ranks=4, num_microbatches=8, comms=True)
    demo = DemoConfig()
    batch = demo_batch(0, 8 * demo.microbatch_size, demo, seed=0)
    chunks = split_sequential(build_demo_model(plan.num_stages, demo, seed=0), plan.num_stages)
    with tempfile.TemporaryDirectory() as tmp:
        switch = Switch(torch_recorder(RecordSettings(run_dir=tmp, mode="steps")), "off")
        runner = PipelineRunner(
            {s: chunks[s] for s in plan.stages_of(rank)},
            schedule=plan,
            loss_fn=demo_loss,
            recorder=switch,
        )
        blocks = _run_blocks(runner, switch, batch, order, block_steps)
        switch.use("steps")
        runner.close()
    results.put((rank, [asdict(b) for b in blocks]))
    dist.destroy_process_group()


@dataclass(frozen=True)
class JobBlock:
    """One block over the 4 ranks: the job's wall time and the CPU of every process."""

    side: str
    wall: float
    cpu: float
    main: float
    writer: float
    gc: float
    flush: float
    first_wall: float  # the block's first iteration (its ranks' first start to last end)
    first_cpu: float
    first_main: float

    @property
    def threads(self) -> float:
        """CPU of the threads recording runs on (training + writer): steadier than the
        process's, whose gloo threads' CPU moves with the load."""
        return self.main + self.writer

    # The block less its first iteration: the one after a switch, which pays for turning
    # recording (and counting) on or off and for the other side's code leaving the caches,
    # what a run recording every iteration pays once. The closing flush stays in.
    @property
    def later_wall(self) -> float:
        return self.wall - self.first_wall

    @property
    def later_cpu(self) -> float:
        return self.cpu - self.first_cpu

    @property
    def later_threads(self) -> float:
        return self.threads - self.first_main


def _job_blocks(per_rank: list[list[dict]]) -> list[JobBlock]:
    blocks = []
    for parts in zip(*per_rank):
        blocks.append(
            JobBlock(
                parts[0]["side"],
                max(p["end"] for p in parts) - min(p["start"] for p in parts),
                sum(p["cpu"] for p in parts),
                sum(p["main"] for p in parts),
                sum(p["writer"] for p in parts),
                sum(p["gc"] for p in parts),
                sum(p["flush"] for p in parts),
                max(p["first_end"] for p in parts) - min(p["start"] for p in parts),
                sum(p["first_cpu"] for p in parts),
                sum(p["first_main"] for p in parts),
            )
        )
    return blocks


def _round_ratios(
    blocks: list[JobBlock], measure: str, sides: Sequence[str]
) -> dict[str, list[float]]:
    """Per round, each side's total ``measure`` over ``off``'s: one ratio per round."""
    size = 2 * len(sides)
    ratios: dict[str, list[float]] = {side: [] for side in sides[1:]}
    for first in range(0, len(blocks) - size + 1, size):
        totals = dict.fromkeys(sides, 0.0)
        for block in blocks[first : first + size]:
            totals[block.side] += getattr(block, measure)
        for side in ratios:
            ratios[side].append(totals[side] / totals["off"])
    return ratios


def _summary(ratios: list[float]) -> str:
    """Median overhead, its standard error (from the IQR, as for a normal spread) and IQR."""
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    error = 1.2533 * (q3 - q1) / 1.349 / len(ratios) ** 0.5
    return f"{median - 1:+.1%} ±{error:.1%} (IQR {q1 - 1:+.1%} .. {q3 - 1:+.1%})"


def _print_demo(blocks: list[JobBlock], block_steps: int, sides: Sequence[str]) -> None:
    rounds = len(blocks) // (2 * len(sides))
    print(
        f"4-rank 1f1b demo (M=8), {rounds} rounds of {' '.join(sides)} and back, "
        f"{block_steps} iterations per block; median over rounds of each side / off, "
        f"± its standard error"
    )
    measures = [
        ("wall", "job wall time", 1),
        ("cpu", "CPU, 4 ranks", 2),
        ("threads", "main + writer", 2),
    ]
    if block_steps > 1:  # the same without each block's first iteration
        measures += [
            ("later_wall", "wall, 2nd on", 1),
            ("later_cpu", "CPU, 2nd on", 2),
            ("later_threads", "main, 2nd on", 2),
        ]
    for measure, label, target in measures:
        ratios = _round_ratios(blocks, measure, sides)
        floor, recorded = _summary(ratios[sides[1]]), _summary(ratios["steps"])
        print(f"  {label:<14} off' (A/A): {floor}")
        print(f"  {'':<14} steps (A/B): {recorded} (target <= {target} %)")
        for side in sides[3:]:  # --parts
            print(f"  {'':<14} {side}: {_summary(ratios[side])}")
    print("  per iteration, median over blocks (ms): wall / CPU = training thread + writer + rest")
    for side in sides:
        mine = [b for b in blocks if b.side == side]

        def ms(values, mine=mine) -> float:
            return statistics.median(values(b) for b in mine) * 1e3 / block_steps

        print(
            f"  {side:<10} {ms(lambda b: b.wall):6.2f} / {ms(lambda b: b.cpu):6.2f} = "
            f"{ms(lambda b: b.main):6.2f} + {ms(lambda b: b.writer):5.3f} + "
            f"{ms(lambda b: b.cpu - b.main - b.writer):5.2f}; "
            f"of the training thread's, the block's closing flush {ms(lambda b: b.flush):5.3f}"
        )
    if block_steps > 1:
        print("  training threads per iteration, median over blocks (ms): first, the others")
        for side in sides:
            mine = [b for b in blocks if b.side == side]
            first = statistics.median(b.first_main for b in mine) * 1e3
            later = statistics.median(b.later_threads for b in mine) * 1e3 / (block_steps - 1)
            print(f"  {side:<10} {first:6.2f}, {later:6.2f}")
    print("  garbage collections (4 ranks), mean ms per iteration and share of blocks with one:")
    for side in sides:
        gcs = [b.gc for b in blocks if b.side == side]
        with_gc = sum(1 for g in gcs if g > 0) / len(gcs)
        print(f"  {side:<10} {statistics.mean(gcs) * 1e3 / block_steps:6.3f} ms, {with_gc:.0%}")


def demo_overhead(
    rounds: int, block_steps: int, sides: Sequence[str] = DEMO_SIDES, warmup_rounds: int = 1
) -> None:
    import torch.multiprocessing as mp

    from pipetrace.runtime.launch import free_port

    order = block_order(sides, warmup_rounds + rounds)
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    load_before = os.getloadavg()[0]
    ranks = mp.start_processes(
        _demo_rank,
        args=(order, block_steps, free_port(), results),
        nprocs=4,
        join=False,
        start_method="spawn",
    )
    # Read before joining: a rank's results can outgrow the pipe's buffer, and its put
    # blocks until the parent reads.
    per_rank = [blocks for _, blocks in sorted(results.get() for _ in range(4))]
    while not ranks.join():
        pass
    print(f"load average {load_before:.2f} before the demo, {os.getloadavg()[0]:.2f} after")
    warmup = warmup_rounds * 2 * len(sides)
    _print_demo(_job_blocks(per_rank)[warmup:], block_steps, sides)


def _one_rank_demo(port: int):
    """A runner of the demo's four stages on one rank (a gloo group of one) behind a
    `Switch`, with the demo's batch, in a temporary run directory (the caller removes it)."""
    import torch
    import torch.distributed as dist

    from pipetrace.recorder.setup import torch_recorder
    from pipetrace.runtime.api import PipelineRunner
    from pipetrace.runtime.config import DemoConfig
    from pipetrace.runtime.demo import build_demo_model, demo_batch, demo_loss
    from pipetrace.runtime.torch_backend import split_sequential

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    plan = build_plan(
        "interleaved-1f1b", num_ranks=1, num_microbatches=8, stages_per_rank=4, comms=True
    )
    demo = DemoConfig()
    batch = demo_batch(0, 8 * demo.microbatch_size, demo, seed=0)
    chunks = split_sequential(build_demo_model(plan.num_stages, demo, seed=0), plan.num_stages)
    tmp = tempfile.mkdtemp(prefix="pipetrace-bench-")
    switch = Switch(torch_recorder(RecordSettings(run_dir=tmp, mode="steps")), "off")
    runner = PipelineRunner(
        dict(enumerate(chunks)), schedule=plan, loss_fn=demo_loss, recorder=switch
    )
    return runner, switch, batch, tmp


def inprocess_overhead(rounds: int, warmup_rounds: int = 5) -> None:
    """Part 5 (see the module's docstring)."""
    import torch.distributed as dist

    from pipetrace.runtime.launch import free_port

    runner, switch, batch, tmp = _one_rank_demo(free_port())
    cpu: dict[str, list[int]] = {side: [] for side in DEMO_SIDES}
    ends: list[int] = []
    end_iteration = switch.recorder.end_iteration

    def timed_end(iteration: int, loss: float | None) -> None:
        t0 = time.thread_time_ns()
        end_iteration(iteration, loss)
        ends.append(time.thread_time_ns() - t0)

    load_before = os.getloadavg()[0]
    try:
        for index, side in enumerate(block_order(DEMO_SIDES, warmup_rounds + rounds)):
            switch.use(side)
            if side == "steps":
                switch.end_iteration = timed_end
            t0 = time.thread_time_ns()
            runner.step(*batch)
            if index >= warmup_rounds * 2 * len(DEMO_SIDES):
                cpu[side].append(time.thread_time_ns() - t0)
        switch.use("steps")
        runner.close()
    finally:
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)
    off = statistics.median(cpu["off"])
    print(
        f"one process, the demo's 4 stages on one rank, {rounds} rounds of A A' B B A' A "
        f"(load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after): "
        f"training thread's CPU per iteration, median"
    )
    print(f"  off    {off / 1e6:.3f} ms")
    for side in DEMO_SIDES[1:]:
        median = statistics.median(cpu[side])
        extra = f"{median / off - 1:+.2%} ({(median - off) / 1e3:+.0f} us)"
        print(f"  {side:<6} {median / 1e6:.3f} ms: {extra}")
    flush = statistics.median(ends[-len(cpu["steps"]) :])
    print(
        f"  of which the recorded iteration's end (its flush: encode + write): {flush / 1e3:.0f} us"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--rounds", type=int, default=30, help="demo rounds (A A' B B A' A)")
    parser.add_argument("--block-steps", type=int, default=2, help="demo iterations per block")
    parser.add_argument(
        "--baseline", metavar="GIT_REV", help="part 1 against this revision, alternating"
    )
    parser.add_argument(
        "--baseline-rounds", type=int, default=3, help="A B B A rounds with --baseline"
    )
    parser.add_argument(
        "--inprocess-rounds", type=int, default=300, help="part 5's rounds (0: skip it)"
    )
    parser.add_argument(
        "--parts",
        action="store_true",
        help="part 2 also without memory samples (no-memory), without them and P2P "
        "events (steps-only), and with only the runtime's counting (counting), to price "
        "each part",
    )
    parser.add_argument("--hot-path-json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hot_path_json:  # a --baseline child
        print(json.dumps(measure_hot_path(args.events)))
        return
    if args.baseline:
        hot_path_against(args.baseline, args.events, args.baseline_rounds)
    else:
        hot_path(args.events)
    memory_costs()
    between_work_costs()
    cold_call_costs()
    if args.inprocess_rounds:
        inprocess_overhead(args.inprocess_rounds)
    if not args.skip_demo:
        sides = (*DEMO_SIDES, *PART_SIDES, COUNTING) if args.parts else DEMO_SIDES
        demo_overhead(args.rounds, args.block_steps, sides)


if __name__ == "__main__":
    main()
