"""The interface between the runtime and the recorder.

The runtime calls these hooks at every step and P2P op; `NullRecorder` is what it calls when
recording is off (``--record off``), so the hot path pays only for a method call. The real
recorder (`pipetrace.recorder.recorder.Recorder`) implements the same methods.

Times are taken by the recorder itself (from its `Clock`: by default ``time.perf_counter_ns``
mapped to the epoch), never by the caller, so every event on a rank shares one clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import add
from typing import Any, Protocol

from pipetrace.schedule.ir import Plan, Step

Config = dict[str, Any]
"""A run's configuration as the recorder writes it (meta.json's and run_start's ``config``)."""


@dataclass(frozen=True)
class Place:
    """Where a pipeline sits in a job of several (data-parallel replicas): the runtime
    speaks of pipeline ranks (plan rows, P2P peers), the trace of global ranks, so the
    recorder needs both. ``pipelines[replica][pipeline_rank]`` is a global rank."""

    global_rank: int
    world_size: int
    pipelines: tuple[tuple[int, ...], ...]

    @property
    def replica(self) -> int:
        return next(i for i, ranks in enumerate(self.pipelines) if self.global_rank in ranks)

    @property
    def pipeline_ranks(self) -> tuple[int, ...]:
        """The global rank of each pipeline rank of this rank's pipeline."""
        return self.pipelines[self.replica]

    def header(self) -> dict[str, Any]:
        """The rank log header's replica fields (`pipetrace.recorder.format.HEADER`)."""
        ranks = self.pipeline_ranks
        return {
            "replica": self.replica,
            "replicas": len(self.pipelines),
            "pipeline_rank": ranks.index(self.global_rank),
            "pipeline_ranks": list(ranks),
        }


class RecorderHooks(Protocol):
    def begin_run(
        self, *, rank: int, world_size: int, plan: Plan, config: Config, place: Place | None = None
    ) -> None:
        """Once per rank after the process group is up; ``plan`` is the full plan (all ranks
        of the pipeline); ``rank`` and ``world_size`` are the pipeline's. ``place``: where the
        pipeline sits among several replicas (None: the job is this one pipeline)."""

    def begin_iteration(self, iteration: int) -> None: ...

    def end_iteration(self, iteration: int, loss: float | None) -> None:
        """``loss`` is the mean loss over micro-batches on the rank holding the last stage."""

    def begin_step(self, position: int, step: Step, thread: str = "main") -> Any:
        """A step of the rank's plan starts; ``position`` is its index in the rank's plan
        (bubbles excluded). Returns a token for `end_step`. Composite steps get one call for
        the composite and one per sub-step (sub-steps on the thread that runs them)."""

    def end_step(self, token: Any, nbytes: int | None = None) -> None:
        """The step begun with ``token`` ended; ``nbytes``: the bytes an activation swap
        launch (`OFFLOAD`, `LOAD`) copies, None for every other step."""

    def p2p_posted(
        self,
        *,
        op: str,  # "send" or "recv"
        step: Step,
        peer: int,
        channel: str,  # "F" (activations) or "B" (gradients)
        seq: int,  # per (op, peer, channel) sequence number, from 0 each iteration
        nbytes: int,
        shape: tuple[int, ...],
        dtype: str,
        stream: Any = None,  # CUDA: the stream it is posted from, to time it on the device
    ) -> Any:
        """A send or recv is being posted (called right before isend/irecv). Returns a token
        for `p2p_enqueued` and `p2p_completed`."""

    def p2p_enqueued(self, token: Any) -> None:
        """Its wait is enqueued on ``stream`` (CUDA: after ``work.wait()``), so the device
        end of the op can be marked there; a no-op without a stream."""

    def p2p_completed(self, token: Any) -> None:
        """The op completed (its wait returned)."""

    records_memory: bool
    """Whether the runtime should call `memory_sample` (and count what its stages keep)."""

    def memory_sample(
        self,
        token: Any,  # from `begin_step`: the step that just ended
        saved: list[int],  # per stage, in plan order: activations kept for backward
        inflight: list[int],  # per stage: received tensors not yet consumed
        allocator: tuple[int, int] | None = None,  # CUDA: (allocated, reserved); None on CPU
        swapped: list[int] | None = None,  # per stage, with swap steps: offloaded to the host
    ) -> None:
        """The bytes a rank's stages hold after a step; ``saved`` counts what is on the
        device (what activation swap offloaded is in ``swapped``). A recorder copies what it
        keeps of the lists."""

    def memory_watch(
        self, held: list[dict[int, int]], act: list[int], grad: list[int]
    ) -> Callable[[Any], None]:
        """Optional (a runtime falls back to `sample_counts`): what takes the memory sample
        of live counts after the step of a token, ``saved`` being each stage's sum of
        ``held`` (bytes per micro-batch) and ``inflight`` ``act`` + ``grad`` per stage. The
        caller keeps the counts up to date in place; a recorder reads them when called."""

    def next_step(self, token: Any, sampled: bool, position: int, step: Step) -> Any:
        """Optional (a runtime falls back to the calls it stands for): `end_step(token)`
        (None: no step to end), then, when ``sampled``, the sample of `memory_watch`'s counts
        after that step, then `begin_step(position, step)` on the main thread, at one time.
        The executor's one call between two steps of its loop: after a step's framework work
        each call costs for the code and data it touches, not for its instructions."""

    def exception(self, exc: BaseException) -> None:
        """The rank is about to fail with ``exc``."""

    def end_run(self) -> None:
        """A clean end; flush and close."""


def watched_counts(
    held: list[dict[int, int]], act: list[int], grad: list[int]
) -> tuple[list[int], list[int]]:
    """A memory sample's ``saved`` and ``inflight`` from `RecorderHooks.memory_watch`'s
    counts."""
    return list(map(sum, map(dict.values, held))), list(map(add, act, grad))


def sample_counts(
    memory_sample: Callable[..., None],
    held: list[dict[int, int]],
    act: list[int],
    grad: list[int],
    token: Any,
) -> None:
    """`RecorderHooks.memory_watch`'s sample, through ``memory_sample`` (for recorders
    without their own: bind the first four arguments)."""
    memory_sample(token, *watched_counts(held, act, grad))


class NullRecorder:
    """Records nothing. Every hook is a no-op."""

    records_memory = False

    def begin_run(self, **run: Any) -> None:
        pass

    def begin_iteration(self, iteration: int) -> None:
        pass

    def end_iteration(self, iteration: int, loss: float | None) -> None:
        pass

    def begin_step(self, position: int, step: Step, thread: str = "main") -> Any:
        return None

    def end_step(self, token: Any, nbytes: int | None = None) -> None:
        pass

    def p2p_posted(self, **kwargs: Any) -> Any:
        return None

    def p2p_enqueued(self, token: Any) -> None:
        pass

    def p2p_completed(self, token: Any) -> None:
        pass

    def memory_sample(
        self,
        token: Any,
        saved: list[int],
        inflight: list[int],
        allocator: Any = None,
        swapped: Any = None,
    ) -> None:
        pass

    def exception(self, exc: BaseException) -> None:
        pass

    def end_run(self) -> None:
        pass
