"""`pipetrace run`: train the demo model on local ranks with a pipeline schedule."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import click

from pipetrace.cli.run_options import run_options
from pipetrace.errors import EXIT_OK, EXIT_PROBLEMS
from pipetrace.runtime.config import RunConfig
from pipetrace.runtime.fault_spec import FAULT_HELP
from pipetrace.runtime.results import ParityReport


@click.command(epilog=FAULT_HELP)
@run_options
def run(make_config: Callable[[int], RunConfig]) -> int:
    """Train on local ranks with a pipeline schedule.

    Starts P x D processes joined by a gloo group on 127.0.0.1 (with --backend mindspore:
    a MindSpore scheduler and P workers), trains the built-in demo model (a float64 MLP on
    synthetic data, SGD) for --steps iterations and prints the loss after each. Flags and
    the schedule are checked before any process starts.

    \b
    Examples:
      pipetrace run --schedule 1f1b --ranks 4 --microbatches 8
      pipetrace run -s zbv -p 4 -m 8 --overlap-p2p --check-parity
      pipetrace run -s 1f1b -p 4 -m 8 --out run/ && pipetrace analyze run/
      pipetrace run -s zb1p -p 2 -m 4 --backend mindspore --check-parity
      pipetrace run -s zbv -p 4 -m 8 --inject hang:rank=2 --out run/ && pipetrace analyze run/
    """
    config = make_config(2)
    config.check_backend()
    plan = config.plan()
    if config.out is None and config.record != "off":
        config = dataclasses.replace(config, out=_default_run_dir(plan.name))
    click.echo(
        f"{plan.name}: {config.ranks} ranks, {plan.num_stages} stages on ranks "
        f"{','.join(map(str, plan.placement))}, {config.microbatches} micro-batches, "
        f"{'overlapped' if config.overlap_p2p else 'plain'} P2P"
        + (f", FSDP over {config.data_parallel} replica(s)" if config.fsdp else "")
    )
    for fault in config.faults:
        click.echo(f"injecting {fault.describe(plan, overlap=config.overlap_p2p)}")

    if config.backend == "mindspore":  # a MindSpore scheduler and workers, all started here
        from pipetrace.runtime.mindspore.cluster import launch
    else:
        from pipetrace.runtime.launch import launch  # only the ranks it starts import torch

    result = launch(
        [config], on_loss=lambda _case, step, loss: click.echo(f"step {step + 1}  loss {loss:.6f}")
    )
    recorded = config.out is not None and config.record != "off"
    if result.failures:
        first, *others = result.failures
        click.echo(f"pipetrace: error: rank {first.rank} failed: {first.error}", err=True)
        for other in others:
            click.echo(f"  then rank {other.rank}: {other.error}", err=True)
        if recorded:
            click.echo(
                f"trace in {config.out}; diagnose with: pipetrace analyze {config.out}", err=True
            )
        return EXIT_PROBLEMS
    code = EXIT_OK
    if config.check_parity:
        code = _report_parity([cases[0].parity for _, cases in sorted(result.results.items())])
    if recorded:
        click.echo(f"recorded to {config.out}; next: pipetrace analyze {config.out}")
    return code


def _report_parity(reports: list[ParityReport]) -> int:
    problems = [problem for report in reports for problem in report.problems()]
    for problem in problems:
        click.echo(f"pipetrace: error: {problem}", err=True)
    if problems:
        return EXIT_PROBLEMS
    compared = sum(report.compared for report in reports)
    worst = max(report.max_relative_error for report in reports)
    click.echo(
        f"parity ok: loss and gradients match a single-process run "
        f"({compared} quantities, max relative error {worst:.2g} <= {reports[0].tolerance:g})"
    )
    return EXIT_OK


def _default_run_dir(schedule: str) -> str:
    return f"runs/{schedule}-{time.strftime('%Y%m%d-%H%M%S')}"
