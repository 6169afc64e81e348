"""What the torch and MindSpore P2P classes share: the bookkeeping of a rank's messages and
what the recorder is told about them. Framework-free; a backend supplies the wire (posting
an isend / irecv, its work handle's ``wait``) and its tensors of the header's integers.

Per (channel, sending stage) stream, the first message is preceded by its shape and dtype
(or they are given up front) and later messages must match them. Each data message is
reported to the recorder when posted, with its sequence number per (op, peer, channel)
from 0 each iteration, and again when its wait returns.

On a device whose transport waits on streams (CUDA with NCCL), a backend gives `P2PStreams`:
ops are posted and waited on a P2P stream of the runtime's own, so that the recorder can
time them on the device there (``p2p_posted(stream=...)``, then ``p2p_enqueued`` once the
wait is enqueued), and the compute stream waits for that stream before a received buffer is
used (docs/device-timing.md, "Where it is wired", item 4).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

from pipetrace.recorder.hooks import RecorderHooks
from pipetrace.schedule.ir import Step

# The stream header, the metadata message that precedes a stream's first message: the dtype's
# code (its index here, by the trace's dtype names), the number of dims, the dims, zero-padded.
DTYPE_NAMES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "complex64",
    "complex128",
)
MAX_DIMS = 8
HEADER_LEN = 2 + MAX_DIMS


class Work(Protocol):
    def wait(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class StreamMeta:
    """Shape and dtype of the tensors on one (channel, sending stage) stream; a backend
    subclass says how big an element is and how the trace names the dtype."""

    shape: tuple[int, ...]
    dtype: Any

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def itemsize(self) -> int:
        raise NotImplementedError

    @property
    def dtype_name(self) -> str:
        raise NotImplementedError

    @classmethod
    def dtype_named(cls, name: str) -> Any:
        """The backend's dtype that the trace calls ``name``."""
        raise NotImplementedError

    def header(self) -> list[int]:
        """The ``HEADER_LEN`` integers announcing this stream (sent as an int64 tensor)."""
        if len(self.shape) > MAX_DIMS:
            raise RuntimeError(
                f"cannot send a {len(self.shape)}-dim tensor; at most {MAX_DIMS} dims"
            )
        if self.dtype_name not in DTYPE_NAMES:
            raise RuntimeError(
                f"cannot send dtype {self.dtype_name}; supported: {', '.join(DTYPE_NAMES)}"
            )
        values = [DTYPE_NAMES.index(self.dtype_name), len(self.shape), *self.shape]
        return values + [0] * (HEADER_LEN - len(values))

    @classmethod
    def from_header(cls, values: list[int]) -> StreamMeta:
        """The stream a received `header` announces."""
        ndim = values[1]
        return cls(tuple(values[2 : 2 + ndim]), cls.dtype_named(DTYPE_NAMES[values[0]]))


class P2PStreams(Protocol):
    """Where a device backend posts and waits P2P ops (CUDA: a stream of the runtime's own,
    since NCCL's internal stream is not exposed and its ``wait()`` makes the *current* stream
    wait, not the host)."""

    stream: Any
    """The P2P stream, for the recorder's device timing."""

    def prepare(self) -> None:
        """Before a post: the P2P stream waits for the work queued so far on the compute
        stream (which produced the tensor to send, or last used the buffer to fill)."""

    def current(self) -> AbstractContextManager[Any]:
        """The P2P stream as the current stream, for posting and for enqueuing waits."""

    def consumed(self) -> None:
        """The compute stream waits for the P2P stream (before a received buffer is used,
        or a sent one is released)."""


@dataclass(frozen=True, slots=True)
class EarlyRecv:
    """A data recv posted ahead of its step (`pipetrace.runtime.recv_ahead`), not yet told
    to the recorder: `P2PBookkeeping.received_early` reports it when its step takes it."""

    work: Work
    buffer: Any
    meta: StreamMeta


class PendingRecv:
    """A posted recv (overlap mode); `wait` returns the received tensor (once) and reports
    completion."""

    __slots__ = ("_buffer", "_owner", "_token", "_work")

    def __init__(self, work: Work, buffer: Any, token: Any, owner: P2PBookkeeping) -> None:
        self._work = work
        self._buffer = buffer
        self._token = token
        self._owner = owner

    def wait(self) -> Any:
        self._owner.complete(self._work, self._token)
        return self._buffer

    @property
    def nbytes(self) -> int:
        """The size of the buffer the recv fills (the memory it holds already)."""
        return self._buffer.nbytes


class P2PBookkeeping:
    """Stream metadata, sequence numbers, recorder reports and the sends in flight."""

    tag_matched = False
    """Whether the transport matches each recv to its send by tag, whatever the posting
    order (gloo), so that recvs may be posted ahead of their steps (`recv_early`); False
    where ops between two ranks match in posting order (NCCL, MindSpore's mccl)."""

    def __init__(
        self,
        *,
        num_stages: int,
        recorder: RecorderHooks,
        overlap: bool,
        known: dict[tuple[str, int], StreamMeta] | None,
        streams: P2PStreams | None = None,
    ) -> None:
        self.num_stages = num_stages
        self.recorder = recorder
        self.streams = streams
        self.overlap = overlap
        self._meta: dict[tuple[str, int], StreamMeta] = dict(known or {})
        self._seq: dict[tuple[str, int, str], int] = {}
        self._sends: list[tuple[Work, Any, Any]] = []  # (work, tensor kept alive, token)

    def begin_iteration(self) -> None:
        self._seq.clear()

    def stream_meta(self, channel: str, src_stage: int) -> StreamMeta | None:
        """Shape and dtype of the (channel, sending stage) stream, once known."""
        return self._meta.get((channel, src_stage))

    def _check_stream(self, step: Step, channel: str, sent: StreamMeta, stream: StreamMeta) -> None:
        if sent.shape != stream.shape or sent.dtype != stream.dtype:
            raise RuntimeError(
                f"{step}: stage {step.stage} {'output' if channel == 'F' else 'input gradient'} "
                f"is {sent.shape} {sent.dtype_name}, but earlier messages were "
                f"{stream.shape} {stream.dtype_name}; shapes are exchanged once, so every "
                "micro-batch must have the same shape (build a new runner for a new shape)"
            )

    def _posted(self, op: str, step: Step, peer: int, channel: str, meta: StreamMeta) -> Any:
        """Report a data message as posted; returns the recorder's token for its completion."""
        key = (op, peer, channel)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        return self.recorder.p2p_posted(
            op=op,
            step=step,
            peer=peer,
            channel=channel,
            seq=seq,
            nbytes=meta.nbytes,
            shape=meta.shape,
            dtype=meta.dtype_name,
            stream=self._post_stream(),
        )

    def _post_stream(self) -> Any:
        """The stream an op is posted from, for the recorder's device timing (None: host
        times only); with P2P streams, that stream once it has waited for the compute stream."""
        streams = self.streams
        if streams is None:
            return None
        streams.prepare()
        return streams.stream

    def posting(self) -> AbstractContextManager[Any]:
        """Where isend/irecv are issued: on the P2P stream when there is one, once it has
        waited for the compute stream (a metadata message is not `_posted`)."""
        streams = self.streams
        if streams is None:
            return nullcontext()
        streams.prepare()
        return streams.current()

    def complete(self, work: Work, token: Any) -> None:
        """Wait for ``work`` and report it (``token`` None: a metadata message, unreported).
        With P2P streams the wait is enqueued on the P2P stream, the recorder marks the op's
        device end there, and the compute stream then waits for the P2P stream."""
        streams = self.streams
        if streams is None:
            work.wait()
        else:
            with streams.current():
                work.wait()
            if token is not None:
                self.recorder.p2p_enqueued(token)
            streams.consumed()
        if token is not None:
            self.recorder.p2p_completed(token)

    def _sent(self, work: Work, tensor: Any, token: Any) -> None:
        """A send was posted: wait now (plain mode), or at `drain` (overlap). ``token`` is
        None for a metadata message, which the recorder does not see."""
        if self.overlap:
            self._sends.append((work, tensor, token))
            return
        self.complete(work, token)

    def _received(self, work: Work, buffer: Any, token: Any) -> Any:
        """A recv was posted: the tensor (plain mode) or a `PendingRecv` (overlap)."""
        if self.overlap:
            return PendingRecv(work, buffer, token, self)
        self.complete(work, token)
        return buffer

    def received_early(self, early: EarlyRecv, step: Step, peer: int, channel: str) -> Any:
        """What `recv` returns, for a recv posted ahead: the recorder is told of it now, at
        its own RECV step, as if posted there, so the trace reads as if each recv were
        posted at its step (plain mode: posted and done inside it)."""
        token = self._posted("recv", step, peer, channel, early.meta)
        return self._received(early.work, early.buffer, token)

    def drain(self) -> None:
        """Wait for every send still in flight (overlap mode); called at iteration end."""
        sends, self._sends = self._sends, []
        for work, _tensor, token in sends:
            self.complete(work, token)
