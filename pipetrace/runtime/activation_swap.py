"""The activation swap steps (SWAP_GROUP, OFFLOAD, OFFLOAD_WAIT, LOAD, LOAD_WAIT) on torch.

``SWAP_GROUP`` opens a group for one (stage, micro-batch); the executor runs that forward
under the group's ``torch.autograd.graph.saved_tensors_hooks``, so every tensor autograd saves
for the backward goes into the group and the graph holds only an index into it. Tensors whose
memory stays taken anyway stay where they are: parameters and the stage input (leaves that
require grad, and views of them), and what the rank holds until the backward (the micro-batch
input, the stage output, the target: `SwapSteps.keep`). ``OFFLOAD`` copies the other tensors
to a host buffer on a side thread (CPU: a separate buffer, so the copy and its timing are
real) or a side stream (CUDA: pinned memory); ``OFFLOAD_WAIT`` joins the copy and drops the
device tensors.
``LOAD`` copies them back the same way and ``LOAD_WAIT`` joins it; the backward then unpacks
the loaded tensors. A backward that unpacks before ``LOAD_WAIT`` fails with the group named.

Imported only by the torch backend (it imports torch).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from pipetrace.schedule.ir import Step, StepKind

Key = tuple[int, int]  # (stage, micro-batch)


def _stays(tensor: torch.Tensor) -> bool:
    """Whether a saved tensor is one the stage keeps alive anyway (a leaf that requires grad,
    such as a parameter or the stage input, or a view of one): swapping it frees nothing."""
    base = tensor._base if tensor._base is not None else tensor
    return base.requires_grad and base.is_leaf


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(slots=True)
class _Group:
    """One swap group: the tensors autograd saved, by index (None while the swapped ones are
    on the host only), and those that stay on the device (`keep`)."""

    name: str
    device: dict[int, torch.Tensor] | None = field(default_factory=dict)
    index: dict[tuple, int] = field(default_factory=dict)  # a tensor saved twice is kept once
    resident: dict[int, torch.Tensor] = field(default_factory=dict)
    moved: list[int] = field(default_factory=list)  # the indices on the host, in copy order
    host: list[torch.Tensor] | None = None
    copying: Future | None = None  # the offload or load in flight
    cuda: Any = None  # CUDA: the event the copy recorded on the side stream, and the device

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | int:
        if _stays(tensor):
            return tensor
        assert self.device is not None  # packing happens during the forward only
        key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device)
        found = self.index.get(key)
        if found is None:
            found = self.index[key] = len(self.index)
            self.device[found] = tensor
        return found

    def unpack(self, handle: torch.Tensor | int) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            return handle
        if self.device is None:
            raise RuntimeError(f"the backward of {self.name} ran before its LOAD_WAIT")
        return self.device[handle]

    def keep(self, held: tuple[torch.Tensor | None, ...]) -> None:
        """Saved tensors whose memory the rank holds anyway (its micro-batch input, its output,
        the target) stay: copying them would free nothing."""
        assert self.device is not None
        pointers = {t.data_ptr() for t in held if t is not None}
        self.resident = {i: t for i, t in self.device.items() if t.data_ptr() in pointers}
        self.index.clear()  # the forward is over

    def to_move(self) -> list[torch.Tensor]:
        """The tensors an offload copies (and the order a load gives them back in)."""
        assert self.device is not None
        self.moved = [i for i in self.device if i not in self.resident]
        return [self.device[i] for i in self.moved]

    def loaded(self, tensors: list[torch.Tensor]) -> None:
        self.device = {**self.resident, **dict(zip(self.moved, tensors))}


class SwapSteps:
    """Handlers for the swap step kinds over one rank's stages, with one side thread (and on
    CUDA one side stream) for the copies."""

    def __init__(self, thread_initializer: Callable[[], None]) -> None:
        self._initializer = thread_initializer
        self._pool: ThreadPoolExecutor | None = None
        self._stream: Any = None
        self._groups: dict[Key, _Group] = {}
        self.capturing: dict[Key, saved_tensors_hooks] = {}
        """Open groups whose forward has not run: the executor pops one around a forward."""

    def keep(self, stage: int, mb: int, held: tuple[torch.Tensor | None, ...]) -> None:
        """After the group's forward: the tensors the rank holds anyway (see `_Group.keep`)."""
        self._groups[(stage, mb)].keep(held)

    def handlers(self) -> dict[StepKind, Callable[[int, Step], int | None]]:
        return {
            StepKind.SWAP_GROUP: self.open,
            StepKind.OFFLOAD: self.offload,
            StepKind.OFFLOAD_WAIT: self.offload_wait,
            StepKind.LOAD: self.load,
            StepKind.LOAD_WAIT: self.load_wait,
        }

    def begin_iteration(self) -> None:
        self._groups.clear()
        self.capturing.clear()

    def swapped_bytes(self) -> dict[int, int]:
        """Per stage, the bytes of its groups that are on the host only (offloaded and
        waited, not yet loaded back and waited): device memory the swap has freed."""
        swapped: dict[int, int] = {}
        for (stage, _), group in self._groups.items():
            if group.device is None and group.host is not None:
                swapped[stage] = swapped.get(stage, 0) + _nbytes(group.host)
        return swapped

    def unfinished(self) -> list[str]:
        """The groups opened and not loaded back: problems at the end of an iteration."""
        return [group.name for group in self._groups.values()]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- the handlers ----------------------------------------------------------------------

    def open(self, position: int, step: Step) -> None:
        key = (step.stage, step.microbatch)
        group = self._groups[key] = _Group(str(step))  # type: ignore[index]
        self.capturing[key] = saved_tensors_hooks(group.pack, group.unpack)  # type: ignore[index]

    def offload(self, position: int, step: Step) -> int:
        group = self._group(step)
        tensors = group.to_move()
        group.copying = self._copy(group, tensors, to_host=True)
        return _nbytes(tensors)

    def offload_wait(self, position: int, step: Step) -> None:
        group = self._group(step)
        group.host = self._join(group)
        group.device = None  # the device memory is free from here on

    def load(self, position: int, step: Step) -> int:
        group = self._group(step)
        assert group.host is not None
        group.copying = self._copy(group, group.host, to_host=False)
        return _nbytes(group.host)

    def load_wait(self, position: int, step: Step) -> None:
        group = self._groups.pop((step.stage, step.microbatch))  # type: ignore[arg-type]
        group.loaded(self._join(group))
        group.host = None

    # -- copies ----------------------------------------------------------------------------

    def _group(self, step: Step) -> _Group:
        return self._groups[(step.stage, step.microbatch)]  # type: ignore[index]

    def _copy(self, group: _Group, tensors: list[torch.Tensor], *, to_host: bool) -> Future:
        if (tensors and tensors[0].is_cuda) or (not to_host and group.cuda is not None):
            return self._copy_cuda(group, tensors, to_host=to_host)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                1, thread_name_prefix="pipetrace-swap", initializer=self._initializer
            )
        return self._pool.submit(_clones, tensors)

    def _copy_cuda(self, group: _Group, tensors: list[torch.Tensor], *, to_host: bool) -> Future:
        """The copy on the side stream, after the compute enqueued so far; the future holds
        the copies at once (they are valid on the device once ``group.cuda`` is waited)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        compute = torch.cuda.current_stream()
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            if to_host:
                copies = [
                    torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                    for t in tensors
                ]
                group.cuda = (self._stream.record_event(), tensors[0].device)
            else:
                copies = [t.to(group.cuda[1], non_blocking=True) for t in tensors]
                group.cuda = (self._stream.record_event(), group.cuda[1])
        for tensor in tensors if to_host else copies:
            tensor.record_stream(self._stream if to_host else compute)
        done: Future = Future()
        done.set_result(copies)
        return done

    def _join(self, group: _Group) -> list[torch.Tensor]:
        assert group.copying is not None
        copies = group.copying.result()
        group.copying = None
        if group.cuda is not None:
            torch.cuda.current_stream().wait_event(group.cuda[0])
        return copies


def _clones(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies in separate buffers (the CPU stand-in for a host <-> device copy)."""
    with torch.no_grad():
        return [t.detach().clone() for t in tensors]
