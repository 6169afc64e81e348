"""Cache lines each hot call of the recorder (and its flush) touches cold, counted by valgrind.

    .venv/bin/python bench/count_recorder_lines.py [--calls N] [--baseline REV]

In the recorded demo a hot call runs after a step's framework work or a blocking recv, with
its code and data evicted from the caches: it costs about one memory latency per distinct
cache line it touches, not its instructions (docs/performance.md, "Recorder"). Timings in
situ move by a point from run to run; these counts do not. Each hot call runs ``--calls``
times under callgrind's cache simulation (L1 32 KiB, last level 1 MiB: this machine's L2),
with a 3 MiB sweep before each call so that it starts cold, collecting inside the call only
(``--toggle-collect``). Per call it prints the instructions and the cache lines missed:
code, data read, data written; every miss of the last level is a line the call touched.

- ``next_step``: the executor's one call between two steps (a step's end, a memory sample
  of the watched counts that differs from the last, the next step's begin);
- ``p2p``: a ``p2p_posted`` and its ``p2p_completed``, a sweep between them (a plain-mode
  op: posted, then waited for);
- ``flush``: the queue's ``write`` of two iterations of the rank's events (its 48 steps
  each, their memory samples and P2P ops, the iterations' begin and end), the bench's
  closing flush of a block (`bench/bench_recorder.py`); per call, one flush.

``--baseline REV`` counts REV's recorder too (its tree checked out and built in a temporary
directory), the two side by side. Needs valgrind and a C compiler; takes ~1 minute a tree
(the flush most of it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CALLS = {
    "next_step": ("next_step",),
    "p2p": ("p2p_posted", "p2p_completed"),
    "flush": ("write_lines",),
}
OPS = {"SEND_F": "send", "SEND_B": "send", "RECV_F": "recv", "RECV_B": "recv"}
COLUMNS = ("Ir", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")
ROOT = Path(__file__).resolve().parent.parent


def drive(which: str, calls: int) -> None:
    """The child: ``calls`` cold calls of ``which`` on a recorder of the 1F1B demo's rank 1."""
    import numpy as np

    from pipetrace.recorder import recorder as recorder_module
    from pipetrace.recorder.recorder import Recorder
    from pipetrace.recorder.setup import RecordSettings
    from pipetrace.schedule.builders import build_plan

    plan = build_plan("1f1b", num_ranks=4, num_microbatches=8, comms=True)
    steps = plan.steps(1)
    sweep = np.zeros(3 << 20, dtype=np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(RecordSettings(Path(tmp), stall_timeout=0))
        recorder.begin_run(rank=1, world_size=4, plan=plan, config={})
        recorder.begin_iteration(1)
        held, act, grad = [{}], [0], [0]
        recorder.memory_watch(held, act, grad)
        if which == "flush":  # only the flush measured writes: no iteration end's own
            recorder_module.ITERATION_FLUSH_SPACING_NS = 1 << 62
            recorder.end_iteration(1, None)
            for call in range(calls):
                record_iterations(recorder, steps, held, act, range(2 + 2 * call, 4 + 2 * call))
                sweep += 1
                recorder.flush()
            recorder.end_run()
            return
        token = None
        for i in range(calls):
            sweep += 1
            step = steps[i % len(steps)]
            held[0][i % 4] = 16384 if i % 2 else 0  # a sample that differs from the last
            act[0] = (i % 3) * 4096
            if which == "next_step":
                token = recorder.next_step(token, True, i % len(steps), step)
            else:
                post = recorder.p2p_posted(
                    op="recv", step=step, peer=0, channel="F", seq=i, nbytes=4096,
                    shape=(32, 128), dtype="float32", stream=None,
                )  # fmt: skip
                sweep += 1
                recorder.p2p_completed(post)
            if i % 20 == 19:
                recorder.flush()
        recorder.end_run()


def record_iterations(recorder, steps, held, act, iterations: range) -> None:
    """The ``iterations`` of rank 1's events as the executor and its P2P layer make them: a
    `next_step` between two steps (a memory sample after each but the sends), a P2P op
    posted and completed inside each send and recv step."""
    for iteration in iterations:
        recorder.begin_iteration(iteration)
        token, sampled = None, False
        for position, step in enumerate(steps):
            token = recorder.next_step(token, sampled, position, step)
            if step.kind in OPS:
                post = recorder.p2p_posted(
                    op=OPS[step.kind], step=step, peer=0 if "F" in step.kind else 2,
                    channel=step.kind[-1], seq=step.microbatch, nbytes=16384,
                    shape=(32, 128), dtype="float32", stream=None,
                )  # fmt: skip
                recorder.p2p_completed(post)
            if step.kind == "F":
                held[0][step.microbatch] = 65536
            elif step.kind == "B":
                held[0].pop(step.microbatch, None)
            act[0] = 16384 if step.kind == "RECV_F" else 0
            sampled = not step.kind.startswith("SEND")
        recorder.end_step(token)
        recorder.end_iteration(iteration, 0.6931471805599453)


def count(tree: Path, which: str, calls: int, out: Path) -> dict[str, float]:
    """Callgrind's totals inside the hot call(s), per call, for the recorder of ``tree``."""
    path = out / f"callgrind.{which}"
    toggles = [f"--toggle-collect={name}" for name in CALLS[which]]
    subprocess.run(
        ["valgrind", "--tool=callgrind", "--cache-sim=yes", "--I1=32768,8,64"]
        + ["--D1=32768,8,64", "--LL=1048576,16,64", "--collect-atstart=no", *toggles]
        + [f"--callgrind-out-file={path}", sys.executable, __file__, "--child", which]
        + [str(calls)],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )
    events = summary = None
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("summary:") or line.startswith("totals:"):
            summary = [int(v) for v in line.split()[1:]]
    if events is None or summary is None:
        raise SystemExit(f"error: no totals in {path}")
    totals = dict(zip(events, summary, strict=False))
    return {name: totals.get(name, 0) / calls for name in COLUMNS}


def checkout(revision: str, into: Path) -> Path:
    """``revision``'s tree, its C extensions built in place."""
    tree = into / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), revision],
                   check=True, capture_output=True)  # fmt: skip
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                   cwd=tree, check=True, capture_output=True)  # fmt: skip
    return tree


def report(label: str, per_call: dict[str, float]) -> None:
    code, read, written = per_call["ILmr"], per_call["DLmr"], per_call["DLmw"]
    print(
        f"  {label:<24} {per_call['Ir']:7.0f} instructions, lines touched cold: "
        f"{code:5.1f} code + {read:5.1f} data read + {written:5.1f} written = "
        f"{code + read + written:5.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100, help="cold calls of each (100)")
    parser.add_argument("--baseline", metavar="REV", help="count REV's recorder too")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        drive(args.child[0], int(args.child[1]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": ROOT}
        if args.baseline:
            trees[args.baseline] = checkout(args.baseline, Path(tmp))
        try:
            for which in CALLS:
                print(f"{which}, per call ({args.calls} calls, each after a 3 MiB sweep):")
                for label, tree in trees.items():
                    report(label, count(tree, which, args.calls, Path(tmp)))
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(trees[args.baseline])], capture_output=True)  # fmt: skip


if __name__ == "__main__":
    main()
