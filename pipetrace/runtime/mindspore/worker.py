"""One rank of a demo training run on MindSpore: started by ``pipetrace run --backend
mindspore`` (`pipetrace.runtime.mindspore.cluster`), or by ``msrun`` / your own MS_* setup as
``python -m pipetrace.runtime.mindspore.worker --schedule ...`` (same flags).

A started rank may run several run configurations one after the other in the same cluster
(the tests do, to pay MindSpore's start-up of several seconds once for many schedules).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from pipetrace.cli.run_options import run_options
from pipetrace.recorder.hooks import RecorderHooks
from pipetrace.recorder.setup import mindspore_recorder
from pipetrace.runtime.config import LossCallback, RunConfig, WorkerSpec
from pipetrace.runtime.rank_cli import entry, run_this_rank
from pipetrace.runtime.results import CaseResult


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


def run_rank(
    rank: int | None, world_size: int | None, spec: WorkerSpec, on_loss: LossCallback | None = None
) -> list[CaseResult]:
    """Join the cluster, run every case, leave. Raises on any failure. ``rank`` and
    ``world_size`` (what the launcher meant) are checked against the cluster's."""
    from mindspore.communication import release

    from pipetrace.runtime.mindspore.api import init_cluster

    setup_mindspore(threads=spec.threads_per_rank)
    actual_rank, actual_size = init_cluster(timeout=max(case.timeout for case in spec.cases))
    if (rank, world_size) not in ((None, None), (actual_rank, actual_size)):
        raise RuntimeError(
            f"started as rank {rank} of {world_size}, but the cluster made it rank "
            f"{actual_rank} of {actual_size}"
        )
    results = []
    for index, case in enumerate(spec.cases):
        results.append(_run_case(index, case, actual_rank, spec, on_loss))
        _barrier(actual_rank, actual_size)
    release()
    return results


def _barrier(rank: int, world_size: int) -> None:
    """Every rank waits for all (between cases). Over P2P rather than ``comm.barrier()``, which
    on CPU logs a misleading "CPU device is not supported" error (MindSpore 2.10)."""
    from pipetrace.recorder.clock import mindspore_int_exchange

    send_ints, recv_ints = mindspore_int_exchange()
    if rank == 0:
        for peer in range(1, world_size):
            recv_ints(peer, 1)
        for peer in range(1, world_size):
            send_ints(peer, [0])
    else:
        send_ints(0, [rank])
        recv_ints(0, 1)


def _run_case(
    index: int, case: RunConfig, rank: int, spec: WorkerSpec, on_loss: LossCallback | None
) -> CaseResult:
    from pipetrace.runtime.mindspore import parity
    from pipetrace.runtime.mindspore.api import PipelineRunner
    from pipetrace.runtime.mindspore.demo import build_demo_model, demo_batch, demo_loss
    from pipetrace.runtime.mindspore.split import split_sequential, stages_of_rank

    plan = case.plan()
    model = build_demo_model(plan.num_stages, case.demo, seed=case.seed)
    # The reference is built again from the seed: the same weights, separate parameters.
    reference = (
        build_demo_model(plan.num_stages, case.demo, seed=case.seed) if case.check_parity else None
    )
    cells = stages_of_rank(split_sequential(model, plan.num_stages), plan, rank)
    recorder: RecorderHooks = (
        spec.make_recorder(rank, case.ranks)
        if spec.make_recorder is not None
        else mindspore_recorder(case.record_settings())
    )
    runner = PipelineRunner(
        cells,
        schedule=plan,
        loss_fn=demo_loss,
        overlap_p2p=case.overlap_p2p,
        recorder=recorder,
        timeout=case.timeout,
        run_config=case.to_dict(),
    )
    with runner:  # reports an exception to the recorder, or ends the recording cleanly
        for kind, fn in spec.custom_functions:
            runner.register_custom_function(kind, fn)
        if getattr(case, "faults", ()):
            # --inject is refused for MindSpore in `faults.resolve_faults` today; its compute
            # faults (crash, hang, straggler, deadlock) wrap step handlers and work on this
            # runner unchanged, so lifting that check is all it takes for them.
            from pipetrace.runtime.inject import install_faults

            install_faults(runner, case.faults, overlap=case.overlap_p2p)  # type: ignore[arg-type]
        batch = case.microbatches * case.demo.microbatch_size
        losses: list[float] = []
        report = None
        for step in range(case.steps):
            inputs, targets = demo_batch(step, batch, case.demo, seed=case.seed)
            loss = runner.step(inputs, targets)
            if step == 0 and reference is not None:
                ref_loss, ref_grads = parity.reference_gradients(
                    reference, inputs, targets, demo_loss
                )
                report = parity.compare(
                    rank=rank,
                    stage_gradients=runner.named_gradients(),
                    loss=loss,
                    reference_loss=ref_loss,
                    reference_grads=ref_grads,
                )
                reference = None
            _sgd(runner, case.learning_rate)
            runner.zero_grad()
            if loss is not None:
                losses.append(loss)
                if on_loss is not None:
                    on_loss(index, step, loss)
    return CaseResult(losses if losses else None, report)


def _sgd(runner: Any, learning_rate: float) -> None:
    """Plain SGD (MindSpore's nn.SGD takes float16/float32 parameters only; the demo is float64)."""
    for param, grad in zip(runner.parameters(), runner.gradients()):
        param.set_data(param - grad * learning_rate)


@click.command()
@run_options
def main(make_config: Callable[..., RunConfig]) -> None:
    """One rank of a demo training run as a MindSpore worker, e.g. under msrun (same flags as
    `pipetrace run`; --ranks defaults to the number of workers)."""
    import os

    workers = os.environ.get("MS_WORKER_NUM")
    if workers is None:
        raise click.UsageError(
            "MS_WORKER_NUM is not set: start this as a MindSpore worker (msrun), or use "
            "`pipetrace run --backend mindspore`"
        )
    config = make_config(int(workers))
    config.check_backend()
    config.plan()  # fail on an impossible schedule before joining the cluster

    run_this_rank(lambda spec, on_loss: run_rank(None, None, spec, on_loss), config, "this rank")


if __name__ == "__main__":
    entry(main, "python -m pipetrace.runtime.mindspore.worker")
