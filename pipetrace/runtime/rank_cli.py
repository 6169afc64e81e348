"""The per-rank command line of the demo worker (``python -m pipetrace.runtime.worker`` under
torchrun or msrun): run this process's rank of a demo training run, print each step's loss
and the parity verdict, and exit non-zero when the rank fails. No framework import here.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any

import click

from pipetrace.errors import PipetraceError
from pipetrace.runtime.config import LossCallback, RunConfig, WorkerSpec
from pipetrace.runtime.results import CaseResult, describe_error


def run_this_rank(
    run: Callable[[WorkerSpec, LossCallback], list[CaseResult]], config: RunConfig, who: str
) -> None:
    """``run(spec, on_loss)`` runs the rank; ``who`` names it in the failure message."""

    def print_loss(_case: int, step: int, loss: float) -> None:
        click.echo(f"step {step + 1}  loss {loss:.6f}")

    try:
        (result,) = run(WorkerSpec((config,)), print_loss)
    except Exception as exc:
        traceback.print_exc()
        click.echo(f"pipetrace: error: {who} failed: {describe_error(exc)}", err=True)
        sys.exit(1)
    report = result.parity
    if report is None:
        return
    for problem in report.problems():
        click.echo(f"pipetrace: error: {problem}", err=True)
    if not report.ok:
        sys.exit(1)
    click.echo(
        f"rank {report.rank}: parity ok ({report.compared} checked, max relative error "
        f"{report.max_relative_error:.3g})"
    )


def entry(command: click.Command, prog_name: str, argv: list[str] | None = None) -> Any:
    """Run a click command as a module's main: a user error is one line and its exit code."""
    try:
        return command.main(args=argv, prog_name=prog_name, standalone_mode=True)
    except PipetraceError as exc:
        click.echo(f"pipetrace: error: {exc}", err=True)
        sys.exit(exc.exit_code)
