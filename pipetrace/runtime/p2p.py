"""Point-to-point transfers between pipeline ranks over torch.distributed (gloo or NCCL).

A message is one tensor: a stage's output activation for a micro-batch (channel ``F``) or a
stage's input gradient (channel ``B``). The receiver must allocate the buffer before posting
its recv, so the first message of each (channel, sending stage) is preceded by a small
metadata tensor holding its dtype and shape; later messages reuse it. Shapes may also be
given up front (``known``), which skips the exchange. Shapes must not change between
micro-batches or iterations; the sender checks that and says so.

Two modes:

- plain: every send and recv waits where the plan puts it.
- overlap (``overlap=True``): a recv is posted at its step and returned as a `PendingRecv`,
  waited by the compute step that consumes it; sends are waited all together by `drain` at
  the end of the iteration. gloo sends complete only once the peer has posted the matching
  recv, so this is what lets a rank compute while its outgoing messages are in flight.

In both modes on gloo the executor posts each recv one message ahead (`recv_early`,
`pipetrace.runtime.recv_ahead`), so that a peer's send need not wait for this rank to reach
the RECV step; the recorder is told of it at its step (`received_early`).

Every data message is reported to the recorder when posted and when its wait returns; the
metadata messages are not (they exist only in the first iteration).

On CUDA (NCCL) ops are posted and waited on a P2P stream of the runtime's own
(`CudaP2PStreams`): NCCL's ``wait()`` makes the current stream wait, not the host, so the
recorder times each op on that stream and the compute stream waits for it before using a
received buffer. NCCL ignores tags and matches the ops between two ranks in posting order:
the runtime relies on lowered plans posting both sides in the same order (the verifier's
``fifo`` semantics; docs/runtime.md).

Fault injection (`pipetrace.runtime.inject`) sends some messages wrongly on purpose, through
`send`'s ``wire`` argument (`WireFault`): the one place that can put a message on the wire
under another message's tag, with an unchecked shape, late, or without ever waiting for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipetrace.recorder.hooks import RecorderHooks
from pipetrace.runtime.p2p_common import (
    HEADER_LEN,
    EarlyRecv,
    P2PBookkeeping,
    P2PStreams,
    PendingRecv,
    StreamMeta,
)
from pipetrace.schedule.ir import Step

__all__ = ["P2P", "PendingRecv", "TensorMeta", "WireFault"]


@dataclass(frozen=True, slots=True)
class TensorMeta(StreamMeta):
    """Shape and dtype (a ``torch.dtype``) of the tensors on one (channel, sending stage) stream."""

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @classmethod
    def dtype_named(cls, name: str) -> torch.dtype:
        return getattr(torch, name)


@dataclass(frozen=True, slots=True)
class WireFault:
    """How one data message departs from the plan on the wire (fault injection only)."""

    as_message: tuple[int, int] | None = None
    """(sending stage, micro-batch) whose tag the message carries instead of its own: the
    recv posted for that message takes it, as an order-matching transport would."""
    unchecked: bool = False
    """Send the tensor even if its shape or dtype differs from its stream's, and report
    its own shape, dtype and size."""
    delay: float = 0.0
    """Seconds between posting the send (when the recorder sees it) and the wire."""
    detached: bool = False
    """Never wait for the send (a leaked request): it stays posted, never done."""


class CudaP2PStreams:
    """The `P2PStreams` of a CUDA device: one P2P stream beside the calling thread's current
    (compute) stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def prepare(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def current(self) -> Any:
        return torch.cuda.stream(self.stream)

    def consumed(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


def p2p_streams(device: torch.device) -> P2PStreams | None:
    """`CudaP2PStreams` on a CUDA device; None elsewhere (gloo waits on the host)."""
    return CudaP2PStreams(device) if device.type == "cuda" else None


class P2P(P2PBookkeeping):
    """Sends and receives the messages of one rank's plan.

    ``peers`` maps a pipeline rank (as in the plan) to the rank to address in ``group``; the
    recorder is told pipeline ranks. Tags make each message unique within an iteration
    (gloo matches by tag; NCCL ignores tags and relies on the plan posting messages in the
    same order on both sides, which lowered plans guarantee).
    """

    def __init__(
        self,
        *,
        num_stages: int,
        device: torch.device,
        recorder: RecorderHooks,
        overlap: bool = False,
        group: dist.ProcessGroup | None = None,
        known: dict[tuple[str, int], TensorMeta] | None = None,
        streams: P2PStreams | None = None,
    ) -> None:
        """``streams``: where ops are posted and waited; by default `p2p_streams(device)`
        (tests pass fakes to check the CUDA arrangement on CPU)."""
        streams = p2p_streams(torch.device(device)) if streams is None else streams
        super().__init__(
            num_stages=num_stages, recorder=recorder, overlap=overlap, known=known, streams=streams
        )
        self.device = device
        self.group = group
        self.tag_matched = self.streams is None  # gloo matches by tag; NCCL in posting order
        self._detached: list[tuple[Any, torch.Tensor, Any]] = []  # kept alive, never waited

    def _tag(self, channel: str, src_stage: int, mb: int, meta: bool = False) -> int:
        return (((mb * self.num_stages + src_stage) << 1 | (channel == "B")) << 1) | meta

    def send(
        self,
        step: Step,
        tensor: torch.Tensor,
        *,
        peer: int,
        channel: str,
        wire: WireFault | None = None,
    ) -> None:
        """Send ``tensor`` for ``step`` (SEND_F or SEND_B of stage ``step.stage``); ``wire``
        only for fault injection."""
        src_stage, mb = step.stage, step.microbatch
        assert src_stage is not None and mb is not None
        key = (channel, src_stage)
        tensor = tensor.contiguous()
        sent = TensorMeta(tuple(tensor.shape), tensor.dtype)
        meta = self._meta.get(key)
        if meta is None:
            meta = self._meta[key] = sent
            header = torch.tensor(meta.header(), dtype=torch.int64, device=self.device)
            self._post_send(header, peer, self._tag(channel, src_stage, mb, True), None)
        elif wire is not None and wire.unchecked:
            meta = sent
        else:
            self._check_stream(step, channel, sent, meta)
        token = self._posted("send", step, peer, channel, meta)
        if wire is None:
            self._post_send(tensor, peer, self._tag(channel, src_stage, mb), token)
            return
        tag = self._tag(channel, *(wire.as_message or (src_stage, mb)))
        if wire.delay > 0:
            time.sleep(wire.delay)
        if wire.detached:
            with self.posting():
                work = dist.isend(tensor, group=self.group, group_dst=peer, tag=tag)
            self._detached.append((work, tensor, token))
        else:
            self._post_send(tensor, peer, tag, token)

    def _post_send(self, tensor: torch.Tensor, peer: int, tag: int, token: Any) -> None:
        with self.posting():
            work = dist.isend(tensor, group=self.group, group_dst=peer, tag=tag)
        self._sent(work, tensor, token)

    def recv(
        self, step: Step, *, peer: int, channel: str, src_stage: int
    ) -> torch.Tensor | PendingRecv:
        """Receive the message for ``step`` (RECV_F or RECV_B) sent by stage ``src_stage``.

        Plain mode returns the tensor; overlap mode returns a `PendingRecv`.
        """
        mb = step.microbatch
        assert mb is not None
        key = (channel, src_stage)
        meta = self._meta.get(key)
        if meta is None:
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            tag = self._tag(channel, src_stage, mb, True)
            with self.posting():
                work = dist.irecv(header, group=self.group, group_src=peer, tag=tag)
            self.complete(work, None)
            meta = self._meta[key] = TensorMeta.from_header(header.tolist())
        buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        token = self._posted("recv", step, peer, channel, meta)
        return self._received(
            self._post_recv(buffer, peer, channel, src_stage, step), buffer, token
        )

    def recv_early(
        self, step: Step, *, peer: int, channel: str, src_stage: int
    ) -> EarlyRecv | None:
        """Post the recv for ``step`` now, ahead of its step, for `received_early`; None
        while its stream's shape is not known yet (the first iteration). Only where messages
        are matched by tag (`tag_matched`): posting ahead reorders posts across streams."""
        meta = self._meta.get((channel, src_stage))
        if meta is None:
            return None
        buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        return EarlyRecv(self._post_recv(buffer, peer, channel, src_stage, step), buffer, meta)

    def _post_recv(
        self, buffer: torch.Tensor, peer: int, channel: str, src_stage: int, step: Step
    ) -> Any:
        tag = self._tag(channel, src_stage, step.microbatch)
        with self.posting():
            return dist.irecv(buffer, group=self.group, group_src=peer, tag=tag)
