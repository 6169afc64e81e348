"""The `pipetrace` command line. Each verb lives in its own module, imported only when used,
so that `pipetrace schedule`, `analyze`, `tui` and `export` start without importing torch."""

from __future__ import annotations

import importlib
import sys

import click

from pipetrace import __version__
from pipetrace.errors import EXIT_INTERRUPTED, PipetraceError
from pipetrace.printable import printable
from pipetrace.schedule.ir import ScheduleError

# verb -> (module, attribute, one-line help shown by `pipetrace --help`)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "schedule": (
        "pipetrace.cli.schedule",
        "schedule",
        "Show, verify and simulate pipeline schedules.",
    ),
    "tui": ("pipetrace.cli.tui", "tui", "Inspect a recorded run interactively."),
    "run": ("pipetrace.cli.run", "run", "Train on local ranks with a pipeline schedule."),
    "analyze": (
        "pipetrace.cli.analyze",
        "analyze",
        "Diagnose a recorded run: findings, then metrics.",
    ),
    "diff": (
        "pipetrace.cli.diff",
        "diff",
        "Compare two recorded runs: stage times, bubbles, iteration time.",
    ),
    "export": ("pipetrace.cli.export", "export", "Export a recorded run for ui.perfetto.dev."),
    "merge": (
        "pipetrace.cli.merge",
        "merge",
        "Write a run recorded into several directories (one per node) as one.",
    ),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _COMMANDS:
            return None
        module, attr, _ = _COMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, _COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pipetrace")
def cli() -> None:
    """pipetrace: find out why a pipeline-parallel training job is slow, wrong or hung.

    \b
    Typical use:
      pipetrace run --schedule 1f1b --ranks 4 --microbatches 8 --out run/
      pipetrace analyze run/
      pipetrace tui run/
      pipetrace export run/ -o run.pftrace
      pipetrace schedule verify zbv --ranks 4 --microbatches 16 --semantics rendezvous

    Exit codes: 0 clean, 1 problems found, 2 usage or input error.
    """


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code; user errors print one line, never a traceback."""
    try:
        # Outside standalone mode click returns the command's own return value: commands
        # return an exit code (1 when they found problems) instead of calling sys.exit.
        result = cli.main(args=argv, prog_name="pipetrace", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.Abort:
        click.echo("Aborted.", err=True)
        return EXIT_INTERRUPTED
    except click.UsageError as exc:  # click's own is four lines: usage, a hint, a blank, the error
        command = exc.ctx.command_path if exc.ctx else "pipetrace"
        click.echo(f"{command}: error: {exc.format_message()} (see {command} --help)", err=True)
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except PipetraceError as exc:
        click.echo(f"pipetrace: error: {printable(str(exc))}", err=True)
        return exc.exit_code
    except ScheduleError as exc:
        click.echo(f"pipetrace: error: {printable(str(exc))}", err=True)
        return 2
    except BrokenPipeError:
        return 0
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
