"""Instructions a recorded iteration adds, per function, counted by valgrind's callgrind.

    .venv/bin/python bench/count_recorder_instructions.py [--short N] [--long N] [--top K]

Timings of the recorded demo move by a point or more from run to run (docs/performance.md,
"Recorder"), more than what one change to the recorder saves; instruction counts do not.
This runs part 5's setting of bench/bench_recorder.py (one process holding the demo's four
stages, interleaved-1f1b, M=8: 64 steps an iteration, hand-offs local) under callgrind four
times: recorded (`steps`) and unrecorded (`off`), for ``--short`` and ``--long`` iterations
after 3 warm-up ones. A function's instructions per recorded iteration are then

    ((steps long - steps short) - (off long - off short)) / (long - short)

which cancels start-up, imports and the first iterations (where saved bytes are measured).
Every thread counts, the writer's encoding included. Instructions are not time: the
recorder's run between chunks of the framework's work, with its code and data out of the
caches, at a fraction of the iteration's average rate (its own docs say how much).
Needs valgrind; takes ~5 minutes on 2 cores (two runs at a time; a run is ~50x slower).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WARMUP = 3


def run_iterations(side: str, iterations: int) -> None:
    """The child: ``iterations`` iterations of part 5's runner on ``side`` (after warm-up)."""
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_recorder import _one_rank_demo

    from pipetrace.runtime.launch import free_port

    runner, switch, batch, tmp = _one_rank_demo(free_port())
    switch.use(side)
    for _ in range(WARMUP + iterations):
        runner.step(*batch)
    switch.use("steps")
    runner.close()
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)


def callgrind(side: str, iterations: int, out: Path) -> Path:
    path = out / f"callgrind.{side}.{iterations}"
    subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={path}", sys.executable, __file__]
        + ["--child", side, str(iterations)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return path


def inclusive(path: Path) -> collections.Counter:
    """Instructions per function, callees included (callgrind_annotate's)."""
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    counts: collections.Counter = collections.Counter()
    for line in text.splitlines():
        found = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)$", line)
        if found and "=>" not in found.group(2):
            counts[found.group(2).split(" [")[0]] += int(found.group(1).replace(",", ""))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--short", type=int, default=2, help="iterations of the short runs")
    parser.add_argument("--long", type=int, default=22, help="iterations of the long runs")
    parser.add_argument("--top", type=int, default=25, help="functions listed")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_iterations(args.child[0], int(args.child[1]))
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed")
    runs = [(side, n) for side in ("off", "steps") for n in (args.short, args.long)]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        paths = list(pool.map(lambda run: callgrind(*run, Path(tmp)), runs))
        off_short, off_long, steps_short, steps_long = map(inclusive, paths)
    span = args.long - args.short
    per_iteration: dict[str, float] = {}
    for name in set(steps_long) | set(steps_short):
        if "pipetrace/recorder/_" not in name:  # the C queue's functions only
            continue
        short = name.split("pipetrace/recorder/")[-1]
        count = (steps_long[name] - steps_short[name] - off_long[name] + off_short[name]) / span
        # callgrind_annotate may list a function under two file names (source and object)
        per_iteration[short] = max(count, per_iteration.get(short, count))
    print(
        f"instructions per recorded iteration (64 steps), {args.long} - {args.short} "
        "iterations, recorded less unrecorded, callees included:"
    )
    for name, count in sorted(per_iteration.items(), key=lambda item: -item[1])[: args.top]:
        if count >= 1000:
            print(f"  {count:>9,.0f}  {name}")
    iteration = (off_long["PROGRAM TOTALS"] - off_short["PROGRAM TOTALS"]) / span
    print(f"an unrecorded iteration: {iteration:,.0f} instructions (every thread)")


if __name__ == "__main__":
    main()
