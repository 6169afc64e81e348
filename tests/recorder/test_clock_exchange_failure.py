"""A peer that dies while this rank waits in the end-of-run clock exchange: the rank's error
there is recorded like a step's, so its log does not just stop (which reads as a rank killed
without a trace, and put the blame on it)."""

from __future__ import annotations

import pytest

from pipetrace.analyze.reader import read_log
from pipetrace.recorder import format as fmt
from pipetrace.recorder.recorder import Recorder
from pipetrace.recorder.setup import RecordSettings
from pipetrace.schedule.builders import build_plan


class _Peer:
    """Rank 0's side of the exchange as rank 1 sees it, until it dies (closes)."""

    def __init__(self) -> None:
        self.dead = False

    def send_ints(self, peer: int, values: list[int]) -> None:
        if self.dead:
            raise ConnectionResetError("Connection closed by peer")

    def recv_ints(self, peer: int, count: int) -> list[int]:
        if self.dead:
            raise ConnectionResetError("Connection closed by peer")
        return [0] * count


def test_an_error_in_the_end_of_run_exchange_is_recorded(tmp_path):
    peer = _Peer()
    recorder = Recorder(
        RecordSettings(tmp_path, stall_timeout=0),
        framework="none",
        clock_exchange=(peer.send_ints, peer.recv_ints),
    )
    plan = build_plan("1f1b", num_ranks=2, num_microbatches=2, comms=True)
    recorder.begin_run(rank=1, world_size=2, plan=plan, config={})
    recorder.begin_iteration(0)
    recorder.end_iteration(0, None)
    peer.dead = True
    with pytest.raises(ConnectionResetError):
        recorder.end_run()
    events = list(read_log(fmt.rank_log_path(tmp_path, 1))[1])
    last = events[-1]
    assert last["e"] == fmt.EXCEPTION and last["message"] == "Connection closed by peer"
    assert not [e for e in events if e["e"] == fmt.RUN_END]
