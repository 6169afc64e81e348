"""`pipetrace tui`: inspect a recorded run interactively."""

from __future__ import annotations

import sys

import click

from pipetrace.cli.load_options import Loading, load_options
from pipetrace.cli.run_args import RUN_DIRS_HELP, run_dirs
from pipetrace.errors import EXIT_OK, EXIT_USAGE, PipetraceError
from pipetrace.printable import printable


@click.command(epilog=RUN_DIRS_HELP)
@run_dirs
@load_options
def tui(run_dirs: tuple[str, ...], loading: Loading) -> int:
    """Inspect a recorded run interactively.

    A timeline of every rank (steps coloured by kind, P2P ops in flight, the plan beside what
    ran), the analyzers' findings, step details and metrics. The run loads in the background;
    press ? for the keys.

    \b
    Examples:
      pipetrace tui runs/demo
      pipetrace tui runs/node0 runs/node1     # one run, a directory per node
      pipetrace tui runs/big --replica 3      # one pipeline of a data-parallel job
    """
    from pipetrace.analyze.source import open_source

    source = open_source(run_dirs)  # a missing or foreign directory fails here, at once
    try:
        from pipetrace.tui.app import PipetraceApp
    except ImportError as exc:
        raise PipetraceError(
            f"the TUI needs textual ({exc.name} is missing): pip install 'pipetrace[tui]'"
        ) from None
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise PipetraceError(
            "pipetrace tui needs a terminal (stdin and stdout); run it in a terminal"
        )
    app = PipetraceApp(source, load=loading.kwargs())
    app.run()
    if app.load_error:
        click.echo(f"pipetrace: error: {printable(app.load_error)}", err=True)
        return EXIT_USAGE
    return app.return_code or EXIT_OK  # non-zero when the app itself failed
