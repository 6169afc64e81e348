"""The CUDA P2P stream arrangement (docs/device-timing.md, hook point 4), checked on CPU with
fake streams: ops are posted and waited on the P2P stream, the recorder times them there,
and the compute stream waits for it before a received buffer is used."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import pytest
import torch

from pipetrace.runtime.p2p import TensorMeta
from pipetrace.runtime.p2p_common import P2PBookkeeping
from pipetrace.schedule.ir import parse_step

META = TensorMeta((4, 4), torch.float32)


class Log(list):
    """What happened, in order, as (who, what) pairs."""


class FakeStreams:
    stream = "p2p-stream"

    def __init__(self, log: Log) -> None:
        self.log = log
        self.current_is_p2p = False

    def prepare(self) -> None:
        self.log.append(("p2p stream", "waits for compute"))

    @contextmanager
    def current(self):
        self.current_is_p2p = True
        yield
        self.current_is_p2p = False

    def consumed(self) -> None:
        self.log.append(("compute stream", "waits for p2p"))


class FakeWork:
    def __init__(self, log: Log, streams: FakeStreams) -> None:
        self.log, self.streams = log, streams

    def wait(self) -> None:
        where = "p2p stream" if self.streams.current_is_p2p else "compute stream"
        self.log.append((where, "waits for the transfer"))


class LoggingRecorder:
    def __init__(self, log: Log) -> None:
        self.log = log

    def p2p_posted(self, *, stream: Any = None, **fields: Any) -> int:
        self.log.append(("recorder", f"posted on {stream}"))
        return 7

    def p2p_enqueued(self, token: Any) -> None:
        self.log.append(("recorder", f"enqueued {token}"))

    def p2p_completed(self, token: Any) -> None:
        self.log.append(("recorder", f"completed {token}"))


class FakeWireP2P(P2PBookkeeping):
    """A backend whose wire is `FakeWork`, posting as the torch backend does."""

    def __init__(self, log: Log, streams: FakeStreams | None, overlap: bool) -> None:
        recorder = LoggingRecorder(log)
        super().__init__(
            num_stages=2, recorder=recorder, overlap=overlap, known=None, streams=streams
        )
        self.log, self.wire = log, streams or FakeStreams(log)

    def send(self, text: str, peer: int) -> None:
        token = self._posted("send", parse_step(text), peer, "F", META)
        with self.posting():
            work = FakeWork(self.log, self.wire)
        self._sent(work, "tensor", token)

    def recv(self, text: str, peer: int) -> Any:
        token = self._posted("recv", parse_step(text), peer, "F", META)
        with self.posting():
            work = FakeWork(self.log, self.wire)
        return self._received(work, "buffer", token)


def bookkeeping(overlap: bool) -> tuple[FakeWireP2P, Log]:
    log = Log()
    return FakeWireP2P(log, FakeStreams(log), overlap), log


@pytest.mark.parametrize("overlap", [False, True])
def test_a_recv_is_timed_on_the_p2p_stream_and_the_compute_stream_waits_for_it(overlap):
    p2p, log = bookkeeping(overlap)
    received = p2p.recv("1RECV_F0", 0)
    if overlap:
        received = received.wait()
    assert received == "buffer"
    assert log == [
        ("p2p stream", "waits for compute"),  # the buffer's last use is done
        ("recorder", "posted on p2p-stream"),  # device begin on the P2P stream
        ("p2p stream", "waits for compute"),  # posting()
        ("p2p stream", "waits for the transfer"),  # NCCL's wait lands on the P2P stream
        ("recorder", "enqueued 7"),  # device end, after that wait
        ("compute stream", "waits for p2p"),  # before the buffer is used
        ("recorder", "completed 7"),
    ]


def test_sends_drained_at_iteration_end_are_waited_on_the_p2p_stream():
    p2p, log = bookkeeping(overlap=True)
    p2p.send("0SEND_F0", 1)
    p2p.drain()
    assert log[-4:] == [
        ("p2p stream", "waits for the transfer"),
        ("recorder", "enqueued 7"),
        ("compute stream", "waits for p2p"),
        ("recorder", "completed 7"),
    ]


def test_without_streams_nothing_changes():
    log = Log()
    FakeWireP2P(log, None, overlap=False).send("0SEND_F0", 1)
    assert log == [
        ("recorder", "posted on None"),
        ("compute stream", "waits for the transfer"),
        ("recorder", "completed 7"),
    ]
