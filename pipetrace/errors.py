"""The one error type users see: a one-line message and an exit code, printed by the CLI."""

from __future__ import annotations

# Exit codes shared by every command.
EXIT_OK = 0
EXIT_PROBLEMS = 1  # the command worked and found problems (findings, failed ranks, ...)
EXIT_USAGE = 2  # bad flags or unusable input
EXIT_INTERRUPTED = 130  # the user interrupted it (Ctrl-C): 128 + SIGINT, as shells report it
EXIT_TERMINATED = 143  # SIGTERM (a scheduler's time limit, `timeout`): 128 + 15


class PipetraceError(Exception):
    """An expected failure, reported as one line without a traceback."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code
