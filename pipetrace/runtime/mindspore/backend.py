"""The MindSpore backend (`pipetrace.runtime.backend.Backend`): stages in PyNative mode
(`pipetrace.runtime.mindspore.stage`), P2P over ``mindspore.ops.communication``
(`pipetrace.runtime.mindspore.p2p`), the whole MindSpore world as the pipeline; and the
MindSpore side of the demo run (`MindSporeDemo`). MindSpore is imported on first use only.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from pipetrace.runtime import fsdp
from pipetrace.runtime.backend import Backend, Gradients, LossFn, Replicas, Stage
from pipetrace.runtime.config import P2P_TIMEOUT
from pipetrace.runtime.mindspore import demo
from pipetrace.runtime.mindspore.p2p import MindSporeP2P, PendingRecv, fix_default_group
from pipetrace.runtime.mindspore.stage import (
    MindSporeStage,
    enable_grad_on_this_thread,
    restore_python_sigint,
)
from pipetrace.runtime.split import chunk_bounds

if TYPE_CHECKING:
    from mindspore import Tensor, nn

    from pipetrace.recorder.hooks import RecorderHooks
    from pipetrace.recorder.setup import RecordSettings
    from pipetrace.runtime.config import DemoConfig, RunConfig, WorkerSpec

TIMEOUT_ENV = "MS_CPU_COMM_OP_TIMEOUT"


def init_cluster(*, timeout: float = P2P_TIMEOUT.default) -> tuple[int, int]:
    """Join the MindSpore cluster (``mindspore.communication.init()``, mccl on CPU) unless
    the script did, make P2P usable on CPU (`fix_default_group`), and return (rank, world
    size). ``timeout`` bounds a P2P wait on a peer (seconds; MS_CPU_COMM_OP_TIMEOUT, read by
    MindSpore when the group is made, so it only applies if this call makes it)."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank, init

    if not GlobalComm.INITED:
        os.environ.setdefault(TIMEOUT_ENV, str(max(1, round(timeout))))
        init()
    restore_python_sigint()
    fix_default_group()
    return get_rank(), get_group_size()


def split_sequential(model: nn.SequentialCell, num_stages: int) -> list[nn.SequentialCell]:
    """``model``'s cells in ``num_stages`` contiguous chunks (`chunk_bounds`), keeping the
    full model's cell names (and so the parameters' names, ``3.0.weight``)."""
    from mindspore import nn

    children = list(model.name_cells().items())
    bounds = chunk_bounds(len(children), num_stages, kind="SequentialCell", unit="cell")
    return [nn.SequentialCell(OrderedDict(children[start:end])) for start, end in bounds]


class MindSporeBackend(Backend):
    """The pipeline is the whole MindSpore world: plan ranks are MindSpore ranks."""

    name: ClassVar[str] = "mindspore"
    sequential_name: ClassVar[str] = "nn.SequentialCell"
    module_word: ClassVar[str] = "cell"
    pending_type: ClassVar[type] = PendingRecv
    stage_type: ClassVar[type] = MindSporeStage
    p2p_type: ClassVar[type] = MindSporeP2P

    @property
    def tensor_type(self) -> type:
        from mindspore import Tensor

        return Tensor

    # -- the executor's framework calls ----------------------------------------------------

    def mean_loss(self, losses: Iterable[Tensor]) -> float:
        return float(np.mean([float(loss.asnumpy()) for loss in losses]))

    def thread_initializer(self) -> Callable[[], None]:
        return enable_grad_on_this_thread

    def fsdp_steps(self, stages: dict[int, Any]) -> fsdp.FsdpSteps:
        return fsdp.FsdpSteps({})  # FSDP is torch's: the FSDP steps are no-ops here

    # -- the process group and the model ---------------------------------------------------

    def join(self, timeout: float) -> tuple[int, int]:
        return init_cluster(timeout=timeout)

    def device_name(self) -> str:
        import mindspore as ms

        return ms.get_context("device_target")

    def is_sequential(self, model: Any) -> bool:
        from mindspore import nn

        return isinstance(model, nn.SequentialCell)

    def is_module(self, model: Any) -> bool:
        from mindspore import nn

        return isinstance(model, nn.Cell)

    def split_model(self, model: nn.SequentialCell, num_stages: int) -> list[Any]:
        return split_sequential(model, num_stages)

    def split_tensor(self, tensor: Tensor, size: int) -> Sequence[Tensor]:
        from mindspore import ops

        return ops.split(tensor, size)

    def make_recorder(self, settings: RecordSettings) -> RecorderHooks:
        from pipetrace.recorder.setup import mindspore_recorder

        return mindspore_recorder(settings)

    # -- numbers ---------------------------------------------------------------------------

    def to_numpy(self, tensor: Tensor) -> np.ndarray:
        return np.asarray(tensor.asnumpy(), dtype=np.float64)

    def stage_gradients(self, stages: Mapping[int, Stage]) -> Gradients:
        return {
            index: [
                (param.name, None if grad is None else self.to_numpy(grad))
                for param, grad in zip(stage.params, stage.grads)  # type: ignore[attr-defined]
            ]
            for index, stage in stages.items()
        }

    def reference_gradients(
        self, model: nn.Cell, inputs: Tensor, targets: Tensor, loss_fn: LossFn
    ) -> tuple[float, dict[str, np.ndarray]]:
        import mindspore as ms

        params = model.trainable_params()

        def loss_of(x: Tensor, y: Tensor) -> Tensor:
            return loss_fn(model(x), y)

        value_and_grad = ms.value_and_grad(loss_of, grad_position=None, weights=params)
        loss, grads = value_and_grad(inputs, targets)
        return float(loss.asnumpy()), {p.name: self.to_numpy(g) for p, g in zip(params, grads)}


def setup_mindspore(*, threads: int | None = None) -> None:
    """PyNative mode on the CPU, with ``threads`` kernel threads (None: MindSpore's default)."""
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    if threads:
        try:
            from mindspore.device_context.cpu.op_tuning import threads_num
        except ImportError:  # MindSpore < 2.6
            ms.set_context(runtime_num_threads=threads)
        else:
            threads_num(threads)


class MindSporeDemo:
    """The MindSpore side of the demo run (`pipetrace.runtime.backend.DemoKit`)."""

    launcher = "msrun"
    launcher_env = "MS_WORKER_NUM"
    loss_fn = staticmethod(demo.demo_loss)

    def __init__(self) -> None:
        self.rank, self.world_size = 0, 1

    def launched(self) -> tuple[int | None, int] | None:
        workers = os.environ.get("MS_WORKER_NUM")
        return None if workers is None else (None, int(workers))

    def start(self, rank: int | None, world_size: int | None, spec: WorkerSpec) -> tuple[int, int]:
        """``rank`` and ``world_size`` (what the launcher meant, or None) are checked against
        the cluster's."""
        setup_mindspore(threads=spec.threads_per_rank)
        self.rank, self.world_size = init_cluster(timeout=max(c.timeout for c in spec.cases))
        if rank not in (None, self.rank) or world_size not in (None, self.world_size):
            raise RuntimeError(
                f"started as rank {rank} of {world_size}, but the cluster made it rank "
                f"{self.rank} of {self.world_size}"
            )
        return self.rank, self.world_size

    def barrier(self) -> None:
        """Over P2P rather than ``comm.barrier()``, which on CPU logs a misleading "CPU
        device is not supported" error (MindSpore 2.10)."""
        from pipetrace.recorder.clock import mindspore_int_exchange

        send_ints, recv_ints = mindspore_int_exchange()
        if self.rank == 0:
            for peer in range(1, self.world_size):
                recv_ints(peer, 1)
            for peer in range(1, self.world_size):
                send_ints(peer, [0])
        else:
            send_ints(0, [self.rank])
            recv_ints(0, 1)

    def stop(self) -> None:
        from mindspore.communication import release

        release()

    def replicas(self, case: RunConfig, rank: int) -> Replicas:
        return Replicas(MindSporeBackend(), rank)  # --data-parallel is torch's (support.py)

    def build_model(
        self, num_stages: int, config: DemoConfig, seed: int, *, tie_weights: bool = False
    ) -> nn.SequentialCell:
        """``tie_weights`` is refused before any rank starts (`support.check_run`)."""
        if tie_weights:
            raise ValueError("tied weights need the torch backend")
        return demo.build_demo_model(num_stages, config, seed=seed)

    def batch(self, step: int, size: int, config: DemoConfig, seed: int) -> tuple[Tensor, Tensor]:
        return demo.demo_batch(step, size, config, seed=seed)

    def optimizer(self, runner: Any, learning_rate: float) -> MindSporeSGD:
        return MindSporeSGD(runner, learning_rate)

    @contextlib.contextmanager
    def profiled(self, case: RunConfig, rank: int) -> Iterator[None]:
        yield  # --torch-profiler is refused for MindSpore (support.py)


def accumulated_gradients(stages: Iterable[MindSporeStage]) -> tuple[Tensor, ...]:
    """The stages' accumulated gradients, aligned with their parameters (zeros where none
    yet)."""
    from mindspore import ops

    return tuple(
        ops.zeros_like(param) if grad is None else grad
        for stage in stages
        for param, grad in zip(stage.params, stage.grads)
    )


class MindSporeSGD:
    """Plain SGD (MindSpore's nn.SGD takes float16/float32 parameters only; the demo is
    float64) over a runner's parameters and accumulated gradients."""

    def __init__(self, runner: Any, learning_rate: float) -> None:
        self.stages: list[MindSporeStage] = list(runner.stages.values())
        self.learning_rate = learning_rate

    def step(self) -> None:
        params = [param for stage in self.stages for param in stage.params]
        for param, grad in zip(params, accumulated_gradients(self.stages)):
            param.set_data(param - grad * self.learning_rate)
        for stage in self.stages:
            stage.zero_grad()


BACKEND = MindSporeBackend
DEMO = MindSporeDemo
