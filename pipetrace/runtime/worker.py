"""One rank of a demo training run: spawned by `pipetrace run`, or started by torchrun as
``python -m pipetrace.runtime.worker --schedule ... `` (RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT come from torchrun; ``--ranks`` defaults to WORLD_SIZE / D).

A spawned rank may run several run configurations one after the other in the same process
group (the tests do, to pay the ~2 s start-up of a rank once for many schedules).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path

import click
import torch
import torch.distributed as dist

from pipetrace.cli.run_options import run_options
from pipetrace.recorder.format import PROFILER_DIR
from pipetrace.recorder.hooks import NullRecorder, RecorderHooks
from pipetrace.recorder.setup import torch_recorder
from pipetrace.runtime import faults as _faults
from pipetrace.runtime import parity
from pipetrace.runtime.api import PipelineRunner, init_distributed
from pipetrace.runtime.config import LossCallback, RunConfig, WorkerSpec
from pipetrace.runtime.demo import build_demo_model, demo_batch, demo_loss
from pipetrace.runtime.rank_cli import entry, run_this_rank
from pipetrace.runtime.results import CaseResult
from pipetrace.runtime.split import split_sequential, stages_of_rank


def device_for(local_rank: int) -> torch.device:
    """CUDA device ``local_rank`` when there is one (NCCL; made current, as NCCL needs), else
    the CPU (gloo)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def run_rank(
    rank: int, world_size: int, spec: WorkerSpec, on_loss: LossCallback | None = None
) -> list[CaseResult]:
    """Join the process group (env://), run every case, leave. Raises on any failure."""
    if spec.threads_per_rank:
        torch.set_num_threads(spec.threads_per_rank)
    device = device_for(int(os.environ.get("LOCAL_RANK", rank)))
    init_distributed(device, timeout=max(case.timeout for case in spec.cases))
    results = []
    for index, case in enumerate(spec.cases):
        results.append(_run_case(index, case, rank, world_size, device, spec, on_loss))
        dist.barrier()
    dist.destroy_process_group()
    return results


def _run_case(
    index: int,
    case: RunConfig,
    rank: int,
    world_size: int,
    device: torch.device,
    spec: WorkerSpec,
    on_loss: LossCallback | None,
) -> CaseResult:
    plan = case.plan()
    num_ranks, replicas = case.ranks, case.data_parallel
    pp_rank, replica = rank % num_ranks, rank // num_ranks
    pp_group = dp_group = dp_mesh = None
    if replicas > 1 or case.fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (replicas, num_ranks), mesh_dim_names=("dp", "pp"))
        pp_group, dp_group, dp_mesh = mesh.get_group("pp"), mesh.get_group("dp"), mesh["dp"]

    model = build_demo_model(plan.num_stages, case.demo, seed=case.seed).to(device)
    reference = copy.deepcopy(model) if case.check_parity else None
    modules = stages_of_rank(split_sequential(model, plan.num_stages), plan, pp_rank)
    if case.fsdp:
        from torch.distributed.fsdp import fully_shard

        for module in modules.values():
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)

    recorder = _recorder_for(case, spec, rank, world_size, replica)
    runner = PipelineRunner(
        modules,
        schedule=plan,
        loss_fn=demo_loss,
        overlap_p2p=case.overlap_p2p,
        group=pp_group,
        device=device,
        recorder=recorder,
        run_config=case.to_dict(),
    )
    with runner:  # reports an exception to the recorder, or ends the recording cleanly
        for kind, fn in spec.custom_functions:
            runner.register_custom_function(kind, fn)
        if case.faults and replica == 0:  # faults strike the recorded pipeline (D is 1 with faults)
            from pipetrace.runtime.inject import install_faults

            install_faults(runner, case.faults, overlap=case.overlap_p2p)
        optimizer = torch.optim.SGD(runner.parameters(), lr=case.learning_rate)
        batch = case.microbatches * case.demo.microbatch_size
        losses: list[float] = []
        report = None
        profiler = _start_profiler(case) if replica == 0 else None
        for step in range(case.steps):
            inputs, targets = demo_batch(step, batch * replicas, case.demo, seed=case.seed)
            inputs, targets = inputs.to(device), targets.to(device)
            mine = slice(replica * batch, (replica + 1) * batch)
            loss = runner.step(inputs[mine], targets[mine])
            if loss is not None and dp_group is not None:
                total = torch.tensor([loss], dtype=torch.float64, device=device)
                dist.all_reduce(total, group=dp_group)
                loss = total.item() / replicas
            if step == 0 and reference is not None:
                ref_loss, ref_grads = parity.reference_gradients(
                    reference, inputs, targets, demo_loss
                )
                report = parity.compare(
                    rank=rank,
                    stage_modules=runner.stage_modules,
                    loss=loss,
                    reference_loss=ref_loss,
                    reference_grads=ref_grads,
                )
                reference = None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if loss is not None and replica == 0:
                losses.append(loss)
                if on_loss is not None:
                    on_loss(index, step, loss)
        if profiler is not None:
            _stop_profiler(profiler, case, rank)
    return CaseResult(losses if losses else None, report)


def _recorder_for(
    case: RunConfig, spec: WorkerSpec, rank: int, world_size: int, replica: int
) -> RecorderHooks:
    """The rank's recorder: the spec's factory (tests), else the run's --out/--record.

    With data parallelism only replica 0's pipeline is recorded: a trace holds one pipeline,
    whose ranks are the first P global ranks (which clock alignment relies on)."""
    if replica > 0:
        return NullRecorder()
    if spec.make_recorder is not None:
        return spec.make_recorder(rank, case.ranks)
    return torch_recorder(case.record_settings())


def _start_profiler(case: RunConfig) -> torch.profiler.profile | None:
    if not case.torch_profiler or not case.record_settings().enabled:
        return None
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    profiler.start()
    return profiler


def _stop_profiler(profiler: torch.profiler.profile, case: RunConfig, rank: int) -> None:
    profiler.stop()
    directory = Path(case.record_settings().run_dir) / PROFILER_DIR
    directory.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(directory / f"rank-{rank:05d}.json"))


@click.command(epilog=_faults.FAULT_HELP)
@run_options
def main(make_config: Callable[[int], RunConfig]) -> None:
    """One rank of a demo training run under torchrun (same flags as `pipetrace run`)."""
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError:
        raise click.UsageError(
            "RANK and WORLD_SIZE are not set: start this under torchrun, or use `pipetrace run`"
        ) from None
    replicas = make_config(1, inject=False).data_parallel
    default_ranks, rest = divmod(world_size, replicas)
    config = make_config(default_ranks)
    if rest or config.world_size != world_size:
        raise click.UsageError(
            f"--ranks {config.ranks} x --data-parallel {config.data_parallel} = "
            f"{config.world_size} processes, but torchrun started {world_size}"
        )
    config.check_backend()
    config.plan()  # fail on an impossible schedule before joining the group

    run_this_rank(
        lambda spec, on_loss: run_rank(rank, world_size, spec, on_loss), config, f"rank {rank}"
    )


if __name__ == "__main__":
    entry(main, "python -m pipetrace.runtime.worker")
