"""Recorder cost: per event on the hot path, and step-time overhead on the 4-rank demo.

    .venv/bin/python bench/bench_recorder.py [--events 200000] [--skip-demo]

Part 1 drives the real Recorder (writer thread running) through begin_step/end_step and
p2p_posted/p2p_completed, timing batches of 1,000 events; it prints the median and p95 cost
per event on the hot path, the all-in cost including encoding and writing, and the cost of the
same calls on NullRecorder as the in-process baseline.

Part 2 runs the 4-rank 1F1B demo with `--record off` and `--record steps` in one invocation,
alternating, and prints the step-time ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pipetrace.recorder.hooks import NullRecorder
from pipetrace.recorder.recorder import Recorder, RecorderConfig
from pipetrace.schedule.builders import build_plan

BATCH = 1000


def drive(recorder, plan, events: int) -> list[float]:
    """Per-event cost (ns) of each batch of BATCH events: half steps, half P2P ops."""
    steps = plan.steps(0)
    per_event: list[float] = []
    clock = time.perf_counter_ns
    for batch in range(events // BATCH):
        t0 = clock()
        for i in range(BATCH // 4):
            step = steps[i % len(steps)]
            token = recorder.begin_step(i, step)
            ticket = recorder.p2p_posted(op="send", step=step, peer=1, channel="F", seq=i,
                                         nbytes=4096, shape=(32, 32), dtype="float32")  # fmt: skip
            recorder.p2p_completed(ticket)
            recorder.end_step(token)
        per_event.append((clock() - t0) / BATCH)
    return per_event


def hot_path(events: int) -> None:
    plan = build_plan("1f1b", num_ranks=4, num_microbatches=8, comms=True)
    baseline = drive(NullRecorder(), plan, events)
    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(RecorderConfig(Path(tmp), stall_timeout=0))
        recorder.begin_run(rank=0, world_size=1, plan=plan, config={})
        recorder.begin_iteration(0)
        t0 = time.perf_counter_ns()
        costs = drive(recorder, plan, events)
        recorder.end_iteration(0, None)
        recorder.end_run()
        all_in = (time.perf_counter_ns() - t0) / events
        size = sum(p.stat().st_size for p in Path(tmp).glob("rank-*.ndjson"))
    q = statistics.quantiles(costs, n=20)
    print(f"hot path, {events} events: median {statistics.median(costs) / 1000:.2f} us/event, "
          f"p95 {q[-1] / 1000:.2f} us (target: median <= 2 us)")  # fmt: skip
    print(f"all-in incl. background encoding + write: {all_in / 1000:.2f} us/event, "
          f"{size / events:.0f} bytes/event on disk")  # fmt: skip
    print(f"NullRecorder baseline: median {statistics.median(baseline) / 1000:.3f} us/event")


def demo_overhead(steps: int, rounds: int) -> None:
    from pipetrace.runtime.bench_support import time_demo_steps

    off, on = time_demo_steps(steps=steps, rounds=rounds)
    ratio = statistics.median(on) / statistics.median(off)
    print(f"4-rank 1f1b demo step time: off {statistics.median(off) * 1e3:.2f} ms, "
          f"steps {statistics.median(on) * 1e3:.2f} ms, overhead {ratio - 1:+.1%} (target <= 3 %)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--demo-steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    hot_path(args.events)
    if not args.skip_demo:
        demo_overhead(args.demo_steps, args.rounds)


if __name__ == "__main__":
    main()
