"""Analyzer throughput and memory on a synthetic run of any size.

    .venv/bin/python bench/bench_analyze.py --ranks 1024 --events-per-rank 10000
    .venv/bin/python bench/bench_analyze.py --ranks 64 --events-per-rank 2000   # quick
    .venv/bin/python bench/bench_analyze.py --run-dir /tmp/run --keep --reuse --repeat 3 \\
        --baseline HEAD~5

Writes a synthetic run in the documented trace format (`pipetrace.testing.synthetic`: a 1F1B
schedule with P = --ranks, timed by the shared executor, every rank's log written exactly
as the recorder writes it), then runs `pipetrace analyze RUN --json` end to end in a child
process (interpreter start, imports, parallel loading, every analyzer, JSON output) and
reports wall time, events per second, and peak memory: the child's own peak RSS and the peak
of the sum over the child and its worker processes (sampled from /proc every 10 ms), each
against the run's size on disk. Targets: >= 1M events/s, peak RSS <= 2x the files' size.
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
from pathlib import Path


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
        "and print the ratio: the steadier figure on a noisy machine.",
    )
    args = parser.parse_args(argv)

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pipetrace-bench-"))
    microbatches, iterations = plan_size(args.ranks, args.events_per_rank)
    if not (args.reuse and (run_dir / "meta.json").exists()):
        from pipetrace.testing.synthetic import write_synthetic_run

        start = time.perf_counter()
        write_synthetic_run(
            run_dir,
            num_ranks=args.ranks,
            num_microbatches=microbatches,
            iterations=iterations,
            jitter=0.0,
            workers=os.cpu_count() or 1,
        )
        print(
            f"generated {run_dir} in {time.perf_counter() - start:.1f} s "
            f"(1F1B, P={args.ranks}, M={microbatches}, {iterations} iterations)"
        )
    logs = sorted(run_dir.glob("rank-*.ndjson"))
    size = sum(p.stat().st_size for p in logs)
    events = 0
    for p in logs:
        with open(p, "rb") as handle:
            events += (
                sum(block.count(b"\n") for block in iter(lambda h=handle: h.read(1 << 24), b"")) - 1
            )
    print(f"run: {len(logs)} rank logs, {events:,} events, {size / 2**20:.1f} MiB")

    arguments = ["analyze", str(run_dir), "--json", "--no-segments"]
    if args.workers is not None:
        arguments += ["--workers", str(args.workers)]
    sides = {"this tree": _command(Path(__file__).resolve().parents[1], arguments)}
    baseline_dir = None
    if args.baseline:  # the same run analyzed by another revision, alternating with this tree
        baseline_dir = Path(tempfile.mkdtemp(prefix="pipetrace-baseline-"))
        archive = subprocess.run(
            ["git", "archive", args.baseline, "pipetrace"],
            check=True,
            capture_output=True,
            cwd=Path(__file__).resolve().parents[1],
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(baseline_dir)], input=archive, check=True)
        sides = {f"baseline {args.baseline}": _command(baseline_dir, arguments), **sides}
    best: dict[str, tuple] = {}
    for _ in range(args.repeat):
        for side, command in sides.items():
            result = _measure(command)
            if side not in best or result[0] < best[side][0]:
                best[side] = result
    for side, (wall, parent_kb, tree_kb, cpu) in best.items():
        print(
            f"{side}: analyze {wall:.2f} s wall, {cpu:.2f} s CPU (child + workers), "
            f"{events / wall / 1e6:.2f} M events/s end to end"
        )
        print(
            f"{side}: peak RSS: analyzing process {parent_kb / 1024:.0f} MiB "
            f"({parent_kb * 1024 / size:.2f}x the logs), "
            f"with its workers {tree_kb / 1024:.0f} MiB ({tree_kb * 1024 / size:.2f}x)"
        )
    if args.baseline:
        (base, *_), (tree, *_) = best.values()
        print(
            f"this tree / baseline wall time: {tree / base:.3f} "
            f"(best of {args.repeat} each, alternating)"
        )
        shutil.rmtree(baseline_dir, ignore_errors=True)  # type: ignore[arg-type]
    if not args.keep and not args.run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _command(root: Path, arguments: list[str]) -> list[str]:
    """`pipetrace ARGUMENTS` run from the package under ``root`` (ahead of any installed one)."""
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r}); sys.argv = ['pipetrace', *{arguments!r}]; "
        "from pipetrace.cli import main; sys.exit(main())"
    )
    return [sys.executable, "-c", code]


def _measure(command: list[str]) -> tuple[float, int, int, float]:
    """(wall s, the child's peak RSS KiB, the peak summed RSS of it and its workers KiB, CPU s)."""
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
    return wall, ru.ru_maxrss, tree_kb, ru.ru_utime + ru.ru_stime


if __name__ == "__main__":
    sys.exit(main())
