"""One rank of a demo training run, for every backend: started by `pipetrace run` (the
launchers in `pipetrace.runtime.launch` and `pipetrace.runtime.mindspore.cluster`), or by
hand as ``python -m pipetrace.runtime.worker --schedule ...`` under torchrun (RANK and
WORLD_SIZE come from torchrun; ``--ranks`` defaults to WORLD_SIZE / D) or, with
``--backend mindspore``, as a MindSpore worker under msrun (``--ranks`` defaults to the
number of workers).

A started rank may run several run configurations one after the other in the same process
group (the tests do, to pay the start-up of a rank, seconds, once for many schedules).
Written once against the backend seam (`pipetrace.runtime.backend`): no framework import
here.
"""

from __future__ import annotations

from collections.abc import Callable

import click

from pipetrace.cli.run_options import run_options
from pipetrace.recorder.hooks import RecorderHooks
from pipetrace.runtime import fault_spec, parity
from pipetrace.runtime.backend import DemoKit, Replicas, backend_module
from pipetrace.runtime.config import LossCallback, RunConfig, WorkerSpec
from pipetrace.runtime.rank_cli import entry, run_this_rank
from pipetrace.runtime.results import CaseResult
from pipetrace.runtime.runner import PipelineRunner
from pipetrace.runtime.split import stages_of_rank
from pipetrace.schedule.ir import Plan


def demo_kit(backend: str) -> DemoKit:
    """The demo-run side of backend ``backend``."""
    return backend_module(backend).DEMO()


def run_rank(
    rank: int | None, world_size: int | None, spec: WorkerSpec, on_loss: LossCallback | None = None
) -> list[CaseResult]:
    """Join the world, run every case, leave. Raises on any failure. ``rank`` and
    ``world_size`` are what the launcher meant (None: whatever the cluster assigns)."""
    kit = demo_kit(spec.cases[0].backend)
    rank, world_size = kit.start(rank, world_size, spec)
    results = []
    for index, case in enumerate(spec.cases):
        results.append(_run_case(kit, index, case, rank, spec, on_loss))
        kit.barrier()
    kit.stop()
    return results


def _run_case(
    kit: DemoKit,
    index: int,
    case: RunConfig,
    rank: int,
    spec: WorkerSpec,
    on_loss: LossCallback | None,
) -> CaseResult:
    if case.runtime == "torch":  # torch.distributed.pipelining runs the schedule
        from pipetrace.torch_pipelining.demo import run_config

        return run_config(kit, index, case, rank, on_loss)
    plan = case.plan()
    replicas = kit.replicas(case, rank)
    runner = _runner(kit, case, spec, rank, replicas, plan)
    # The reference is built again from the seed: the same weights, separate parameters.
    reference = (
        kit.build_model(plan.num_stages, case.demo, case.seed, tie_weights=case.tie_weights)
        if case.check_parity
        else None
    )
    with runner:  # reports an exception to the recorder, or ends the recording cleanly
        for kind, fn in spec.custom_functions:
            runner.register_custom_function(kind, fn)
        faults = [f for f in case.faults if (f.replica or 0) == replicas.replica]
        if faults:  # a fault strikes one pipeline rank of one replica
            from pipetrace.runtime.inject import install_faults

            install_faults(runner, faults, overlap=case.overlap_p2p)
        optimizer = kit.optimizer(runner, case.learning_rate)
        profiled = kit.profiled(case, rank)
        losses: list[float] = []
        report = None
        with profiled:
            for step in range(case.steps):
                loss, parity_report = _train_step(
                    kit, runner, replicas, case, step, rank, reference
                )
                if parity_report is not None:
                    report, reference = parity_report, None
                optimizer.step()
                if loss is not None and replicas.replica == 0:
                    losses.append(loss)
                    if on_loss is not None:
                        on_loss(index, step, loss)
    return CaseResult(losses if losses else None, report)


def _runner(
    kit: DemoKit,
    case: RunConfig,
    spec: WorkerSpec,
    rank: int,
    replicas: Replicas,
    plan: Plan,
) -> PipelineRunner:
    """The runner of this rank's stages of the demo model (sharded over the replicas with
    FSDP)."""
    model = kit.build_model(plan.num_stages, case.demo, case.seed, tie_weights=case.tie_weights)
    backend = replicas.backend
    modules = stages_of_rank(backend.split_model(model, plan.num_stages), plan, replicas.pp_rank)
    replicas.shard(modules)
    return PipelineRunner(
        backend,
        modules,
        schedule=plan,
        loss_fn=kit.loss_fn,
        overlap_p2p=case.overlap_p2p,
        recorder=_recorder_for(case, spec, rank, replicas),
        timeout=case.timeout,
        run_config=case.to_dict(),
        tied=case.demo.tied_names(plan.num_stages) if case.tie_weights else None,
    )


def _train_step(
    kit: DemoKit,
    runner: PipelineRunner,
    replicas: Replicas,
    case: RunConfig,
    step: int,
    rank: int,
    reference: object | None,
) -> tuple[float | None, parity.ParityReport | None]:
    """One step on this replica's share of the batch: (the loss averaged over the replicas,
    the parity check against ``reference`` if given)."""
    batch = case.microbatches * case.demo.microbatch_size
    inputs, targets = kit.batch(step, batch * replicas.count, case.demo, case.seed)
    if replicas.count > 1:
        mine = slice(replicas.replica * batch, (replicas.replica + 1) * batch)
        loss = runner.step(inputs[mine], targets[mine])
    else:
        loss = runner.step(inputs, targets)
    loss = replicas.average(loss)
    if reference is None:
        return loss, None
    report = parity.check(
        runner, reference, inputs, targets, loss=loss, loss_fn=kit.loss_fn, rank=rank
    )
    return loss, report


def _recorder_for(
    case: RunConfig, spec: WorkerSpec, rank: int, replicas: Replicas
) -> RecorderHooks:
    """The rank's recorder: the spec's factory (tests), else the run's --out/--record. Every
    replica records: its log is named by the global rank (`Backend.pipeline_place`)."""
    if spec.make_recorder is not None:
        return spec.make_recorder(rank, case.ranks)
    return replicas.backend.make_recorder(case.record_settings())


@click.command(epilog=fault_spec.FAULT_HELP)
@run_options
def main(make_config: Callable[..., RunConfig]) -> None:
    """One rank of a demo training run under torchrun, or under msrun with --backend
    mindspore (same flags as `pipetrace run`)."""
    probe = make_config(1, inject=False)
    probe.check_backend()
    kit = demo_kit(probe.backend)
    launched = kit.launched()
    if launched is None:
        raise click.UsageError(
            f"{kit.launcher_env} not set: start this under {kit.launcher}, or use "
            f"`pipetrace run{'' if probe.backend == 'torch' else ' --backend ' + probe.backend}`"
        )
    rank, world_size = launched
    default_ranks, rest = divmod(world_size, probe.data_parallel)
    config = make_config(default_ranks)
    if rest or config.world_size != world_size:
        raise click.UsageError(
            f"--ranks {config.ranks} x --data-parallel {config.data_parallel} = "
            f"{config.world_size} processes, but {kit.launcher} started {world_size}"
        )
    config.plan()  # fail on an impossible schedule before joining the group
    who = "this rank" if rank is None else f"rank {rank}"
    run_this_rank(lambda spec, on_loss: run_rank(rank, world_size, spec, on_loss), config, who)


if __name__ == "__main__":
    entry(main, "python -m pipetrace.runtime.worker")
