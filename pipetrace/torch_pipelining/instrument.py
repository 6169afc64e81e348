"""Patching one torch schedule object (and the two module functions its loops call) so that
every action, message and iteration reaches pipetrace's recorder.

What is patched, and only while recording:

- ``schedule.step`` (on the instance): one call is one iteration; the loss of the last stage.
  A call with no backward (``schedule.eval``, which calls ``step``) takes every patch off
  while it runs torch's own code, and is no iteration.
- each of the schedule's stages (on the instance): ``get_*_ops`` note which step and channel
  their ops belong to; ``forward_one_chunk`` / ``backward_one_chunk`` /
  ``backward_weight_one_chunk`` / ``perform_reduce_grad`` are steps of single-stage
  schedules and the sub-steps of an ``OVERLAP_F_B`` action.
- ``schedules._batch_p2p``: the ops a batch carries are posted.
- ``schedules._wait_batch_p2p`` (every wait of a P2P work in torch's schedules): the ops a
  work carries complete as it returns.
- ``schedules.record_function``: `_PipelineScheduleRuntime` wraps every action it performs in
  ``record_function("PP:<action>")``; the same range is kept (through the fast C++
  RecordFunction), and it is the action's step.

Undo restores every original: a schedule that is no longer recorded runs torch's own code.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

from pipetrace.recorder.hooks import Place, RecorderHooks
from pipetrace.schedule.ir import Plan, StepKind
from pipetrace.torch_pipelining.messages import OP_SOURCES, Message, MessageLog
from pipetrace.torch_pipelining.steps import Entry, Key, StepIndex

_ACTION_PREFIX = "PP:"
_MISSING = object()
_active_lock = threading.Lock()
_active: list[Instrumentation] = []  # at most one: the module functions are process-wide


def stages_of(schedule: Any) -> list[Any]:
    from torch.distributed.pipelining import schedules

    if isinstance(schedule, schedules.PipelineScheduleSingle):
        return [schedule._stage]
    return list(schedule._stages)


def forward_only(schedule: Any) -> bool:
    """Whether ``schedule`` runs forwards only (built with no ``loss_fn``): its steps are
    not the plan's, which has backwards, so it is not recorded."""
    return getattr(schedule, "_has_backward", True) is False


def device_of(schedule: Any) -> Any:
    """The torch device this rank's stages run on (for device timing on CUDA)."""
    return stages_of(schedule)[0].device


def _stream_getter(device: Any) -> Callable[[], Any] | None:
    """On CUDA, the current-stream function for ``device``; None elsewhere (host times are
    then device times)."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    return lambda: torch.cuda.current_stream(device)


def rank_and_size(schedule: Any) -> tuple[int, int]:
    """This process's rank in the pipeline group and the group's size (the plan's ranks)."""
    stage = stages_of(schedule)[0]
    return stage.group_rank, stage.group_size


def place_of(schedule: Any) -> Place | None:
    """Where the pipeline group sits in a job of several (data-parallel replicas), as the
    runtime's torch backend finds it; None when the group is the world."""
    from pipetrace.runtime.torch_backend import TorchBackend

    return TorchBackend(group=stages_of(schedule)[0].group).pipeline_place()


class Instrumentation:
    """The patches that record one schedule on this rank into ``recorder``."""

    def __init__(self, schedule: Any, plan: Plan, rank: int, recorder: RecorderHooks) -> None:
        from torch.distributed.pipelining import schedules

        self.schedule = schedule
        self.recorder = recorder
        self.index = StepIndex(plan, rank)
        self.single = isinstance(schedule, schedules.PipelineScheduleSingle)
        self.stages = stages_of(schedule)
        self.messages = MessageLog(recorder, _stream_getter(self.stages[0].device))
        self.holds_last = any(stage.is_last for stage in self.stages)
        self.iteration = -1
        self.failure: BaseException | None = None  # the exception a step recorded
        self.messages_failed = False
        """Set when reporting P2P ops failed: torch's code runs on, no longer recorded."""
        self._composite: Entry | None = None  # the OVERLAP_F_B action being performed
        self._module = schedules
        self._saved: list[tuple[Any, str, Any]] = []  # (owner, attribute, what it held)
        self._replacements: list[tuple[Any, str, Any]] | None = None  # made at first install

    # -- install / undo --------------------------------------------------------------------

    def install(self) -> None:
        with _active_lock:
            if _active:
                raise RuntimeError("another schedule is already being recorded in this process")
            _active.append(self)
        if self._replacements is None:
            self._replacements = self._make_replacements()
        for owner, name, replacement in self._replacements:
            self._patch(owner, name, replacement)

    def _make_replacements(self) -> list[tuple[Any, str, Any]]:
        """Every (owner, attribute, wrapper) to set, made once at the first install: a later
        install (`resume`, the end of an `eval`) sets the same wrappers, so the messages they
        report keep their identity (`MessageLog` keys a message's report by its id)."""
        schedule = self.schedule
        patches: list[tuple[Any, str, Any]] = [
            (schedule, "step", self._step_wrapper(schedule.step))
        ]
        for stage in self.stages:
            for name, (kind, channel) in OP_SOURCES.items():
                messages = self._messages_of(stage, kind, channel)
                if messages:  # else the stage has no such message (an end of the pipeline)
                    patches.append((stage, name, self._ops_wrapper(getattr(stage, name), messages)))
            if self.single or self.index.has_composites:  # else actions are the steps
                for name, kind in _COMPUTE.items():
                    method = getattr(stage, name)
                    patches.append((stage, name, self._compute_wrapper(method, stage, kind)))
            if self.single:
                reduce_grad = self._reduce_grad_wrapper(stage.perform_reduce_grad, stage)
                patches.append((stage, "perform_reduce_grad", reduce_grad))
        module = self._module
        patches.append((module, "_batch_p2p", self._batch_wrapper(module._batch_p2p)))
        patches.append((module, "_wait_batch_p2p", self.messages.waited))
        if not self.single:
            patches.append((module, "record_function", self._action_ranges(module.record_function)))
        return patches

    @property
    def installed(self) -> bool:
        return bool(self._saved)

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        """Set ``owner.name``, remembering what ``owner`` itself held (an instance attribute
        someone else set, or nothing: then the class's method shows through again)."""
        self._saved.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, replacement)

    def undo(self) -> None:
        while self._saved:
            owner, name, previous = self._saved.pop()
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
        with _active_lock:
            if self in _active:
                _active.remove(self)

    # -- iterations ------------------------------------------------------------------------

    def _step_wrapper(self, step: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self.recorder
        schedule = self.schedule
        wants_losses = self.holds_last and schedule._loss_fn is not None

        def recorded_step(*args: Any, **kwargs: Any) -> Any:
            if forward_only(schedule):  # eval() (it calls step): forward only, no plan
                return self._unrecorded(step, args, kwargs)
            self.iteration += 1
            self.messages.begin_iteration()
            losses = kwargs.get("losses")
            if wants_losses and losses is None:
                kwargs["losses"] = losses = []
            recorder.begin_iteration(self.iteration)
            try:
                result = step(*args, **kwargs)
            except BaseException as exc:
                self.failure = exc
                recorder.exception(exc)
                raise
            recorder.end_iteration(self.iteration, _mean(losses) if losses else None)
            return result

        return recorded_step

    def _unrecorded(self, step: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        """One call of torch's own code, every patch taken off meanwhile: a forward-only pass
        runs none of the plan's backward steps, so recorded it would be a false iteration
        (plan divergences, and B steps counted for backwards it never ran)."""
        self.undo()
        try:
            return step(*args, **kwargs)
        finally:
            self._reinstall()

    def _reinstall(self) -> None:
        """Put the patches back after an unrecorded call; if that fails, training goes on
        unrecorded (with one warning), as `record` does when setting up fails."""
        try:
            self.install()
        except Exception as exc:
            self.undo()
            warnings.warn(
                f"pipetrace stopped recording ({type(exc).__name__}: {exc}); training continues",
                RuntimeWarning,
                stacklevel=3,
            )

    # -- steps -----------------------------------------------------------------------------

    def _action_ranges(self, record_function: Callable[[str], Any]) -> Callable[[str], Any]:
        """`_PipelineScheduleRuntime`'s per-action profiler range, also the action's step.

        The range is opened through torch's fast C++ RecordFunction: the same ``PP:<action>``
        range for a profiler, at ~0.3 µs instead of `record_function`'s ~8.5 µs (field
        notes), which pays for recording the step."""
        import torch

        fast_range = torch._C._profiler._RecordFunctionFast
        by_name = {_ACTION_PREFIX + text: entry for text, entry in self.index.by_text.items()}
        recorder = self.recorder
        owner = self

        class ActionRange:
            __slots__ = ("_entry", "_range", "_token")

            def __init__(self, name: str, args: str | None = None) -> None:
                self._range = fast_range(name) if args is None else record_function(name, args)
                self._entry = by_name.get(name)

            def __enter__(self) -> Any:
                handle = self._range.__enter__()
                entry = self._entry
                if entry is not None:
                    if entry[1].sub_steps:
                        owner._composite = entry
                    self._token = recorder.begin_step(entry[0], entry[1])
                return handle

            def __exit__(self, *exc: Any) -> Any:
                if self._entry is not None and exc[0] is None:
                    owner._composite = None
                    recorder.end_step(self._token)
                return self._range.__exit__(*exc)

        return ActionRange

    def _sub_step(self, key: Key) -> Entry | None:
        """The sub-step of the composite action being performed that a compute call is
        (other actions of a multi-stage schedule are their own steps already)."""
        if self._composite is not None:
            return self.index.sub_step(self._composite, key)
        return None

    def _compute_wrapper(
        self, method: Callable[..., Any], stage: Any, kind: StepKind | None
    ) -> Callable[..., Any]:
        """``kind``: the step kind the method performs; None for ``backward_one_chunk``
        (B or I, as its ``full_backward`` says). A single-stage schedule's compute calls
        are its plan's steps, found with one lookup."""
        recorder = self.recorder
        stage_index = stage.stage_index
        find = self.index.by_key.get if self.single else self._sub_step

        def recorded(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if kind is not None:
                entry = find((kind, stage_index, chunk_id))
            else:  # backward_one_chunk(mb, loss=None, full_backward=True, ...): B, or I (dx)
                full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
                entry = find((StepKind.B if full else StepKind.I, stage_index, chunk_id))
            if entry is None:
                return method(chunk_id, *args, **kwargs)
            token = recorder.begin_step(*entry)
            result = method(chunk_id, *args, **kwargs)  # a failing step stays open: as designed
            recorder.end_step(token)
            return result

        return recorded

    def _reduce_grad_wrapper(self, method: Callable[..., Any], stage: Any) -> Callable[..., Any]:
        entry = self.index.by_key.get((StepKind.REDUCE_GRAD, stage.stage_index, None))
        recorder = self.recorder

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if entry is None:
                return method(*args, **kwargs)
            token = recorder.begin_step(*entry)
            result = method(*args, **kwargs)
            recorder.end_step(token)
            return result

        return recorded

    # -- messages --------------------------------------------------------------------------

    def _messages_of(self, stage: Any, kind: StepKind, channel: str) -> dict[Any, Message]:
        """The stage's ``kind`` messages by micro-batch, made once at install."""
        return {
            mb: Message.of(position, step, channel)
            for mb, (position, step) in self.index.of_stage(kind, stage.stage_index).items()
        }

    def _ops_wrapper(
        self, method: Callable[[int], list[Any]], by_microbatch: dict[Any, Message]
    ) -> Callable[[int], list[Any]]:
        pending = self.messages.pending

        def recorded(chunk_id: int, *args: Any, **kwargs: Any) -> list[Any]:
            ops = method(chunk_id, *args, **kwargs)
            message = by_microbatch.get(chunk_id)
            if message is not None:
                for op in ops:  # noted for the post (`MessageLog.post`)
                    pending[id(op)] = (op, message)
            return ops

        return recorded

    def _batch_wrapper(self, batch_p2p: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        messages = self.messages
        open_steps = self.single  # their loops have no SEND/RECV actions: open them per op

        def recorded(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
            if not p2p_ops or self.messages_failed:
                return batch_p2p(p2p_ops, desc)
            try:
                tokens = messages.post(p2p_ops, open_steps)
            except Exception as exc:  # a recording bug must not stop the training
                self.messages_failed = True
                warnings.warn(
                    f"pipetrace stopped recording P2P ops ({type(exc).__name__}: {exc}); "
                    "training continues",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return batch_p2p(p2p_ops, desc)
            works = batch_p2p(p2p_ops, desc)
            messages.posted_works(works, tokens)
            return works

        return recorded


# compute method -> the step kind it performs (None: B or I, as its full_backward says)
_COMPUTE: dict[str, StepKind | None] = {
    "forward_one_chunk": StepKind.F,
    "backward_one_chunk": None,
    "backward_weight_one_chunk": StepKind.W,
}


def _mean(losses: list[Any]) -> float:
    import torch

    return float(torch.stack([loss.detach() for loss in losses]).mean())
