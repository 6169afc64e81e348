"""Analyzer throughput and memory on a synthetic run of any size.

    .venv/bin/python bench/bench_analyze.py --ranks 1024 --events-per-rank 10000
    .venv/bin/python bench/bench_analyze.py --ranks 64 --events-per-rank 2000   # quick
    .venv/bin/python bench/bench_analyze.py --run-dir /tmp/run --keep --reuse --repeat 3 \\
        --baseline HEAD~5

Writes a synthetic run in the documented trace format (`pipetrace.testing.synthetic`: a 1F1B
schedule with P = --ranks, timed by the shared executor, every rank's log written exactly
as the recorder writes it), then runs `pipetrace analyze RUN --json` end to end in a child
process (interpreter start, imports, parallel loading, every analyzer, JSON output) and
reports wall time, events per second, CPU time (the child's own and its workers': where the
parse ends and the serial tail begins), and peak memory: the child's own peak RSS and the
peak of the sum over the child and its worker processes (sampled from /proc every 10 ms),
each against the run's size on disk. Every run is printed, then the best by wall time: on
a shared machine compare the CPU times of runs taken alternately, not one best wall.
The first analysis starts without a columnar cache (and writes it); then the run is
reopened from the cache, end to end (`analyze` reads the output it kept) and `load_run`
alone (from the run-level entry: `analyze/run_cache.py`).
Targets (issue 15): first analysis >= 2M events/s with peak RSS <= the logs' size; a second
`analyze` in under 1 s; reopen from the cache >= 20M events/s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from baseline import checkout

from pipetrace.analyze.cache import CACHE_DIR, RECENT_NS


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                out.extend(int(c) for c in handle.read().split())
    except OSError:
        pass
    return out


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeRss:
    """Peak of the summed RSS of a process and its descendants, sampled."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.pid, self.interval, self.peak_kb = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pids, frontier = [self.pid], [self.pid]
            while frontier:
                kids = [c for p in frontier for c in _children(p)]
                pids += kids
                frontier = kids
            self.peak_kb = max(self.peak_kb, sum(_rss_kb(p) for p in pids))
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_kb


def plan_size(ranks: int, events_per_rank: int) -> tuple[int, int]:
    """Micro-batches and iterations of 1F1B so that a middle rank logs ~events_per_rank
    events: per iteration it logs ~20 per micro-batch (begin/end of F, B and 4 comm steps,
    plus each comm step's post/done)."""
    microbatches = max(1, min(64, events_per_rank // 200))
    iterations = max(1, round(events_per_rank / (20 * microbatches + 2)))
    return microbatches, iterations


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pipetrace-bench-"))
    if not (args.reuse and (run_dir / "meta.json").exists()):
        _generate(run_dir, args.ranks, args.events_per_rank)
    events, size = _run_size(run_dir)
    arguments = ["analyze", str(run_dir), "--json", "--no-segments"]
    if args.workers is not None:
        arguments += ["--workers", str(args.workers)]
    sides = {"this tree": Path(__file__).resolve().parents[1]}
    if args.baseline:  # the same run analyzed by another revision, alternating with this tree
        sides = {f"baseline {args.baseline}": checkout(args.baseline), **sides}
    first: dict[str, Measured] = {}
    for _ in range(args.repeat):
        for side, root in sides.items():
            shutil.rmtree(run_dir / CACHE_DIR, ignore_errors=True)  # a first analysis
            result = _measure(_command(root, arguments))
            first[side] = min(first.get(side, result), result)
            print(
                f"  {side}: {result.wall:.2f} s wall, {result.cpu:.2f} s CPU (analyzing "
                f"process {result.parent_cpu:.2f}, workers {result.cpu - result.parent_cpu:.2f})"
            )
    for side, result in first.items():
        _report_first(side, result, events, size)
    if args.baseline:
        base, tree = first.values()
        print(
            f"this tree / baseline: wall {tree.wall / base.wall:.3f}, CPU {tree.cpu / base.cpu:.3f}"
            f" (loading process {tree.parent_cpu / base.parent_cpu:.3f}), best of {args.repeat}"
        )
        shutil.rmtree(sides[f"baseline {args.baseline}"], ignore_errors=True)
    _report_reopen(run_dir, arguments, events, args.repeat)
    if not args.keep and not args.run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--events-per-rank", type=int, default=10_000)
    parser.add_argument(
        "--run-dir", help="Where to write the run (default: a temporary directory)."
    )
    parser.add_argument("--keep", action="store_true", help="Keep the run directory.")
    parser.add_argument(
        "--reuse", action="store_true", help="Reuse --run-dir if it already holds a run."
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="Passed to pipetrace analyze --workers."
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="Analyze this many times; report the best."
    )
    parser.add_argument(
        "--baseline",
        metavar="GIT_REV",
        help="Also analyze with this revision's pipetrace (git archive), alternating runs, "
        "and print the ratio of first analyses: the steadier figure on a noisy machine.",
    )
    return parser.parse_args(argv)


def _generate(run_dir: Path, ranks: int, events_per_rank: int) -> None:
    from pipetrace.testing.synthetic import write_synthetic_run

    microbatches, iterations = plan_size(ranks, events_per_rank)
    start = time.perf_counter()
    # one run id for the generating processes (each would derive its own from its parent)
    os.environ.setdefault("PIPETRACE_RUN_ID", f"bench-{os.getpid()}-{time.time_ns()}")
    write_synthetic_run(
        run_dir,
        num_ranks=ranks,
        num_microbatches=microbatches,
        iterations=iterations,
        jitter=0.0,
        workers=os.cpu_count() or 1,
    )
    print(
        f"generated {run_dir} in {time.perf_counter() - start:.1f} s "
        f"(1F1B, P={ranks}, M={microbatches}, {iterations} iterations)"
    )
    time.sleep(RECENT_NS / 1e9)  # a log written in the last seconds is not cached


def _run_size(run_dir: Path) -> tuple[int, int]:
    """(events, bytes) of the run's logs."""
    logs = sorted(run_dir.glob("rank-*.ndjson"))
    size = sum(p.stat().st_size for p in logs)
    events = 0
    for p in logs:
        with open(p, "rb") as handle:
            events += (
                sum(block.count(b"\n") for block in iter(lambda h=handle: h.read(1 << 24), b"")) - 1
            )
    print(f"run: {len(logs)} rank logs, {events:,} events, {size / 2**20:.1f} MiB")
    return events, size


def _report_first(side: str, result: Measured, events: int, size: int) -> None:
    rate = events / result.wall / 1e6
    print(
        f"{side}: first analysis {result.wall:.2f} s wall, {result.cpu:.2f} s CPU (the "
        f"analyzing process {result.parent_cpu:.2f}, its workers "
        f"{result.cpu - result.parent_cpu:.2f}), {rate:.2f} M events/s end to end "
        f"(target >= 2: {'met' if rate >= 2 else 'MISSED'})"
    )
    tree_kb = result.tree_kb
    verdict = "met" if tree_kb * 1024 <= size else "MISSED"
    print(
        f"{side}: peak RSS: analyzing process {result.parent_kb / 1024:.0f} MiB "
        f"({result.parent_kb * 1024 / size:.2f}x the logs), with its workers "
        f"{tree_kb / 1024:.0f} MiB ({tree_kb * 1024 / size:.2f}x; target <= 1: {verdict})"
    )


def _report_reopen(run_dir: Path, arguments: list[str], events: int, repeat: int) -> None:
    """This tree's second analysis (the cache written by the first), end to end and the
    load alone (in a child process: `load_run` timed after the imports)."""
    root = Path(__file__).resolve().parents[1]
    for kind, pattern in (("per-log entries", "*.cols"), ("run entry", "*.model")):
        size = sum(p.stat().st_size for p in (run_dir / CACHE_DIR).glob(pattern))
        print(
            f"cache, {kind}: {size / 2**20:.1f} MiB ({size / max(events, 1):.1f} bytes per event)"
        )
    best = min(_measure(_command(root, arguments)) for _ in range(repeat))
    print(
        f"reopen: analyze {best.wall:.2f} s wall ({best.cpu:.2f} s CPU) end to end (its output "
        f"kept), {events / best.wall / 1e6:.2f} M events/s (target: under 1 s: "
        f"{'met' if best.wall < 1 else 'MISSED'})"
    )
    load, load_cpu = min(_timed_load(root, run_dir) for _ in range(repeat))
    rate = events / load / 1e6
    print(
        f"reopen: load_run {load:.2f} s ({load_cpu:.2f} s CPU), {rate:.1f} M events/s "
        f"(target >= 20: {'met' if rate >= 20 else 'MISSED'})"
    )


def _timed_load(root: Path, run_dir: Path) -> tuple[float, float]:
    """(wall s, CPU s) of `load_run` alone, in a fresh child process, after its imports."""
    code = (
        f"import sys, time; sys.path.insert(0, {str(root)!r}); "
        "from pipetrace.analyze.load import load_run; "
        f"t, c = time.perf_counter(), time.process_time(); load_run({str(run_dir)!r}); "
        "print(time.perf_counter() - t, time.process_time() - c)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True).stdout
    wall, cpu = map(float, out.split())
    return wall, cpu


_SELF_CPU = "bench: the analyzing process's own CPU s:"


def _command(root: Path, arguments: list[str]) -> list[str]:
    """`pipetrace ARGUMENTS` run from the package under ``root`` (ahead of any installed one);
    at exit the process writes its own CPU time, without its workers', to stderr."""
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r}); sys.argv = ['pipetrace', *{arguments!r}]; "
        "import atexit, resource; atexit.register(lambda: print("
        f"{_SELF_CPU!r}, sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), file=sys.stderr)); "
        "from pipetrace.cli import main; sys.exit(main())"
    )
    return [sys.executable, "-c", code]


@dataclass(order=True)
class Measured:
    """One run of the analysis (ordered by wall time: the best is the smallest)."""

    wall: float  # s
    parent_kb: int  # the child's peak RSS
    tree_kb: int  # the peak summed RSS of the child and its workers
    cpu: float  # s, the child and its workers
    parent_cpu: float  # s, the child alone (the loading process: assembly, analyzers)


def _measure(command: list[str]) -> Measured:
    """Run the command and measure it."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = TreeRss(child.pid)
    _, status, ru = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    tree_kb = sampler.stop()
    child.returncode = os.waitstatus_to_exitcode(status)
    err = child.stderr.read().decode() if child.stderr else ""
    if child.returncode not in (0, 1):  # 1: problems found, a normal outcome
        raise SystemExit(f"the analysis failed (exit code {child.returncode}): {err.strip()}")
    own = [line for line in err.splitlines() if line.startswith(_SELF_CPU)]
    parent_cpu = float(own[-1][len(_SELF_CPU) :]) if own else float("nan")
    return Measured(wall, ru.ru_maxrss, tree_kb, ru.ru_utime + ru.ru_stime, parent_cpu)


if __name__ == "__main__":
    sys.exit(main())
