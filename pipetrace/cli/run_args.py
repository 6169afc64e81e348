"""The run a command reads, given on its command line: one definition for analyze, tui,
export, diff and merge.

A run is one directory, or several (one per node, copied back from each node), or a glob
(``'runs/node*'``, quoted or expanded by the shell); `pipetrace.analyze.source` gathers them.
"""

from __future__ import annotations

import click

RUN_DIRS_HELP = (
    "RUN_DIR... is one run: its directory, or the directories it was recorded into (one per "
    "node), or a glob such as 'runs/node*'."
)


class NamedPath(click.Path):
    """A path on the command line that is not the empty string (which the file system would
    read as the current directory, and an option as "not given")."""

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        if value == "":
            self.fail("an empty path names nothing", param, ctx)
        return super().convert(value, param, ctx)


run_dirs = click.argument(
    "run_dirs", metavar="RUN_DIR...", nargs=-1, required=True, type=NamedPath(path_type=str)
)
"""The positional ``RUN_DIR...`` argument of a command that reads one run."""
