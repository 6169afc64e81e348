"""pipetrace's demo model trained by torch.distributed.pipelining's own runtime, recorded.

Two ways in, one training loop (`train`):

- ``pipetrace run --runtime torch`` (`run_config`, called by the demo worker on every rank
  the launcher in `pipetrace.runtime.launch` started): the built-in schedule's torch class on
  the same model, data, seed and loss as pipetrace's runtime (`pipetrace.runtime.demo`), so
  ``pipetrace diff`` compares the two runtimes; ``--inject``, ``--check-parity``,
  ``--fsdp -d D`` and ``--torch-profiler`` as there.
- `run_torch_demo` (the tests): one or more `TorchCase` one after the other in one process
  group, including what the CLI cannot ask for: every torch class (ScheduleLoopedBFS), a plan
  loaded from a CSV file through `_PipelineScheduleRuntime`, with two actions swapped.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from pipetrace.recorder.setup import RecordSettings
from pipetrace.runtime.config import DemoConfig, LossCallback, RunConfig
from pipetrace.runtime.faults import Fault
from pipetrace.runtime.launch import free_port
from pipetrace.runtime.results import CaseResult

if TYPE_CHECKING:
    from pipetrace.runtime.backend import DemoKit, Replicas
    from pipetrace.runtime.results import ParityReport

CASES_ENV = "PIPETRACE_TORCH_DEMO_CASES"
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
SINGLE_STAGE = ("ScheduleGPipe", "Schedule1F1B")
CSV_RUNTIME = "csv"
SMALL_DEMO = DemoConfig(width=32, blocks_per_stage=1, microbatch_size=4)
"""The tests' model: small, so that a rank's step is cheap."""


@dataclass(frozen=True)
class TorchCase:
    """One run of the demo on a torch schedule class."""

    schedule: str
    """A class name of torch.distributed.pipelining.schedules, or "csv": a
    `_PipelineScheduleRuntime` loading the ``csv_from`` class's plan from a CSV file."""
    run_dir: str | None
    """Where it is recorded (None: not recorded)."""
    microbatches: int = 4
    stages_per_rank: int = 1
    steps: int = 2
    csv_from: str = "ScheduleInterleaved1F1B"
    swap: tuple[int, int, int] | None = None
    """(rank, i, j): swap the rank's actions i and j in the CSV."""
    faults: tuple[Fault, ...] = ()
    """Resolved faults (`pipetrace.runtime.faults`) of the kinds torch's runtime takes."""
    stall_timeout: float = 30.0
    abort_timeout: float = 30.0
    demo: DemoConfig = SMALL_DEMO
    seed: int = 1234
    learning_rate: float = 0.05
    check_parity: bool = False
    config: dict[str, Any] = field(default_factory=dict)
    """Added to the run configuration in meta.json."""
    evaluate: bool = False
    """After each training step, a ``schedule.eval`` of the same batch (not recorded)."""
    forward_only: bool = False
    """A schedule built with no loss function, stepped under ``torch.no_grad`` (not
    recorded)."""

    def record_settings(self) -> RecordSettings:
        if self.run_dir is None:
            return RecordSettings(run_dir=None)
        return RecordSettings(
            run_dir=self.run_dir,
            stall_timeout=self.stall_timeout,
            abort_timeout=self.abort_timeout,
        )


_FROM_RUN_CONFIG = (
    "microbatches",
    "steps",
    "faults",
    "stall_timeout",
    "abort_timeout",
    "demo",
    "seed",
    "learning_rate",
    "check_parity",
)
"""The `TorchCase` fields a `RunConfig` field of the same name sets."""


def torch_class(schedule: str) -> str:
    """The torch.distributed.pipelining class of a built-in schedule (name or alias)."""
    from pipetrace.schedule.builders import describe_schedules, resolve_schedule_name

    name = resolve_schedule_name(schedule)
    info = next(info for info in describe_schedules() if info.name == name)
    return next(alias for alias in info.aliases if alias.startswith("Schedule"))


def case_of(config: RunConfig) -> TorchCase:
    """The `TorchCase` of a ``pipetrace run --runtime torch``: the built-in schedule's torch
    class with pipetrace's plan's stage count, model, data and seed."""
    plan = config.plan()
    return TorchCase(
        schedule=torch_class(config.schedule),
        run_dir=config.out,
        stages_per_rank=plan.num_stages // plan.num_ranks,
        config=config.to_dict(),
        **{name: getattr(config, name) for name in _FROM_RUN_CONFIG},
    )


def run_config(
    kit: DemoKit, index: int, config: RunConfig, rank: int, on_loss: LossCallback | None
) -> CaseResult:
    """One rank of ``pipetrace run --runtime torch`` (the demo worker calls it). torch's
    schedule logs its whole plan when a step raises; the launcher's one-line report and the
    recording already say where, so that dump is kept off the run's stderr."""
    logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.CRITICAL)
    replicas = kit.replicas(config, rank)
    with kit.profiled(config, rank):
        return train(
            case_of(config), replicas, config.ranks, config.record_settings(), index, on_loss
        )


def run_torch_demo(cases: list[TorchCase], world_size: int, *, timeout: float = 120.0) -> list[int]:
    """Run ``cases`` on ``world_size`` local ranks; returns each rank's exit code (ranks
    still running after ``timeout`` seconds are killed, -9)."""
    return launch_local_ranks(
        [sys.executable, "-m", "pipetrace.torch_pipelining.demo"],
        world_size,
        env={CASES_ENV: pickle.dumps(cases).hex()},
        timeout=timeout,
    )


def launch_local_ranks(
    command: list[str], world_size: int, *, env: dict[str, str], timeout: float
) -> list[int]:
    """Start ``command`` once per rank with torchrun's variables (gloo on 127.0.0.1) and
    wait; returns the exit codes, -9 for a rank killed after ``timeout`` seconds."""
    port = free_port()
    processes = []
    for rank in range(world_size):
        rank_env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            **env,
        )
        processes.append(subprocess.Popen(command, env=rank_env))
    deadline = time.monotonic() + timeout
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(process.wait())
    return codes


def _placement(schedule: str, world_size: int, num_stages: int) -> tuple[int, ...]:
    from pipetrace.schedule.ir import Placement, stage_to_rank

    shape = Placement.V if schedule in V_SHAPED else Placement.LOOP
    return stage_to_rank(shape, world_size, num_stages)


def build_schedule(case: TorchCase, replicas: Replicas, num_ranks: int) -> Any:
    """The case's torch schedule over this process's stages of the demo model (sharded over
    the replicas with FSDP2 when there are several), with its faults armed."""
    from torch.distributed.pipelining import PipelineStage, schedules

    from pipetrace.runtime.demo import build_demo_model, demo_loss
    from pipetrace.runtime.torch_backend import split_sequential
    from pipetrace.torch_pipelining.faults import arm_faults
    from pipetrace.torch_pipelining.plan import plan_of

    source = case.csv_from if case.schedule == CSV_RUNTIME else case.schedule
    per_rank = 1 if source in SINGLE_STAGE else case.stages_per_rank
    num_stages = per_rank * num_ranks
    chunks = split_sequential(build_demo_model(num_stages, case.demo, seed=case.seed), num_stages)
    placement = _placement(source, num_ranks, num_stages)
    mine = {s: chunks[s] for s in range(num_stages) if placement[s] == replicas.pp_rank}
    replicas.shard(mine)
    backend = replicas.backend
    stages = [
        PipelineStage(module, s, num_stages, backend.device, group=backend.group)
        for s, module in mine.items()
    ]
    cls = getattr(schedules, source)
    loss_fn = None if case.forward_only else demo_loss
    if source in SINGLE_STAGE:
        schedule = cls(stages[0], n_microbatches=case.microbatches, loss_fn=loss_fn)
    else:
        schedule = cls(stages, n_microbatches=case.microbatches, loss_fn=loss_fn)
    if case.schedule == CSV_RUNTIME:
        schedule = _through_csv(case, schedule, stages, replicas.pp_rank)
    faults = tuple(f for f in case.faults if (f.replica or 0) == replicas.replica)
    if faults:  # a fault strikes one pipeline rank of one replica
        arm_faults(faults, schedule, plan_of(schedule), replicas.pp_rank)
    return schedule


def _through_csv(case: TorchCase, schedule: Any, stages: list[Any], rank: int) -> Any:
    """A `_PipelineScheduleRuntime` that loads ``schedule``'s plan (``case.swap`` applied)
    from a CSV file written beside the run directory."""
    from torch.distributed.pipelining import schedules

    from pipetrace.runtime.demo import demo_loss

    path = Path(case.run_dir or "torch-demo").with_suffix(f".rank{rank}.csv")
    order = {r: list(actions) for r, actions in schedule.pipeline_order_with_comms.items()}
    if case.swap is not None:
        swap_rank, i, j = case.swap
        row = order[swap_rank]
        row[i], row[j] = row[j], row[i]
    schedule.pipeline_order_with_comms = order
    schedule._dump_csv(str(path), format="compute_comms")
    runtime = schedules._PipelineScheduleRuntime(
        stages, n_microbatches=case.microbatches, loss_fn=demo_loss
    )
    runtime._load_csv(str(path), format="compute_comms")
    return runtime


def train(
    case: TorchCase,
    replicas: Replicas,
    num_ranks: int,
    settings: RecordSettings,
    index: int = 0,
    on_loss: LossCallback | None = None,
) -> CaseResult:
    """Train the demo for ``case.steps`` iterations (SGD after each), every replica recorded
    with ``settings``; ``on_loss(index, step, loss)`` where the loss is (first replica)."""
    import torch

    from pipetrace.runtime.demo import build_demo_model
    from pipetrace.torch_pipelining.api import record
    from pipetrace.torch_pipelining.instrument import stages_of

    schedule = build_schedule(case, replicas, num_ranks)
    stages = stages_of(schedule)
    params = [p for stage in stages for p in stage.submod.parameters()]
    optimizer = torch.optim.SGD(params, lr=case.learning_rate)
    reference = None
    if case.check_parity:  # the same weights, built again from the seed
        num_stages = stages[0].num_stages
        reference = build_demo_model(num_stages, case.demo, seed=case.seed)
    losses: list[float] = []
    report = None
    with record(schedule, settings=settings, config=case.config):
        for step in range(case.steps):
            if case.forward_only:
                _forward_pass(case, schedule, replicas, step, "step")
                continue
            loss, parity_report = _train_step(case, schedule, replicas, step, reference)
            if parity_report is not None:
                report, reference = parity_report, None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if case.evaluate:
                _forward_pass(case, schedule, replicas, step, "eval")
            if loss is not None and replicas.replica == 0:
                losses.append(loss)
                if on_loss is not None:
                    on_loss(index, step, loss)
    return CaseResult(losses or None, report)


def _forward_pass(
    case: TorchCase, schedule: Any, replicas: Replicas, step: int, method: str
) -> None:
    """``schedule.<method>`` (``eval``, or ``step`` of a forward-only schedule) on the batch
    of ``step``, under ``torch.no_grad`` as an evaluation loop runs it."""
    import torch

    batch = _Batch.of(case, schedule, replicas, step)
    with torch.no_grad():
        getattr(schedule, method)(*batch.args, target=batch.target)


@dataclass(frozen=True)
class _Batch:
    """Step ``step``'s demo batch on this rank: the whole of it (for a reference), and this
    replica's share as ``schedule.step`` takes it here (inputs on the first stage's rank,
    targets on the last's)."""

    stages: list[Any]
    inputs: Any
    targets: Any
    args: tuple[Any, ...]
    target: Any

    @property
    def last(self) -> bool:
        return self.target is not None

    @classmethod
    def of(cls, case: TorchCase, schedule: Any, replicas: Replicas, step: int) -> _Batch:
        from pipetrace.runtime.demo import demo_batch
        from pipetrace.torch_pipelining.instrument import stages_of

        stages = stages_of(schedule)
        first = any(stage.is_first for stage in stages)
        last = any(stage.is_last for stage in stages)
        batch = case.microbatches * case.demo.microbatch_size
        inputs, targets = demo_batch(step, batch * replicas.count, case.demo, seed=case.seed)
        mine = slice(replicas.replica * batch, (replicas.replica + 1) * batch)
        args = (inputs[mine],) if first else ()
        return cls(stages, inputs, targets, args, targets[mine] if last else None)


def _train_step(
    case: TorchCase, schedule: Any, replicas: Replicas, step: int, reference: Any
) -> tuple[float | None, ParityReport | None]:
    """One ``schedule.step`` on this replica's share of the batch: (the loss averaged over
    the replicas, on the last stage's rank; the parity check against ``reference``)."""
    import torch

    from pipetrace.runtime import parity
    from pipetrace.runtime.demo import demo_loss

    batch = _Batch.of(case, schedule, replicas, step)
    stages, inputs, targets, last = batch.stages, batch.inputs, batch.targets, batch.last
    losses: list[Any] = []
    schedule.step(*batch.args, target=batch.target, losses=losses if last else None)
    loss = replicas.average(float(torch.stack(losses).detach().mean()) if last else None)
    if reference is None:
        return loss, None
    backend = replicas.backend
    reference_loss, reference_grads = backend.reference_gradients(
        reference, inputs, targets, demo_loss
    )
    held = {stage.stage_index: SimpleNamespace(module=stage.submod) for stage in stages}
    report = parity.compare(
        rank=replicas.pp_rank + replicas.replica * stages[0].group_size,
        gradients=backend.stage_gradients(held),
        loss=loss,
        reference_loss=reference_loss,
        reference_grads=reference_grads,
    )
    return loss, report


def main() -> None:
    """A rank of `run_torch_demo`: every case, one pipeline over the whole world."""
    import torch
    import torch.distributed as dist

    from pipetrace.runtime.backend import Replicas
    from pipetrace.runtime.torch_backend import TorchBackend

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cases: list[TorchCase] = pickle.loads(bytes.fromhex(os.environ[CASES_ENV]))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        replicas = Replicas(TorchBackend(torch.device("cpu")), rank)
        for case in cases:
            train(case, replicas, world_size, case.record_settings())
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
