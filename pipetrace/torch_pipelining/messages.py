"""Recording torch's P2P ops: which step and channel each op belongs to, its post and its
completion.

The stage's ``get_fwd_recv_ops`` / ``get_bwd_recv_ops`` / ``get_fwd_send_ops`` /
``get_bwd_send_ops`` say which (stage, micro-batch) and channel their ops are for; torch then
posts them with ``_batch_p2p`` (alone, or several together: one ``batch_isend_irecv`` when
sends and recvs are mixed) and waits the returned works later with ``_wait_batch_p2p``,
often inside another action. The ops are noted when made, reported as posted when the batch
is issued, and reported as completed when their work is waited (`MessageLog.waited`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipetrace.recorder.hooks import RecorderHooks
from pipetrace.runtime.p2p_common import P2PBookkeeping
from pipetrace.schedule.ir import Step, StepKind

_NO_STREAM: Callable[[], None] = itertools.repeat(None).__next__
"""Returns None (no device stream), without a Python frame."""

# get_*_ops method name -> (the step kind its ops belong to, channel)
OP_SOURCES: dict[str, tuple[StepKind, str]] = {
    "get_fwd_recv_ops": (StepKind.RECV_F, "F"),
    "get_bwd_recv_ops": (StepKind.RECV_B, "B"),
    "get_fwd_send_ops": (StepKind.SEND_F, "F"),
    "get_bwd_send_ops": (StepKind.SEND_B, "B"),
}


@dataclass(frozen=True, slots=True)
class Message:
    """What the ops of one ``get_*_ops`` call are: made once per plan step at install, so
    noting an op costs one dict store."""

    position: int  # the step's index in the rank's plan
    step: Step
    channel: str
    op: str  # "send" or "recv"

    @classmethod
    def of(cls, position: int, step: Step, channel: str) -> Message:
        is_send = step.kind in (StepKind.SEND_F, StepKind.SEND_B)
        return cls(position, step, channel, "send" if is_send else "recv")


@dataclass(frozen=True, slots=True)
class ReportedMeta:
    """A tensor kind as `P2PBookkeeping` reports it, computed once per (shape, dtype):
    `TensorMeta`'s size and dtype name are properties, worked out on every read."""

    shape: tuple[int, ...]
    nbytes: int
    dtype_name: str


class MessageLog(P2PBookkeeping):
    """The ops of the current iteration: noted when a stage makes them, reported when
    posted. The reports (sequence numbers per (op, peer, channel) from 0 each iteration,
    sizes, dtype names) are pipetrace's runtime's own `P2PBookkeeping`'s."""

    def __init__(self, recorder: RecorderHooks, current_stream: Callable[[], Any] | None) -> None:
        """``current_stream``: on CUDA, the function giving the stream an op is posted from
        (torch posts and waits its P2P ops on the current stream), for device timing."""
        from pipetrace.runtime.p2p import TensorMeta

        super().__init__(num_stages=0, recorder=recorder, overlap=True, known=None)
        self._current_stream = current_stream
        # The stream an op is posted from: the current one on CUDA, else None from a C-level
        # callable (this runs for every op: a Python method returning None is a frame each).
        self._post_stream = _NO_STREAM if current_stream is None else current_stream
        self._tensor_meta = TensorMeta
        self._metas: dict[tuple[Any, Any], ReportedMeta] = {}  # a message kind's few shapes
        # id(message) -> its report: torch receives into buffers made once from the shapes
        # inferred at the first step, so a message's shape and dtype are the same every
        # iteration, and its tensor's are read once (two calls into torch per op saved)
        self._message_metas: dict[int, ReportedMeta] = {}
        self.pending: dict[int, tuple[Any, Message]] = {}
        """id(op) -> (op, its message): ops made by a recorded stage, not posted yet (the op
        object is kept so that its id stays its own)."""
        # id(work) -> (work, the tokens of its ops): posted, not waited yet
        self._unwaited: dict[int, tuple[Any, list[Any]]] = {}

    def begin_iteration(self) -> None:
        """Torch makes, posts and waits every op of an iteration inside its ``step``."""
        super().begin_iteration()
        self.pending.clear()
        self._unwaited.clear()

    def post(self, ops: Sequence[Any], open_steps: bool) -> list[Any]:
        """Report ``ops`` as posted, in order; returns one recorder token per op (None for an
        op not made by a recorded stage, e.g. torch's warm-up handshake). ``open_steps``:
        each op's SEND/RECV step is opened around its post, consecutive ops of one step in
        one step (single-stage schedules have no SEND/RECV actions of their own)."""
        pending, recorder, posted = self.pending, self.recorder, self._posted
        metas = self._message_metas
        tokens: list[Any] = []
        open_step: Step | None = None
        step_token = None
        for op in ops:
            noted = pending.pop(id(op), None)
            if noted is None:
                tokens.append(None)
                continue
            message = noted[1]
            if open_steps and message.step is not open_step:
                if open_step is not None:
                    recorder.end_step(step_token)
                open_step = message.step
                step_token = recorder.begin_step(message.position, open_step)
            meta = metas.get(id(message)) or self._meta_of(op.tensor, message)
            tokens.append(posted(message.op, message.step, op.group_peer, message.channel, meta))
        if open_step is not None:
            recorder.end_step(step_token)
        return tokens

    def _meta_of(self, tensor: Any, message: Message) -> ReportedMeta:
        """The report of ``message``'s tensors, kept for its next posts; one per (shape,
        dtype) for all messages."""
        key = (tensor.shape, tensor.dtype)
        meta = self._metas.get(key)
        if meta is None:
            sized = self._tensor_meta(tuple(tensor.shape), tensor.dtype)
            meta = self._metas[key] = ReportedMeta(sized.shape, sized.nbytes, sized.dtype_name)
        self._message_metas[id(message)] = meta  # messages live as long as the log
        return meta

    def posted_works(self, works: list[Any], tokens: list[Any]) -> None:
        """``works`` came back for ops reported as ``tokens``: one per op when torch
        returned one per op, else every token on the last work (a coalesced batch completes
        as a whole)."""
        unwaited = self._unwaited
        if len(works) == len(tokens):
            for work, token in zip(works, tokens):
                if token is not None:
                    unwaited[id(work)] = (work, [token])  # the work kept: its id stays its own
            return
        live = [token for token in tokens if token is not None]
        if live and works:
            unwaited[id(works[-1])] = (works[-1], live)

    def waited(self, works: list[Any]) -> None:
        """torch's ``_wait_batch_p2p``: each work waited in turn, and the ops it carries
        reported as completed (once) as soon as it returns."""
        unwaited, recorder = self._unwaited, self.recorder
        enqueued = self._current_stream is not None  # only then has an op a device end
        for work in works:
            work.wait()
            reported = unwaited.pop(id(work), None)
            if reported is None:
                continue
            for token in reported[1]:
                if enqueued:
                    recorder.p2p_enqueued(token)  # CUDA: the current stream now waits for NCCL
                recorder.p2p_completed(token)
