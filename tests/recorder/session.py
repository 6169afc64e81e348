"""A small recording session driven straight through the Recorder (no framework, no runtime).

Run as a script so that tests can watch real processes end: by the watchdog (``hang`` in a
step, ``late`` at the end-of-run clock exchange), by a signal (``wait``) or cleanly
(``clean``). Two ranks run as threads and align clocks over queues.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from pathlib import Path

from pipetrace.recorder.recorder import Recorder
from pipetrace.recorder.setup import RecordSettings
from pipetrace.schedule.builders import build_plan


def _exchange(inboxes: dict[int, queue.Queue], me: int):
    def send_ints(peer: int, values: list[int]) -> None:
        inboxes[peer].put((me, values))

    def recv_ints(peer: int, count: int) -> list[int]:
        sender, values = inboxes[me].get(timeout=10)
        assert sender == peer and len(values) == count
        return values

    return send_ints, recv_ints


def record_rank(run_dir: Path, rank: int, inboxes, scenario: str, mode: str) -> None:
    plan = build_plan("1f1b", num_ranks=2, num_microbatches=2, comms=True)
    recorder = Recorder(
        # in "hang", rank 0 waits for the hung rank 1 at its end: let rank 1's watchdog act first
        RecordSettings(
            run_dir,
            mode=mode,
            stall_timeout=5 if scenario == "hang" and rank == 0 else 0.5,
            abort_timeout=0.5 if scenario in ("hang", "late") else 0,
            flush_interval=0.05,
        ),
        framework="none",
        framework_version="0",
        clock_exchange=_exchange(inboxes, rank),
    )
    recorder.begin_run(rank=rank, world_size=2, plan=plan, config={"scenario": scenario})
    recorder.begin_iteration(0)
    for position, step in enumerate(plan.steps(rank)):
        token = recorder.begin_step(position, step)
        if step.is_comm:
            op = "send" if step.kind.value.startswith("SEND") else "recv"
            ticket = recorder.p2p_posted(
                op=op,
                step=step,
                peer=1 - rank,
                channel=step.kind.value[-1],
                seq=step.microbatch,
                nbytes=64,
                shape=(4, 4),
                dtype="float32",
            )
            recorder.p2p_completed(ticket)
        if scenario == "hang" and rank == 1 and position == 2:
            time.sleep(3600)  # the watchdog must end this
        if scenario == "wait" and rank == 1 and position == 2:
            print("waiting", flush=True)
            time.sleep(3600)  # the test sends signals now
        recorder.end_step(token)
    recorder.end_iteration(0, 0.5 if rank == 1 else None)
    if scenario == "late" and rank == 1:  # hangs between iterations: rank 0 waits at its end
        time.sleep(3600)
    if scenario == "crash":  # rank 1 fails; rank 0 is left without a clean end
        if rank == 1:
            try:
                raise RuntimeError("injected failure")
            except RuntimeError as exc:
                recorder.exception(exc)
        recorder.close()
        return
    recorder.end_run()


def main(run_dir: str, scenario: str, mode: str = "steps") -> None:
    inboxes = {0: queue.Queue(), 1: queue.Queue()}
    threads = [
        threading.Thread(target=record_rank, args=(Path(run_dir), r, inboxes, scenario, mode))
        for r in (1,)
    ]
    for t in threads:
        t.start()
    record_rank(Path(run_dir), 0, inboxes, scenario, mode)
    for t in threads:
        t.join()


if __name__ == "__main__":
    main(*sys.argv[1:])
