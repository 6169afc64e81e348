"""The backend seam: the little the framework-neutral runtime needs from a framework.

Everything above this seam is written once: the runner (`pipetrace.runtime.runner`), the
executor, the P2P bookkeeping, the parity check and the demo worker. Below it, a backend
holds only what differs between frameworks: how to make a stage and a P2P, how to split a
model and a batch, how to read a tensor as numpy, its recorder (profiler ranges and clock
alignment), and the executor's few framework calls (`pipetrace.runtime.executor.FrameworkOps`,
which a backend also is). The torch backend is `pipetrace.runtime.torch_backend.TorchBackend`,
the MindSpore one `pipetrace.runtime.mindspore.backend.MindSporeBackend`.

A runtime that executes its own schedule (e.g. an adapter for torch.distributed.pipelining)
needs none of the stage/P2P half: it takes `Backend.make_recorder` and calls the
`pipetrace.recorder.hooks.RecorderHooks` it returns (``begin_run``, ``begin_step`` /
``end_step``, ``p2p_posted`` / ``p2p_completed``, ``exception``, ``end_run``) from its own
loop, as `pipetrace.runtime.executor.Executor` and `pipetrace.runtime.p2p_common` do.

This module imports no framework: `backend_module` imports a backend module on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import numpy as np

    from pipetrace.recorder.hooks import Place, RecorderHooks
    from pipetrace.recorder.setup import RecordSettings
    from pipetrace.runtime import fsdp
    from pipetrace.runtime.activation_swap import SwapSteps
    from pipetrace.runtime.config import DemoConfig, RunConfig, WorkerSpec
    from pipetrace.runtime.p2p_common import P2PBookkeeping, StreamMeta

LossFn = Callable[[Any, Any], Any]  # (output, target) -> scalar loss tensor
Gradients = dict[int, list[tuple[str, Any]]]  # stage -> (parameter name, numpy array or None)


class Stage(Protocol):
    """One pipeline stage as the executor drives it (`pipetrace.runtime.stage_base`)."""

    module: Any
    stage_index: int
    losses: dict[int, Any]
    count_saved: bool
    input_fixed: bool
    held_bytes: dict[int, int]

    def forward(self, mb: int, x: Any, target: Any = None, loss_scale: float = 1.0) -> Any: ...
    def backward(self, mb: int, output_grad: Any) -> Any: ...
    def backward_input(self, mb: int, output_grad: Any) -> Any: ...
    def backward_weight(self, mb: int) -> None: ...
    def pending(self) -> int: ...
    def saved_bytes(self) -> int: ...
    def reset(self) -> None: ...
    def parameters(self) -> Iterable[Any]: ...


class Backend:
    """What `pipetrace.runtime.runner.PipelineRunner` and the parity check need from a
    framework. A backend subclasses this and implements every method that raises
    NotImplementedError; stages and P2P are made from its ``stage_type`` and ``p2p_type``,
    whose constructors take the same arguments in every framework (plus `p2p_options`)."""

    name: ClassVar[str]
    """The framework: the value of ``--backend`` and of the trace header's ``framework``."""
    sequential_name: ClassVar[str]
    """What a whole model is called in messages ("nn.Sequential")."""
    module_word: ClassVar[str]
    """What one stage's module is called in messages ("module", "cell")."""
    stage_type: ClassVar[type]
    """The stage class (a `Stage`, built as `pipetrace.runtime.stage_base.StageBase` is)."""
    p2p_type: ClassVar[type]
    """The P2P class (a `pipetrace.runtime.p2p_common.P2PBookkeeping`)."""
    pending_type: ClassVar[type]
    """The class of the posted-recv handles the P2P returns in overlap mode."""

    @property
    def tensor_type(self) -> type:
        """The framework's tensor class (a batch of this type is split into micro-batches)."""
        raise NotImplementedError

    # -- the executor's framework calls (`pipetrace.runtime.executor.FrameworkOps`) --------

    def mean_loss(self, losses: Iterable[Any]) -> float:
        """The mean of the last stage's micro-batch losses, as a float."""
        raise NotImplementedError

    def thread_initializer(self) -> Callable[[], None]:
        """What a new compute thread runs first (per-thread framework state)."""
        raise NotImplementedError

    def fsdp_steps(self, stages: dict[int, Any]) -> fsdp.FsdpSteps:
        """The handlers of the FSDP steps over ``stages``."""
        raise NotImplementedError

    def allocator_bytes(self) -> tuple[int, int] | None:
        """(allocated, reserved) bytes of the device's caching allocator, for the memory
        samples; None where there is none to read (CPU)."""
        return None

    def cannot_train(self) -> str | None:
        """Why a training step cannot run on this thread now (None: it can)."""
        return None

    def grad_base(self, param: Any) -> Any:
        """What ``param``'s gradient holds as an iteration starts (`sum_with_peer`'s
        ``base``)."""
        raise NotImplementedError

    def sum_with_peer(self, param: Any, peer: int, base: Any) -> None:
        """TIED_REDUCE: exchange what ``param``'s gradient gained since ``base`` with rank
        ``peer``, which holds the same tied parameter, and add the two (in rank order, so
        both ranks hold the same bits). Only this iteration's part: gradients accumulated
        over several steps (no zeroing between them) would otherwise count the sum of the
        earlier ones twice."""
        raise NotImplementedError

    def swap_steps(self) -> SwapSteps:
        """The handlers of the activation swap steps (`RunConfig` refuses ``--swap`` on a
        backend without them)."""
        raise NotImplementedError(f"the {self.name} backend cannot run activation swap steps")

    # -- the process group -----------------------------------------------------------------

    def join(self, timeout: float) -> tuple[int, int]:
        """Join the pipeline's group unless the script did; returns (rank, world size)."""
        raise NotImplementedError

    def device_name(self) -> str:
        """Where compute runs, for the run header."""
        raise NotImplementedError

    def pipeline_place(self) -> Place | None:
        """Where the pipeline's group sits in the whole job, when the job runs several
        pipelines (data-parallel replicas); None when the group is the whole world. Called
        after `join`, on every rank of the job at once (it may be a collective)."""
        return None

    # -- the model, stages and messages ----------------------------------------------------

    def is_sequential(self, model: Any) -> bool:
        """Whether ``model`` is a whole model to split (`split_model`)."""
        raise NotImplementedError

    def is_module(self, model: Any) -> bool:
        """Whether ``model`` is one module (a model that is not a sequential one)."""
        raise NotImplementedError

    def split_model(self, model: Any, num_stages: int) -> list[Any]:
        """``model`` cut into ``num_stages`` chunks (`pipetrace.runtime.split.chunk_bounds`),
        keeping the full model's parameter names."""
        raise NotImplementedError

    def make_stage(
        self, module: Any, *, stage_index: int, num_stages: int, loss_fn: LossFn | None
    ) -> Stage:
        return self.stage_type(
            module, stage_index=stage_index, num_stages=num_stages, loss_fn=loss_fn
        )

    def make_p2p(
        self,
        *,
        num_stages: int,
        recorder: RecorderHooks,
        overlap: bool,
        known: Mapping[tuple[str, int], StreamMeta] | None,
    ) -> P2PBookkeeping:
        return self.p2p_type(
            num_stages=num_stages,
            recorder=recorder,
            overlap=overlap,
            known=dict(known) if known else None,
            **self.p2p_options(),
        )

    def p2p_options(self) -> dict[str, Any]:
        """Keyword arguments of ``p2p_type`` beyond those every backend's takes."""
        return {}

    def split_tensor(self, tensor: Any, size: int) -> Sequence[Any]:
        """``tensor`` cut along dim 0 into pieces of ``size`` rows."""
        raise NotImplementedError

    def make_recorder(self, settings: RecordSettings) -> RecorderHooks:
        """The recorder of a rank (profiler ranges and clock alignment of this framework)."""
        raise NotImplementedError

    # -- numbers (the parity check) --------------------------------------------------------

    def to_numpy(self, tensor: Any) -> np.ndarray:
        """``tensor`` as a float64 numpy array (on the host)."""
        raise NotImplementedError

    def stage_gradients(self, stages: Mapping[int, Stage]) -> Gradients:
        """Each stage's accumulated gradients as numpy, by parameter name (None: missing)."""
        raise NotImplementedError

    def reference_gradients(
        self, model: Any, inputs: Any, targets: Any, loss_fn: LossFn
    ) -> tuple[float, dict[str, np.ndarray]]:
        """The loss and every parameter's gradient (numpy, by name) of one single-process
        step of ``model`` on the whole batch."""
        raise NotImplementedError


@dataclass
class Replicas:
    """Where a demo-run process sits: pipeline rank ``pp_rank`` of replica ``replica`` of
    ``count``, and the backend its runner uses (whose group is that pipeline's). One replica
    by default; the torch backend's FSDP replicas override `shard` and `average`."""

    backend: Backend
    pp_rank: int
    replica: int = 0
    count: int = 1

    def shard(self, modules: Mapping[int, Any]) -> None:
        """Shard this process's stage modules across the replicas (one replica: nothing)."""

    def average(self, loss: float | None) -> float | None:
        """The loss averaged over the replicas."""
        return loss


class Optimizer(Protocol):
    def step(self) -> None:
        """Apply the accumulated gradients, then zero them."""


class DemoKit(Protocol):
    """What the demo run (`pipetrace.runtime.worker`) needs from a framework besides its
    `Backend`: the process's lifecycle, the demo model and data, an optimizer, a profiler."""

    launcher: str
    """What starts ranks by hand ("torchrun", "msrun"), for messages."""
    launcher_env: str
    """The variables that launcher sets ("RANK and WORLD_SIZE"), for messages."""
    loss_fn: LossFn

    def launched(self) -> tuple[int | None, int] | None:
        """(rank or None if the cluster assigns it, world size) from the launcher's
        environment; None when this process was not started by that launcher."""

    def start(self, rank: int | None, world_size: int | None, spec: WorkerSpec) -> tuple[int, int]:
        """Set the process up and join the world; returns the actual (rank, world size)."""

    def barrier(self) -> None: ...
    def stop(self) -> None: ...

    def replicas(self, case: RunConfig, rank: int) -> Replicas: ...
    def build_model(
        self, num_stages: int, config: DemoConfig, seed: int, *, tie_weights: bool = False
    ) -> Any: ...
    def batch(self, step: int, size: int, config: DemoConfig, seed: int) -> tuple[Any, Any]: ...
    def optimizer(self, runner: Any, learning_rate: float) -> Optimizer: ...

    def profiled(self, case: RunConfig, rank: int) -> AbstractContextManager[None]:
        """The framework's own profiler around the training steps, when the run asks."""


_BACKENDS = {
    "torch": "pipetrace.runtime.torch_backend",
    "mindspore": "pipetrace.runtime.mindspore.backend",
}


def backend_module(name: str) -> Any:
    """The module of backend ``name``, imported now: its ``BACKEND`` is the `Backend` class
    and its ``DEMO`` the `DemoKit` class."""
    try:
        return importlib.import_module(_BACKENDS[name])
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose from {', '.join(_BACKENDS)}") from None
