"""GPU check of the device timer (issue 16): one process, several V-placed stages on one GPU.

    .venv/bin/python bench/gpu_device_timing.py [--schedule zbv] [--microbatches 8]
        [--width 4096] [--batch 4096] [--iterations 20] [--spin-ms 20]

Runs pipetrace's own executor for a world size of 1 (the stages of the plan all on this GPU,
handing activations over in memory: no second process, no NCCL) with a recorder-hooks object
that times every step through `DeviceTimer` (background poller on), and checks three things:

1. durations: in a run with reference events, each step's device duration from the timer
   agrees within 5 % with `torch.cuda.Event.elapsed_time` of a second, independent pair of
   events recorded around the same work (steps shorter than 50 µs are not compared: there a
   few µs of event placement are more than 5 %);
2. overhead: the wall time of an iteration with device timing (and no reference events) is
   at most 2 % above the same iteration without (alternating, medians, the device
   synchronized around each timed iteration: this script may synchronize, the timer never
   does); the host cost of one begin + end is printed too;
3. spin: in the run of check 1, a forward made to spin with `torch.cuda._sleep` for
   ``--spin-ms`` is classified device-bound, its device duration and lag covering the spin.

Prints one line per check and exits 0 if all pass, 1 if one fails, 2 (with one line) when
there is no CUDA device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from pipetrace.recorder.device.classify import Boundness, classify
from pipetrace.recorder.device.cuda import CudaBackend, cuda_backend
from pipetrace.recorder.device.spans import DeviceSpan
from pipetrace.recorder.device.timer import DeviceTimer
from pipetrace.recorder.hooks import NullRecorder
from pipetrace.runtime.executor import Executor, StepContext
from pipetrace.runtime.stage import PipelineStage
from pipetrace.schedule.builders import build_plan
from pipetrace.schedule.ir import Plan, Step, format_step

DURATION_TOLERANCE = 0.05
OVERHEAD_LIMIT = 0.02
MIN_COMPARED_NS = 50_000


@dataclass
class ReferencePair:
    """The independent events recorded around one timed step."""

    begin: torch.cuda.Event
    end: torch.cuda.Event


class TimedHooks(NullRecorder):
    """The step hooks the recorder will have (docs/device-timing.md), plus reference events."""

    def __init__(self, timer: DeviceTimer, backend: CudaBackend, *, references: bool) -> None:
        self.timer = timer
        self.backend = backend
        self.with_references = references
        """Also record reference events (not part of the recording's cost)."""
        self.references: dict[int, ReferencePair] = {}
        self.last_key = -1
        """The key of the step begun last."""

    def begin_step(self, position: int, step: Step, thread: str = "main") -> object:
        self.last_key = key = self.last_key + 1
        stream = self.backend.current_stream()
        if self.with_references:
            reference = ReferencePair(*(torch.cuda.Event(enable_timing=True) for _ in range(2)))
            reference.begin.record(stream)
            self.references[key] = reference
        return key, self.timer.begin(key, format_step(step), stream)

    def end_step(self, token: object) -> None:
        key, timing = token
        self.timer.end(timing)
        if self.with_references:
            self.references[key].end.record(self.backend.current_stream())


def build_executor(plan: Plan, width: int, hooks: NullRecorder) -> Executor:
    torch.manual_seed(0)
    num_stages = plan.num_stages
    stages = {
        index: PipelineStage(
            torch.nn.Sequential(
                torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
            ).cuda(),
            stage_index=index,
            num_stages=num_stages,
            loss_fn=torch.nn.functional.mse_loss if index == num_stages - 1 else None,
        )
        for index in plan.stages_of(0)
    }
    return Executor(plan=plan, rank=0, stages=stages, p2p=None, recorder=hooks)


def sleep_cycles_per_ms() -> float:
    """`torch.cuda._sleep` spins for clock cycles: calibrate cycles per millisecond."""
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    cycles = 50_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def timed_iteration(executor: Executor, inputs: list, targets: list) -> float:
    """Wall seconds of one iteration, the device synchronized before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    executor.run_iteration(inputs, targets)
    torch.cuda.synchronize()
    for stage in executor.stages.values():
        stage.module.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def check_durations(spans: list[DeviceSpan], hooks: TimedHooks) -> tuple[bool, str]:
    deviations = []
    for span in spans:
        reference = hooks.references[span.key]
        reference_ns = reference.begin.elapsed_time(reference.end) * 1e6
        if reference_ns >= MIN_COMPARED_NS:
            deviations.append(abs(span.device_ns - reference_ns) / reference_ns)
    worst = max(deviations, default=float("inf"))
    ok = worst <= DURATION_TOLERANCE
    return ok, (
        f"durations: {len(deviations)} of {len(spans)} steps compared, largest deviation from "
        f"elapsed_time {worst:.2%} (limit {DURATION_TOLERANCE:.0%})"
    )


def check_overhead(plain: list[float], timed: list[float]) -> tuple[bool, str]:
    plain_s, timed_s = statistics.median(plain), statistics.median(timed)
    overhead = timed_s / plain_s - 1
    return overhead <= OVERHEAD_LIMIT, (
        f"overhead: iteration {timed_s * 1e3:.2f} ms timed vs {plain_s * 1e3:.2f} ms plain, "
        f"{overhead:+.2%} (limit {OVERHEAD_LIMIT:.0%})"
    )


def check_spin(spans: list[DeviceSpan], spun_key: int, spin_ms: float) -> tuple[bool, str]:
    span = next(s for s in spans if s.key == spun_key)
    kind = classify(span)
    floor_ns = 0.9 * spin_ms * 1e6
    ok = kind is Boundness.DEVICE and span.device_ns >= floor_ns and span.lag_ns >= floor_ns
    others = [classify(s) for s in spans if s.key != spun_key]
    return ok, (
        f"spin: {span.label} spun {spin_ms:g} ms: device {span.device_ns / 1e6:.2f} ms, "
        f"finished {span.lag_ns / 1e6:.2f} ms after it was enqueued, {kind.value} "
        f"(other steps: {others.count(Boundness.DEVICE)} device-bound, "
        f"{others.count(Boundness.LAUNCH)} launch-bound)"
    )


def host_cost_us(timer: DeviceTimer, backend: CudaBackend, pairs: int = 1_000) -> float:
    """Training-thread cost of one begin + end, in µs (no work in between; fewer pairs than
    the timer's ``max_in_flight``, so that none goes untimed)."""
    stream = backend.current_stream()
    t0 = time.perf_counter_ns()
    for key in range(pairs):
        timer.end(timer.begin(-1 - key, "bench", stream))
    cost = (time.perf_counter_ns() - t0) / pairs / 1e3
    torch.cuda.synchronize()
    timer.poll()
    return cost


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="zbv")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--spin-ms", type=float, default=20.0)
    return parser.parse_args()


def timed_run(
    backend: CudaBackend, *, references: bool
) -> tuple[DeviceTimer, TimedHooks, list[DeviceSpan]]:
    """A started timer (poller on), the hooks that time every step through it, and the list
    its resolved spans go to."""
    spans: list[DeviceSpan] = []
    timer = DeviceTimer(backend, now_ns=time.perf_counter_ns, on_span=spans.append)
    timer.start()
    timer.start_poller()
    return timer, TimedHooks(timer, backend, references=references), spans


def main() -> int:
    args = parse_args()
    backend = cuda_backend()
    if backend is None:
        print("gpu_device_timing: skipped: no CUDA device (torch.cuda.is_available() is False)")
        return 2
    plan = build_plan(args.schedule, num_ranks=1, num_microbatches=args.microbatches, comms=True)
    micro = args.batch // args.microbatches
    inputs = [torch.randn(micro, args.width, device="cuda") for _ in range(args.microbatches)]
    targets = [torch.randn(micro, args.width, device="cuda") for _ in range(args.microbatches)]

    # Overhead: the same iteration without and with device timing, alternating.
    timing_timer, timing_hooks, _ = timed_run(backend, references=False)
    plain = build_executor(plan, args.width, NullRecorder())
    timing = build_executor(plan, args.width, timing_hooks)
    times: dict[str, list[float]] = {"plain": [], "timed": []}
    for index in range(args.iterations + 1):  # the first pair is a warm-up
        plain_s = timed_iteration(plain, inputs, targets)
        timed_s = timed_iteration(timing, inputs, targets)
        if index:
            times["plain"].append(plain_s)
            times["timed"].append(timed_s)
    timing_timer.close()

    # Durations and spin: reference events around every step, one forward made to spin.
    checked_timer, hooks, spans = timed_run(backend, references=True)
    checked = build_executor(plan, args.width, hooks)
    cycles_per_ms = sleep_cycles_per_ms()
    spun: list[int] = []

    def spinning_forward(step: Step, context: StepContext) -> None:
        context.default(step)
        if context.iteration == 1 and not spun and step.stage == plan.num_stages - 1:
            spun.append(hooks.last_key)
            torch.cuda._sleep(int(args.spin_ms * cycles_per_ms))

    checked.register_custom_function("F", spinning_forward)
    for _ in range(3):
        timed_iteration(checked, inputs, targets)
    checked_timer.close()
    results = [
        check_durations(spans, hooks),
        check_overhead(times["plain"], times["timed"]),
        check_spin(spans, spun[0], args.spin_ms),
    ]
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.schedule} "
        f"on one GPU (stages {plan.stages_of(0)}, placement {list(plan.placement)}), "
        f"M={args.microbatches}, width {args.width}, batch {args.batch}"
    )
    for ok, line in results:
        print(f"{'ok  ' if ok else 'FAIL'} {line}")
    cost = host_cost_us(checked_timer, backend)
    print(f"info host cost per timed step (begin + end): {cost:.1f} µs")
    unresolved = len(timing_timer.pending()) + len(checked_timer.pending())
    untimed = timing_timer.untimed + checked_timer.untimed
    print(f"info unresolved at the end: {unresolved}, untimed: {untimed}")
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
