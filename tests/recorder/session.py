"""A recording session in a real process, for what only real time and a real process show:
the watchdog's stall and abort, SIGUSR1 dumps and SIGTERM. Everything else is recorded by the
fake cluster (`pipetrace.testing.cluster`) on virtual time.

Two ranks (threads) run 1F1B straight through the Recorder on its real clock, aligning
clocks over queues. Scenarios: ``hang`` (rank 1 never returns from its third step: the
watchdog must end the process), ``wait`` (the same, but the test sends signals) and ``late``
(rank 1 hangs between iterations; rank 0 waits for it in the end-of-run clock exchange).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from pathlib import Path

from pipetrace.recorder.recorder import Recorder, RecorderConfig
from pipetrace.schedule.builders import build_plan
from pipetrace.schedule.ir import SEND_KINDS

STUCK_POSITION = 2


def _exchange(inboxes: dict[int, queue.Queue], me: int):
    def send_ints(peer: int, values: list[int]) -> None:
        inboxes[peer].put((me, values))

    def recv_ints(peer: int, count: int) -> list[int]:
        sender, values = inboxes[me].get(timeout=10)
        assert sender == peer and len(values) == count
        return values

    return send_ints, recv_ints


def _config(run_dir: Path, rank: int, scenario: str) -> RecorderConfig:
    # in "hang", rank 0 waits for the hung rank 1 at its end: let rank 1's watchdog act first
    return RecorderConfig(
        run_dir,
        stall_timeout=5 if scenario == "hang" and rank == 0 else 0.5,
        abort_timeout=0.5 if scenario in ("hang", "late") else 0,
        flush_interval=0.05,
    )


def record_rank(run_dir: Path, rank: int, inboxes, scenario: str) -> None:
    plan = build_plan("1f1b", num_ranks=2, num_microbatches=2, comms=True)
    recorder = Recorder(
        _config(run_dir, rank, scenario),
        framework="none",
        framework_version="0",
        clock_exchange=_exchange(inboxes, rank),
    )
    recorder.begin_run(rank=rank, world_size=2, plan=plan, config={"scenario": scenario})
    recorder.begin_iteration(0)
    for position, step in enumerate(plan.steps(rank)):
        token = recorder.begin_step(position, step)
        if step.is_comm:
            ticket = recorder.p2p_posted(
                op="send" if step.kind in SEND_KINDS else "recv",
                step=step,
                peer=1 - rank,
                channel=step.kind.value[-1],
                seq=step.microbatch,
                nbytes=64,
                shape=(4, 4),
                dtype="float32",
            )
            recorder.p2p_completed(ticket)
        if rank == 1 and position == STUCK_POSITION and scenario in ("hang", "wait"):
            if scenario == "wait":
                print("waiting", flush=True)  # the test sends signals now
            time.sleep(3600)  # the watchdog (or a signal) must end this
        recorder.end_step(token)
    recorder.end_iteration(0, 0.5 if rank == 1 else None)
    if scenario == "late" and rank == 1:  # hangs between iterations: rank 0 waits at its end
        time.sleep(3600)
    recorder.end_run()


def main(run_dir: str, scenario: str) -> None:
    inboxes = {0: queue.Queue(), 1: queue.Queue()}
    peer = threading.Thread(target=record_rank, args=(Path(run_dir), 1, inboxes, scenario))
    peer.start()
    record_rank(Path(run_dir), 0, inboxes, scenario)
    peer.join()


if __name__ == "__main__":
    main(*sys.argv[1:])
