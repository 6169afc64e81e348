"""What ranks report back: plain data, picklable, no torch (the launcher never imports it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Mismatch:
    """One quantity that differs from the single-process reference beyond the tolerance."""

    what: str
    """``loss`` or ``gradient of <parameter name> (stage <s>)``."""
    relative_error: float
    """``max|value - reference| / max|reference|`` (inf when missing or mis-shaped)."""


@dataclass
class ParityReport:
    """One rank's comparison with the single-process run (see `pipetrace.runtime.parity`)."""

    rank: int
    """The process that made this comparison."""
    tolerance: float
    """The largest relative error accepted."""
    compared: int = 0
    """Quantities compared: gradients, plus the loss on the last stage's rank."""
    max_relative_error: float = 0.0
    """The largest relative error seen."""
    mismatches: list[Mismatch] = field(default_factory=list)
    """Quantities beyond the tolerance."""

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def problems(self) -> list[str]:
        """One line per mismatch, naming the rank, the quantity and the error."""
        return [
            f"parity check failed on rank {self.rank}: {m.what}: relative error "
            f"{m.relative_error:.3g} > {self.tolerance:g}"
            for m in self.mismatches
        ]

    def add(self, what: str, error: float) -> None:
        self.compared += 1
        self.max_relative_error = max(self.max_relative_error, error)
        if not error <= self.tolerance:  # NaN fails too
            self.mismatches.append(Mismatch(what, error))


@dataclass
class CaseResult:
    """One rank's outcome of one run configuration."""

    losses: list[float] | None
    """Loss per step on the rank that reports it (last stage, replica 0); None elsewhere."""
    parity: ParityReport | None
    """The parity check after step 1, when asked for."""


@dataclass
class RankFailure:
    """A rank that did not finish."""

    rank: int
    """The failed process."""
    error: str
    """``ExceptionType: first line of the message``, or how the process ended."""
    traceback: str = ""
    """The full traceback, when the rank could send one."""
    at: float = 0.0
    """Wall-clock time of the failure (orders failures across ranks)."""


@dataclass
class LaunchResult:
    """The outcome of a local launch: per-rank results, or who failed and why."""

    world_size: int
    """Processes started."""
    results: dict[int, list[CaseResult]] = field(default_factory=dict)
    """Rank -> one result per run configuration, for ranks that finished."""
    failures: list[RankFailure] = field(default_factory=list)
    """Failed ranks, earliest first: the first is the likely cause, the others followed."""
    pids: list[int] = field(default_factory=list)
    """The rank processes' ids (all reaped when `launch` returns)."""
    interrupted: int | None = None
    """How many ranks were still running when the user interrupted the launch (Ctrl-C) or
    something terminated it (SIGTERM); None when nothing did."""
    interrupted_by: str = "SIGINT"
    """The signal that did: "SIGINT" or "SIGTERM"."""

    @property
    def ok(self) -> bool:
        return (
            not self.failures and len(self.results) == self.world_size and self.interrupted is None
        )


def describe_error(exc: BaseException) -> str:
    """``Type: first line of the message``: what a one-line failure report shows."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
