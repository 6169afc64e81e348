"""The torch backend (`pipetrace.runtime.backend.Backend`): stages on autograd
(`pipetrace.runtime.stage`), P2P over torch.distributed (`pipetrace.runtime.p2p`), gloo on
CPU and NCCL on CUDA; and the torch side of the demo run (`DemoKit`: devices, FSDP replicas,
torch.optim SGD, torch.profiler).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist

from pipetrace.recorder.hooks import Place, RecorderHooks
from pipetrace.recorder.setup import RecordSettings, torch_recorder
from pipetrace.runtime import demo, fsdp
from pipetrace.runtime.activation_swap import SwapSteps
from pipetrace.runtime.backend import Backend, Gradients, LossFn, Replicas, Stage
from pipetrace.runtime.config import P2P_TIMEOUT, DemoConfig, RunConfig, WorkerSpec
from pipetrace.runtime.launch import STORE_FD_ENV
from pipetrace.runtime.p2p import P2P, PendingRecv
from pipetrace.runtime.split import chunk_bounds
from pipetrace.runtime.stage import PipelineStage


def init_distributed(device: torch.device | str, *, timeout: float = P2P_TIMEOUT.default) -> None:
    """Initialise the default process group from torchrun's environment variables
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), with NCCL for a CUDA device and gloo
    otherwise. ``timeout`` bounds how long any rank waits on a peer. Rank 0 of a
    `pipetrace run` serves the rendezvous store on the loopback socket its launcher bound
    (``PIPETRACE_STORE_FD``; -1 on the other ranks: join it); under torchrun, torchrun
    decides where its store listens."""
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = None
    store_fd = os.environ.pop(STORE_FD_ENV, "")
    if store_fd:  # every rank of a `pipetrace run` joins rank 0's loopback store
        fd = int(store_fd)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            is_master=fd >= 0,
            timeout=timedelta(seconds=timeout),
            master_listen_fd=fd if fd >= 0 else None,
        )
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
        store=store,
    )


def split_sequential(model: torch.nn.Sequential, num_stages: int) -> list[torch.nn.Sequential]:
    """``model``'s children in ``num_stages`` contiguous chunks (`chunk_bounds`), keeping
    their names."""
    children = list(model.named_children())
    bounds = chunk_bounds(len(children), num_stages, kind="Sequential", unit="module")
    return [torch.nn.Sequential(OrderedDict(children[start:end])) for start, end in bounds]


_TIED_TAG = 0x7FFFFFFF
"""The gloo tag of the TIED_REDUCE exchange: above every P2P message's (`P2P._tag`)."""


@dataclass(frozen=True)
class TorchBackend(Backend):
    """Stages on ``device``, messages within ``group`` (None: the default group)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: dist.ProcessGroup | None = None

    name: ClassVar[str] = "torch"
    sequential_name: ClassVar[str] = "nn.Sequential"
    module_word: ClassVar[str] = "module"
    tensor_type: ClassVar[type] = torch.Tensor
    pending_type: ClassVar[type] = PendingRecv
    stage_type: ClassVar[type] = PipelineStage
    p2p_type: ClassVar[type] = P2P

    # -- the executor's framework calls ----------------------------------------------------

    def mean_loss(self, losses: Iterable[torch.Tensor]) -> float:
        return float(torch.stack(list(losses)).mean())

    def thread_initializer(self) -> Callable[[], None]:
        # torch.set_num_threads is per thread for MKL and OpenMP: a new thread would run
        # its kernels with the library default (all cores), which on a shared CPU made
        # the overlapped backward ~100x slower. Give it the caller's setting.
        return functools.partial(torch.set_num_threads, torch.get_num_threads())

    def fsdp_steps(self, stages: dict[int, Any]) -> fsdp.FsdpSteps:
        return fsdp.FsdpSteps(stages)

    def swap_steps(self) -> SwapSteps:
        return SwapSteps(self.thread_initializer())

    # -- the process group and the model ---------------------------------------------------

    def allocator_bytes(self) -> tuple[int, int] | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    def cannot_train(self) -> str | None:
        if torch.is_inference_mode_enabled():
            return "it runs under torch.inference_mode(): evaluate the model outside the runner"
        if not torch.is_grad_enabled():
            return "it runs under torch.no_grad(): evaluate the model outside the runner"
        return None

    def grad_base(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """A copy of the gradient (autograd accumulates into it in place); None when it was
        zeroed to None, as `zero_grad` does by default: then nothing is copied."""
        return None if param.grad is None else param.grad.detach().clone()

    def sum_with_peer(
        self, param: torch.nn.Parameter, peer: int, base: torch.Tensor | None
    ) -> None:
        grad = param.grad
        if grad is None:
            grad = torch.zeros_like(param)
        gained = grad if base is None or param.grad is None else grad - base
        other = torch.empty_like(gained)
        ops = [
            dist.P2POp(op, tensor, group=self.group, group_peer=peer, tag=_TIED_TAG)
            for op, tensor in ((dist.isend, gained), (dist.irecv, other))
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        mine_first = dist.get_rank(self.group) < peer
        both = gained + other if mine_first else other + gained
        param.grad = both if base is None or param.grad is None else base + both

    def join(self, timeout: float) -> tuple[int, int]:
        if not dist.is_initialized():
            init_distributed(self.device, timeout=timeout)
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def device_name(self) -> str:
        return str(self.device)

    def pipeline_place(self) -> Place | None:
        """Every rank's group, gathered over the default group (one collective at start):
        the pipelines in the order of their lowest global rank. None when the group is the
        world."""
        if self.group is None or dist.get_world_size(self.group) == dist.get_world_size():
            return None
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, dist.get_process_group_ranks(self.group))
        pipelines = sorted({tuple(ranks) for ranks in gathered}, key=min)
        return Place(dist.get_rank(), dist.get_world_size(), tuple(pipelines))

    def is_sequential(self, model: Any) -> bool:
        return isinstance(model, torch.nn.Sequential)

    def is_module(self, model: Any) -> bool:
        return isinstance(model, torch.nn.Module)

    def split_model(self, model: torch.nn.Sequential, num_stages: int) -> list[Any]:
        return split_sequential(model, num_stages)

    def p2p_options(self) -> dict[str, Any]:
        return {"device": self.device, "group": self.group}

    def split_tensor(self, tensor: torch.Tensor, size: int) -> Sequence[torch.Tensor]:
        return tensor.split(size)

    def make_recorder(self, settings: RecordSettings) -> RecorderHooks:
        return torch_recorder(settings, self.device)

    # -- numbers ---------------------------------------------------------------------------

    def to_numpy(self, tensor: torch.Tensor) -> np.ndarray:
        return tensor.detach().to(torch.float64).cpu().numpy()

    def stage_gradients(self, stages: Mapping[int, Stage]) -> Gradients:
        """Sharded (FSDP) gradients are gathered first: a collective over their replicas."""
        gradients: Gradients = {}
        for index, stage in stages.items():
            pairs = gradients[index] = []
            for name, param in stage.module.named_parameters():
                grad = param.grad
                if grad is not None and hasattr(grad, "full_tensor"):  # a DTensor shard
                    grad = grad.full_tensor()
                pairs.append((name, None if grad is None else self.to_numpy(grad)))
        return gradients

    def reference_gradients(
        self, model: torch.nn.Module, inputs: Any, targets: Any, loss_fn: LossFn
    ) -> tuple[float, dict[str, np.ndarray]]:
        """``model`` is used up: its gradients are overwritten."""
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        grads = {
            name: self.to_numpy(p.grad)
            for name, p in model.named_parameters(remove_duplicate=False)  # tied: both names
            if p.grad is not None
        }
        return loss.item(), grads


def device_for(local_rank: int) -> torch.device:
    """CUDA device ``local_rank`` when there is one (NCCL; made current, as NCCL needs), else
    the CPU (gloo)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


@dataclass
class FsdpReplicas(Replicas):
    """D pipeline replicas on a (dp, pp) device mesh, each stage sharded with FSDP2."""

    mesh: Any = None
    dp_group: Any = None

    def shard(self, modules: Mapping[int, torch.nn.Module]) -> None:
        from torch.distributed.fsdp import fully_shard

        for module in modules.values():
            fully_shard(module, mesh=self.mesh, reshard_after_forward=False)

    def average(self, loss: float | None) -> float | None:
        if loss is None:
            return None
        total = torch.tensor([loss], dtype=torch.float64, device=self.backend.device)
        dist.all_reduce(total, group=self.dp_group)
        return total.item() / self.count


class TorchDemo:
    """The torch side of the demo run (`pipetrace.runtime.demo_run.DemoKit`)."""

    launcher = "torchrun"
    launcher_env = "RANK and WORLD_SIZE"
    loss_fn = staticmethod(demo.demo_loss)

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def launched(self) -> tuple[int | None, int] | None:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def start(self, rank: int | None, world_size: int | None, spec: WorkerSpec) -> tuple[int, int]:
        if spec.threads_per_rank:
            torch.set_num_threads(spec.threads_per_rank)
        self.device = device_for(int(os.environ.get("LOCAL_RANK", rank or 0)))
        return TorchBackend(self.device).join(max(case.timeout for case in spec.cases))

    def barrier(self) -> None:
        dist.barrier()

    def stop(self) -> None:
        dist.destroy_process_group()

    def replicas(self, case: RunConfig, rank: int) -> Replicas:
        num_ranks, count = case.ranks, case.data_parallel
        pp_rank, replica = rank % num_ranks, rank // num_ranks
        if count == 1 and not case.fsdp:
            return Replicas(TorchBackend(self.device), pp_rank)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device.type, (count, num_ranks), mesh_dim_names=("dp", "pp"))
        return FsdpReplicas(
            TorchBackend(self.device, mesh.get_group("pp")),
            pp_rank,
            replica,
            count,
            mesh=mesh["dp"],
            dp_group=mesh.get_group("dp"),
        )

    def build_model(
        self, num_stages: int, config: DemoConfig, seed: int, *, tie_weights: bool = False
    ) -> torch.nn.Sequential:
        model = demo.build_demo_model(num_stages, config, seed=seed, tie_weights=tie_weights)
        return model.to(self.device)

    def batch(
        self, step: int, size: int, config: DemoConfig, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = demo.demo_batch(step, size, config, seed=seed)
        return inputs.to(self.device), targets.to(self.device)

    def optimizer(self, runner: Any, learning_rate: float) -> TorchSGD:
        return TorchSGD(torch.optim.SGD(runner.parameters(), lr=learning_rate))

    @contextlib.contextmanager
    def profiled(self, case: RunConfig, rank: int) -> Iterator[None]:
        """A torch.profiler trace of the block into ``out/profiler/`` with --torch-profiler
        (kept only when the block succeeds)."""
        if not case.torch_profiler or not case.record_settings().enabled:
            yield
            return
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.start()
        yield
        profiler.stop()
        from pipetrace.recorder.format import PROFILER_DIR

        directory = Path(case.record_settings().run_dir) / PROFILER_DIR
        directory.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(directory / f"rank-{rank:05d}.json"))


@dataclass
class TorchSGD:
    """Plain SGD over the runner's parameters."""

    optimizer: torch.optim.Optimizer

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


BACKEND = TorchBackend
DEMO = TorchDemo
