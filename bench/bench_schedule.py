"""Time the schedule toolchain on a large plan: build, verify (eager), simulate.

The target: interleaved-1f1b with P=64 ranks, V=2 stages per rank, M=512 micro-batches and
its messages (391,168 steps) must build, verify and simulate in at most 0.5 s on the
project's 2-core machine. A script, not a test:

    .venv/bin/python bench/bench_schedule.py [--ranks 64 --microbatches 512 --repeat 3]
    .venv/bin/python bench/bench_schedule.py --baseline HEAD~3 --rounds 3

One *flow* is what a user of the toolchain does: build the plan, verify it under eager
semantics, simulate it. Each flow starts from nothing (a fresh plan), so nothing one flow
computes is reused by the next. Every phase is timed in wall and CPU seconds and the best
of ``--repeat`` flows is reported, also in *passes*: multiples of one list comprehension
touching every step's kind, measured in the same process (a figure that moves much less
with the machine's load than seconds). The other two semantics are verified once after the
flows, on the last plan.

These machines are shared and noisy, so ``--baseline REV`` runs the same flows with another
revision's pipetrace (``git archive`` into a temporary directory) in child processes,
alternating A B B A for ``--rounds`` rounds, and prints the ratio of the two in wall and
in CPU time, with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

TARGET_SECONDS = 0.5
PHASES = ("build", "verify", "simulate")
ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")

Timing = tuple[float, float]  # (wall, CPU) seconds


def clocked(action: Callable[[], T]) -> tuple[T, Timing]:
    """The result of ``action`` and its wall and CPU seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = action()
    return result, (time.perf_counter() - wall, time.process_time() - cpu)


def run_flows(args: argparse.Namespace) -> dict[str, object]:
    """``args.repeat`` flows: per phase and for the whole flow ("total") the fastest run
    by wall time, and what the last flow found (its verdicts, makespan, size)."""
    from pipetrace.schedule.builders import build_plan
    from pipetrace.schedule.simulate import simulate
    from pipetrace.schedule.verify import verify

    best: dict[str, Timing] = {}
    plan = report = result = None
    for _ in range(args.repeat):
        plan = report = result = None  # freed before the clock starts: no run pays for another's
        plan, build = clocked(
            lambda: build_plan(
                args.schedule,
                num_ranks=args.ranks,
                num_microbatches=args.microbatches,
                stages_per_rank=args.stages_per_rank,
                comms=True,
            )
        )
        report, check = clocked(lambda plan=plan: verify(plan, semantics="eager"))
        result, sim = clocked(lambda plan=plan: simulate(plan))
        flow = dict(zip(PHASES, (build, check, sim)))
        flow["total"] = (sum(t[0] for t in flow.values()), sum(t[1] for t in flow.values()))
        for phase, took in flow.items():
            best[phase] = min(best.get(phase, took), took)
    verdicts = {"eager": report.ok}
    for semantics in ("rendezvous", "fifo"):
        other, best[f"verify ({semantics})"] = clocked(
            lambda s=semantics: verify(plan, semantics=s)
        )
        verdicts[semantics] = other.ok
    steps = [step.kind for row in plan.ranks for step in row if step is not None]
    _, one_pass = clocked(lambda: [step.kind for row in plan.ranks for step in row if step])
    return {
        "best": best,
        "ok": verdicts,
        "steps": len(steps),
        "makespan": result.makespan,
        "bubble_ratio": result.bubble_ratio,
        "pass": one_pass[0],
    }


def print_flows(args: argparse.Namespace, measured: dict[str, object]) -> None:
    best, steps, one_pass = measured["best"], measured["steps"], measured["pass"]
    print(
        f"{args.schedule} P={args.ranks} V={args.stages_per_rank} M={args.microbatches}: "
        f"{steps:,} steps with comms; best of {args.repeat} flows; one pass over every step "
        f"takes {one_pass * 1e3:.1f} ms"
    )
    for phase, (wall, cpu) in best.items():
        label = {"verify": "verify (eager)", "total": "build+verify+simulate"}.get(phase, phase)
        print(f"{label:<22} {wall:7.3f} s wall {cpu:7.3f} s CPU  {wall / one_pass:6.1f} passes")
    print(
        f"  verdicts {measured['ok']}; makespan {measured['makespan']:g}, "
        f"bubble ratio {measured['bubble_ratio']:.4f}"
    )
    wall = best["total"][0]
    print(
        f"build + verify (eager) + simulate: {wall:.3f} s = {wall / TARGET_SECONDS:.0%} of target"
    )


def child(tree: Path, argv: list[str]) -> dict[str, object]:
    """One child process running the flows with ``tree``'s pipetrace."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, __file__, "--json", *argv],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)


def compare(args: argparse.Namespace, argv: list[str]) -> None:
    """Alternate this tree and ``args.baseline`` (A B B A per round) and print the ratios."""
    baseline = Path(tempfile.mkdtemp(prefix="pipetrace-baseline-"))
    try:
        archive = subprocess.run(
            ["git", "archive", args.baseline, "pipetrace"],
            check=True,
            capture_output=True,
            cwd=ROOT,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(baseline)], input=archive, check=True)
        sides = {"this tree": ROOT, f"baseline {args.baseline}": baseline}
        load_before = os.getloadavg()
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
            for side in order + order[::-1]:
                runs[side].append(child(sides[side], argv))
        load_after = os.getloadavg()
    finally:
        shutil.rmtree(baseline, ignore_errors=True)
    best = {
        side: {
            phase: min(tuple(m["best"][phase]) for m in measured) for phase in measured[0]["best"]
        }
        for side, measured in runs.items()
    }
    verdicts = {side: [m["ok"] for m in measured] for side, measured in runs.items()}
    ours, theirs = best.values()
    print(
        f"{args.schedule} P={args.ranks} V={args.stages_per_rank} M={args.microbatches}, "
        f"{runs['this tree'][0]['steps']:,} steps; {args.rounds} rounds A B B A, each side "
        f"{2 * args.rounds} processes x {args.repeat} flows, best of each"
    )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")
    print(f"{'phase':<22} {'this tree':>19} {'baseline':>19} {'ratio wall':>11} {'ratio CPU':>10}")
    for phase in ours:
        (w, c), (bw, bc) = ours[phase], theirs[phase]
        print(
            f"{phase:<22} {w:7.3f} s {c:6.3f} s CPU {bw:7.3f} s {bc:6.3f} s CPU "
            f"{w / bw:11.3f} {c / bc:10.3f}"
        )
    same = all(v == verdicts["this tree"][0] for vs in verdicts.values() for v in vs)
    print(f"verdicts identical on both sides: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="interleaved-1f1b")
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--stages-per-rank", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3, help="flows per process")
    parser.add_argument(
        "--baseline", metavar="GIT_REV", help="compare with this revision, alternating"
    )
    parser.add_argument("--rounds", type=int, default=2, help="A B B A rounds with --baseline")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a child's output
    args = parser.parse_args()
    if args.baseline:
        argv = [
            f"--schedule={args.schedule}",
            f"--ranks={args.ranks}",
            f"--stages-per-rank={args.stages_per_rank}",
            f"--microbatches={args.microbatches}",
            f"--repeat={args.repeat}",
        ]
        compare(args, argv)
        return
    measured = run_flows(args)
    if args.json:
        print(json.dumps(measured))
    else:
        print_flows(args, measured)


if __name__ == "__main__":
    main()
