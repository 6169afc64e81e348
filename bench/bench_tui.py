"""TUI speed on a 1M-event run: time to first frame and frame time for pan and zoom.

    .venv/bin/python bench/bench_tui.py [--events 1000000] [--size 120x40] [--run DIR] [--repeat 30]

A synthetic run (8 ranks, 1F1B, 32 micro-batches, iterations enough for --events) is written
once to DIR (default: a directory under the system temp dir, reused across invocations). The
app then runs headless (`App.run_test`) at a fixed terminal size and the script prints:

- the loading work alone, outside the TUI, by phase (load_run, analyze, the TUI's index);
- first frame: from creating the app to its first screen (the loading view), and to the
  timeline's first frame (the run loaded, analyzed and indexed in the background worker);
- frame time per operation (pan, zoom, cursor moves), at three zoom levels (the whole run,
  one iteration, a few steps): the app's action plus a full redraw of every timeline and
  ruler line, with nothing cached, median and p95 over --repeat;
- for reference, the same operations through Pilot key presses (a round trip through
  Textual's event loop, including Pilot's own waiting), minus an unbound key's round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from pipetrace.testing.synthetic import write_synthetic_run

RANKS, MICROBATCHES = 8, 32
EVENTS_PER_ITERATION = 4624  # 1F1B, 8 ranks, 32 micro-batches, plain P2P (measured)

OPERATIONS = [  # (name, app action, Pilot key)
    ("pan right", "pan(0.25)", "shift+right"),
    ("pan left", "pan(-0.25)", "shift+left"),
    ("zoom in", "zoom(2)", "plus"),
    ("zoom out", "zoom(0.5)", "minus"),
    ("next step", "step(1)", "right"),
    ("lane down", "lane(1)", "down"),
]


def ensure_run(run_dir: Path, events: int) -> Path:
    marker = run_dir / f".bench-{events}"
    if marker.exists():
        return run_dir
    iterations = max(1, round(events / EVENTS_PER_ITERATION))
    t = time.perf_counter()
    write_synthetic_run(
        run_dir,
        schedule="1f1b",
        num_ranks=RANKS,
        num_microbatches=MICROBATCHES,
        iterations=iterations,
        jitter=0.05,
        workers=os.cpu_count() or 1,
    )
    marker.touch()
    print(f"wrote {run_dir} ({iterations} iterations) in {time.perf_counter() - t:.1f} s")
    return run_dir


def _stats(values: list[float]) -> str:
    values = sorted(values)
    p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
    return f"median {statistics.median(values) * 1e3:6.1f} ms   p95 {p95 * 1e3:6.1f} ms"


def _full_redraw(app) -> None:
    """Draw every visible timeline and ruler line from scratch (what a frame costs us)."""
    from pipetrace.tui.ruler import TimeRuler
    from pipetrace.tui.timeline import TimelineView

    timeline = app.query_one(TimelineView)
    timeline._cache.clear()
    for y in range(timeline.scrollable_content_region.height):
        timeline.render_line(y)
    app.query_one(TimeRuler).render_line(0)


def load_outside_the_tui(run_dir: Path) -> None:
    """The same loading work with no UI running, by phase: the floor for the first timeline
    frame."""
    from pipetrace.tui.session import open_session

    marks: dict[str, float] = {}
    t0 = time.perf_counter()

    def progress(phase: str, done: int, total: int) -> None:
        marks.setdefault(phase, time.perf_counter() - t0)

    open_session(run_dir, progress=progress)
    total = time.perf_counter() - t0
    reading = marks.get("analyzing", total)
    analyzing = marks.get("indexing", total) - reading
    print(
        f"load outside the TUI: {total * 1e3:.0f} ms (load_run {reading * 1e3:.0f} ms, analyze "
        f"{analyzing * 1e3:.0f} ms, "
        f"TUI index + plan lanes {(total - reading - analyzing) * 1e3:.0f} ms)"
    )


async def bench(
    run_dir: Path, size: tuple[int, int], repeat: int, workers: int | None = None
) -> None:
    from pipetrace.tui.app import PipetraceApp

    t_start = time.perf_counter()
    app = PipetraceApp(run_dir, workers=workers)
    async with app.run_test(size=size) as pilot:
        t_first = time.perf_counter()
        await app.workers.wait_for_complete()
        while app.state is None or app.state.cursor is None:
            await pilot.pause(0.005)
        await pilot.pause()
        t_timeline = time.perf_counter()
        run = app.session.run
        max_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"run: {run.num_events:,} events, {run.world_size} ranks, "
            f"{len(run.iterations())} iterations; "
            f"terminal {size[0]}x{size[1]}; max RSS {max_rss_mb:.0f} MB"
        )
        print(f"first frame (loading view)      {(t_first - t_start) * 1e3:8.0f} ms")
        print(f"first timeline frame            {(t_timeline - t_start) * 1e3:8.0f} ms")
        if not repeat:
            return
        index = app.session.index
        b, e = index.iteration_span(int(index.iterations[len(index.iterations) // 2]))
        levels = [
            ("whole run", index.t_min, index.t_max),
            ("one iteration", b, e),
            ("a few steps", b + (e - b) * 0.4, b + (e - b) * 0.45),
        ]
        vp = app.state.viewport
        for label, lo, hi in levels:
            print(f"-- {label} ({(hi - lo) / 1e6:.1f} ms in view, {vp.columns} columns)")
            for name, action, _ in OPERATIONS:
                times = []
                for _ in range(repeat):
                    vp.fit(lo, hi, margin=0)
                    cursor = app.state.cursor
                    t = time.perf_counter()
                    await app.run_action(action)
                    _full_redraw(app)
                    times.append(time.perf_counter() - t)
                    app.state.cursor = cursor
                print(f"   {name:10} {_stats(times)}")
        vp.fit(*levels[1][1:], margin=0)
        print("-- Pilot key round trips (one iteration in view), minus an unbound key's")
        base = []
        for _ in range(repeat):
            t = time.perf_counter()
            await pilot.press("x")
            base.append(time.perf_counter() - t)
        floor = statistics.median(base)
        print(f"   unbound key round trip: median {floor * 1e3:.1f} ms")
        for name, _, key in OPERATIONS:
            times = []
            for _ in range(repeat):
                vp.fit(*levels[1][1:], margin=0)
                t = time.perf_counter()
                await pilot.press(key)
                times.append(max(time.perf_counter() - t - floor, 0.0))
            print(f"   {name:10} {_stats(times)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--size", default="120x40")
    parser.add_argument("--run", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument(
        "--workers", type=int, default=None, help="parsing processes (default: load_run's choice)"
    )
    parser.add_argument("--first-frame-only", action="store_true")
    args = parser.parse_args()
    run_dir = args.run or Path(tempfile.gettempdir()) / f"pipetrace-bench-tui-{args.events}"
    ensure_run(run_dir, args.events)
    width, height = (int(x) for x in args.size.split("x"))
    load_outside_the_tui(run_dir)
    asyncio.run(
        bench(run_dir, (width, height), 0 if args.first_frame_only else args.repeat, args.workers)
    )


if __name__ == "__main__":
    main()
