"""`pipetrace run`: train the demo model on local ranks with a pipeline schedule."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

import click

from pipetrace.cli.run_options import run_options
from pipetrace.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEMS, EXIT_TERMINATED
from pipetrace.recorder import format as fmt
from pipetrace.recorder import run_dir
from pipetrace.runtime.config import RunConfig
from pipetrace.runtime.fault_spec import FAULT_HELP
from pipetrace.runtime.results import ParityReport, RankFailure


@click.command(epilog=FAULT_HELP)
@run_options
def run(make_config: Callable[[int], RunConfig]) -> int:
    """Train on local ranks with a pipeline schedule.

    Starts P x D processes joined by a gloo group on 127.0.0.1 (with --backend mindspore:
    a MindSpore scheduler and P workers), trains the built-in demo model (a float64 MLP on
    synthetic data, SGD) for --steps iterations and prints the loss after each. Flags and
    the schedule are checked before any process starts. With --runtime torch the schedule's
    torch.distributed.pipelining class runs it instead of pipetrace's runtime, recorded by
    the adapter (docs/torch-pipelining.md).

    \b
    Examples:
      pipetrace run --schedule 1f1b --ranks 4 --microbatches 8
      pipetrace run -s zbv -p 4 -m 8 --overlap-p2p --check-parity
      pipetrace run -s 1f1b -p 4 -m 8 --out run/ && pipetrace analyze run/
      pipetrace run -s zb1p -p 2 -m 4 --backend mindspore --check-parity
      pipetrace run -s 1f1b -p 4 -m 8 --swap stage=0 --check-parity
      pipetrace run -s interleaved-1f1b -p 2 -m 4 --overlap-bf --check-parity
      pipetrace run -s zbv -p 4 -m 8 --inject hang:rank=2 --out run/; pipetrace analyze run/
      pipetrace run -s interleaved-1f1b -p 2 -m 4 --runtime torch --out torch_run/
      pipetrace diff run/ torch_run/      # the same model, data and schedule on both runtimes
    """
    config = make_config(2)
    config.check_local_processes()
    config.check_backend()
    plan = config.plan()
    if config.out is None and config.record != "off":
        config = dataclasses.replace(config, out=_default_run_dir(plan.name))
    recorded = config.record_settings().enabled  # also checks the PIPETRACE_* variables
    if recorded:
        _claim_run_dir(config)
    click.echo(
        f"{plan.name}: {config.ranks} ranks, {plan.num_stages} stages on ranks "
        f"{','.join(map(str, plan.placement))}, {config.microbatches} micro-batches, "
        + _executed_by(config)
        + (f", FSDP over {config.data_parallel} replica(s)" if config.fsdp else "")
    )
    for fault in config.faults:
        where = "" if fault.replica is None else f" (in replica {fault.replica})"
        click.echo(f"injecting {fault.describe(plan, overlap=config.overlap_p2p)}{where}")

    if config.backend == "mindspore":  # a MindSpore scheduler and workers, all started here
        from pipetrace.runtime.mindspore.cluster import launch
    else:
        from pipetrace.runtime.launch import launch  # only the ranks it starts import torch

    result = launch(
        [config], on_loss=lambda _case, step, loss: click.echo(f"step {step + 1}  loss {loss:.6f}")
    )
    kept = recorded and _holds_a_recording(Path(config.out))
    if result.interrupted is not None:
        note = f"; recording kept in {config.out}" if kept else ""
        how = "interrupted" if result.interrupted_by == "SIGINT" else "terminated (SIGTERM)"
        click.echo(f"{how}: {result.interrupted} ranks stopped{note}", err=True)
        return EXIT_INTERRUPTED if result.interrupted_by == "SIGINT" else EXIT_TERMINATED
    if result.failures:
        _report_failures(result.failures, config.out if kept else None)
        return EXIT_PROBLEMS
    code = EXIT_OK
    if config.check_parity:
        code = _report_parity([cases[0].parity for _, cases in sorted(result.results.items())])
    if recorded:
        click.echo(f"recorded to {config.out}; next: pipetrace analyze {config.out}")
    return code


def _report_failures(failures: list[RankFailure], trace: str | None) -> None:
    """The first rank's error (the cause, usually), the others' after it, and where the
    trace that explains them is."""
    first, *others = failures
    click.echo(f"pipetrace: error: rank {first.rank} failed: {first.error}", err=True)
    for other in others:
        click.echo(f"  then rank {other.rank}: {other.error}", err=True)
    if trace is not None:
        click.echo(f"trace in {trace}; diagnose with: pipetrace analyze {trace}", err=True)


def _executed_by(config: RunConfig) -> str:
    """Which runtime runs the plan, as the run's first line says it."""
    if config.runtime == "torch":
        from pipetrace.torch_pipelining.demo import torch_class

        return f"run by torch.distributed.pipelining's {torch_class(config.schedule)}"
    return f"{'overlapped' if config.overlap_p2p else 'plain'} P2P"


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


def _claim_run_dir(config: RunConfig) -> None:
    """Make ``config.out`` this run's directory before any rank starts (`run_dir.claim`,
    with this process's run id, which its ranks derive as their parent's): a directory that
    cannot be created, is a link, belongs to another user or holds a previous run (unless
    --overwrite) is refused here, so that every rank agrees."""
    out = Path(config.out)
    run_dir.check_directory(out, create=True)
    if config.overwrite:
        run_dir.remove_previous_run(out)
    run_dir.claim(out, run_dir.process_run_id(os.getpid()))


def _holds_a_recording(out: Path) -> bool:
    """Whether ``out`` holds something `pipetrace analyze` can read: meta.json (rank 0
    writes it as it starts recording) and a rank log."""
    names = {path.name for path in run_dir.previous_run_files(out)}
    return fmt.META_FILE in names and any(map(fmt.is_rank_log_name, names))


def _default_run_dir(schedule: str) -> str:
    """A new directory under runs/, named for the schedule and the time; made here, so a
    run started in the same second (a sweep, another terminal) takes the next suffix."""
    base = f"runs/{schedule}-{time.strftime('%Y%m%d-%H%M%S')}"
    name, suffix = base, 1
    while True:
        try:
            Path(name).mkdir(parents=True)
            return name
        except FileExistsError:
            suffix += 1
            name = f"{base}-{suffix}"
        except OSError as exc:
            raise run_dir.RunDirError(f"cannot make {name} ({exc.strerror}): give --out") from None
