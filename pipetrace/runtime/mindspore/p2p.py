"""Point-to-point transfers between pipeline ranks over ``mindspore.ops.communication``
(isend/irecv on the mccl TCP backend on CPU). Same interface and recorder reports as the
torch `pipetrace.runtime.p2p.P2P`, so the shared executor drives either.

What differs from torch, measured on MindSpore 2.10 (CPU):

- **The default-group bug.** ``send``/``isend`` check the destination against
  ``get_cache_group_rank()``, whose default group was bound at import time to
  ``"hccl_world_group"``, which does not exist on CPU ("The group hccl_world_group does not
  exist"). `fix_default_group` seeds that module-level cache with this process's rank after
  ``init()``; then send/recv/isend/irecv work (4 MiB arrives bit-exact).
- **No tags, no batching.** mccl ignores tags and matches messages in posting order per pair
  of ranks (as NCCL does); lowered plans post sends and recvs in the same order on both
  sides, and the first message of a stream is preceded by its metadata on both sides too.
  ``batch_isend_irecv`` is not available on CPU, so each message is its own isend/irecv.
- **One queue per process.** PyNative runs ops in order on one asynchronous queue: a posted
  irecv holds back every op queued after it until its data arrives, and ``handle.wait()``
  returns before the data is there. Completion is therefore ``wait()`` plus a sync of the
  queue, and in overlap mode later compute waits behind a posted recv anyway: the mode
  changes when waits happen and are recorded, but on CPU a recv does not overlap compute.
  Plain mode has the same order as lowered plans assume, so neither mode can deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipetrace.recorder.hooks import RecorderHooks
from pipetrace.runtime.mindspore.stage import COMPUTE_LOCK, pynative_executor
from pipetrace.runtime.p2p_common import HEADER_LEN, P2PBookkeeping, PendingRecv, StreamMeta
from pipetrace.schedule.ir import Step

if TYPE_CHECKING:
    from mindspore import Tensor

__all__ = ["MindSporeP2P", "PendingRecv", "TensorMeta", "dtype_name", "fix_default_group"]


def fix_default_group() -> None:
    """Make ``mindspore.ops.communication`` P2P usable on CPU (call after ``init()``).

    The functions ask ``get_cache_group_rank()`` for this process's rank in the group its
    default argument names, bound at import time to ``"hccl_world_group"`` (Ascend's world
    group); on CPU the world group is ``"mccl_world_group"`` and the lookup fails. Seeding
    the cache for the import-time name with the real rank is all it takes. Idempotent.
    """
    import inspect

    from mindspore.communication import get_rank
    from mindspore.ops.function import comm_func

    default = inspect.signature(comm_func.get_cache_group_rank).parameters["group"].default
    cache = getattr(comm_func, "_GROPU_RANK_CACHE", None)  # sic: MindSpore's spelling
    if cache is not None and default not in cache:
        cache[default] = get_rank()


def dtype_name(dtype: Any) -> str:
    """A MindSpore dtype as the trace writes dtypes ("float64", "bool", ...)."""
    return str(dtype).lower().removesuffix("_")


@dataclass(frozen=True, slots=True)
class TensorMeta(StreamMeta):
    """Shape and dtype (a mindspore dtype) of the tensors on one (channel, sending stage) stream."""

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @classmethod
    def dtype_named(cls, name: str) -> Any:
        import mindspore as ms

        return getattr(ms, "bool_" if name == "bool" else name)


def _itemsize(dtype: Any) -> int:
    name = dtype_name(dtype)
    if name == "bool":
        return 1
    digits = "".join(ch for ch in name if ch.isdigit())
    return int(digits) // 8 if digits else 1


class _Work:
    """A posted isend/irecv: done once its handle is waited and the op queue has run it.

    In an OVERLAP_F_B composite the backward half waits for its recv on the overlap thread
    while the forward half computes on the main thread: the wait takes the stages' compute
    lock, as PyNative's executor is not safe for two threads."""

    __slots__ = ("_handle", "_sync")

    def __init__(self, handle: Any, sync: Any) -> None:
        self._handle = handle
        self._sync = sync

    def wait(self) -> None:
        with COMPUTE_LOCK:
            self._handle.wait()
            self._sync()


class MindSporeP2P(P2PBookkeeping):
    """Sends and receives the messages of one rank's plan (peers are world ranks, as in
    the plan: the pipeline is the whole MindSpore world)."""

    def __init__(
        self,
        *,
        num_stages: int,
        recorder: RecorderHooks,
        overlap: bool = False,
        known: dict[tuple[str, int], TensorMeta] | None = None,
    ) -> None:
        from mindspore.ops import communication

        fix_default_group()
        super().__init__(num_stages=num_stages, recorder=recorder, overlap=overlap, known=known)
        self._comm = communication
        self._sync = pynative_executor().sync

    def send(self, step: Step, tensor: Tensor, *, peer: int, channel: str) -> None:
        """Send ``tensor`` for ``step`` (SEND_F or SEND_B of stage ``step.stage``)."""
        src_stage = step.stage
        assert src_stage is not None
        key = (channel, src_stage)
        sent = TensorMeta(tuple(tensor.shape), tensor.dtype)
        meta = self._meta.get(key)
        if meta is None:
            meta = self._meta[key] = sent
            self._post_send(_int64_tensor(meta.header()), peer, None)
        else:
            self._check_stream(step, channel, sent, meta)
        self._post_send(tensor, peer, self._posted("send", step, peer, channel, meta))

    def _post_send(self, tensor: Tensor, peer: int, token: Any) -> None:
        self._sent(_Work(self._comm.isend(tensor, dst=peer), self._sync), tensor, token)

    def recv(self, step: Step, *, peer: int, channel: str, src_stage: int) -> Tensor | PendingRecv:
        """Receive the message for ``step`` (RECV_F or RECV_B) sent by stage ``src_stage``.

        Plain mode returns the tensor; overlap mode returns a `PendingRecv`.
        """
        from mindspore import ops

        key = (channel, src_stage)
        meta = self._meta.get(key)
        if meta is None:
            import mindspore as ms

            header = ops.zeros((HEADER_LEN,), ms.int64)
            _Work(self._comm.irecv(header, src=peer), self._sync).wait()
            values = [int(v) for v in header.asnumpy().tolist()]
            meta = self._meta[key] = TensorMeta.from_header(values)
        buffer = ops.zeros(meta.shape, meta.dtype)
        token = self._posted("recv", step, peer, channel, meta)
        return self._received(_Work(self._comm.irecv(buffer, src=peer), self._sync), buffer, token)


def _int64_tensor(values: list[int]) -> Tensor:
    import mindspore as ms
    import numpy as np

    return ms.Tensor(np.array(values, dtype=np.int64))
