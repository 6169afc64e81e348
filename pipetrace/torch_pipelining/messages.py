"""Recording torch's P2P ops: which step and channel each op belongs to, its post and its
completion.

The stage's ``get_fwd_recv_ops`` / ``get_bwd_recv_ops`` / ``get_fwd_send_ops`` /
``get_bwd_send_ops`` say which (stage, micro-batch) and channel their ops are for; torch then
posts them with ``_batch_p2p`` (alone, or several together: one ``batch_isend_irecv`` when
sends and recvs are mixed) and waits the returned works later, often inside another action.
The ops are noted when made, reported as posted when the batch is issued, and each returned
work is wrapped so that its ``wait`` reports the completion.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pipetrace.recorder.hooks import RecorderHooks
from pipetrace.runtime.p2p_common import P2PBookkeeping
from pipetrace.schedule.ir import Step, StepKind

# get_*_ops method name -> (the step kind its ops belong to, channel)
OP_SOURCES: dict[str, tuple[StepKind, str]] = {
    "get_fwd_recv_ops": (StepKind.RECV_F, "F"),
    "get_bwd_recv_ops": (StepKind.RECV_B, "B"),
    "get_fwd_send_ops": (StepKind.SEND_F, "F"),
    "get_bwd_send_ops": (StepKind.SEND_B, "B"),
}


class RecordedWork:
    """A torch ``Work`` whose ``wait`` also reports its ops as completed (once)."""

    __slots__ = ("_recorder", "_tokens", "_work")

    def __init__(self, work: Any, tokens: list[Any], recorder: RecorderHooks) -> None:
        self._work = work
        self._tokens = tokens
        self._recorder = recorder

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        tokens, self._tokens = self._tokens, []
        recorder = self._recorder
        for token in tokens:
            recorder.p2p_enqueued(token)  # CUDA: the current stream now waits for NCCL
            recorder.p2p_completed(token)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


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
        self._tensor_meta = TensorMeta
        self._metas: dict[tuple[tuple[int, ...], Any], Any] = {}  # a message kind's few shapes
        self._pending: dict[int, tuple[Any, Step, int, str]] = {}  # id(op) -> (op, step, pos, ch)

    def begin_iteration(self) -> None:
        super().begin_iteration()
        self._pending.clear()

    def _post_stream(self) -> Any:
        current_stream = self._current_stream
        return None if current_stream is None else current_stream()

    def note(self, ops: Sequence[Any], step: Step, position: int, channel: str) -> None:
        """``ops`` were made for ``step``; the op object is kept so its id stays unique."""
        for op in ops:
            self._pending[id(op)] = (op, step, position, channel)

    def post(self, ops: Sequence[Any], on_step: Callable[[int, Step], None] | None) -> list[Any]:
        """Report ``ops`` as posted, in order; returns one recorder token per op (None for an
        op not made by a recorded stage, e.g. torch's warm-up handshake). ``on_step`` is
        told each op's step first (single-stage schedules open SEND/RECV steps there)."""
        tokens = []
        for op in ops:
            noted = self._pending.pop(id(op), None)
            if noted is None:
                tokens.append(None)
                continue
            _, step, position, channel = noted
            if on_step is not None:
                on_step(position, step)
            tokens.append(self._report(op, step, channel))
        return tokens

    def _report(self, op: Any, step: Step, channel: str) -> Any:
        kind = "send" if step.kind in (StepKind.SEND_F, StepKind.SEND_B) else "recv"
        tensor = op.tensor
        shape = tuple(tensor.shape)
        meta = self._metas.get((shape, tensor.dtype))
        if meta is None:
            meta = self._metas[(shape, tensor.dtype)] = self._tensor_meta(shape, tensor.dtype)
        return self._posted(kind, step, op.group_peer, channel, meta)

    def wrap_works(self, works: list[Any], tokens: list[Any]) -> list[Any]:
        """Works that report completion when waited: one per op when torch returned one per
        op, else every token on the last work (a coalesced batch completes as a whole)."""
        if not any(token is not None for token in tokens) or not works:
            return works
        if len(works) == len(tokens):
            return [
                work if token is None else RecordedWork(work, [token], self.recorder)
                for work, token in zip(works, tokens)
            ]
        live = [token for token in tokens if token is not None]
        return [*works[:-1], RecordedWork(works[-1], live, self.recorder)]
