"""The finding record every analyzer returns, and its stable kinds and severities."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipetrace.records import JsonRecord, record_json

ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITIES = (ERROR, WARNING, INFO)
_RANK = {ERROR: 0, WARNING: 1, INFO: 2}

# Stable kind names (docs/analyze.md).
DEADLOCK = "deadlock"
RANK_STALLED = "rank_stalled"
RANK_FAILED = "rank_failed"
UNMATCHED_SEND = "unmatched_send"
UNMATCHED_RECV = "unmatched_recv"
MESSAGE_MISMATCH = "message_mismatch"
ORDER_CROSSING = "order_crossing"
PLAN_DIVERGENCE = "plan_divergence"
STRAGGLER = "straggler"
EXPOSED_COMM = "exposed_comm"
INTERRUPTED = "interrupted"
STALL_RECOVERED = "stall_recovered"
NONFINITE_LOSS = "nonfinite_loss"
DEVICE_HANG = "device_hang"
KINDS = (
    INTERRUPTED,
    RANK_FAILED,
    DEADLOCK,
    RANK_STALLED,
    DEVICE_HANG,
    UNMATCHED_SEND,
    UNMATCHED_RECV,
    MESSAGE_MISMATCH,
    ORDER_CROSSING,
    PLAN_DIVERGENCE,
    NONFINITE_LOSS,
    STRAGGLER,
    STALL_RECOVERED,
    EXPOSED_COMM,
)


@dataclass(frozen=True)
class StepRef(JsonRecord):
    """One step on one rank: what a finding points at."""

    rank: int
    step: str  # canonical text, e.g. "2F3" or "1RECV_B0"
    iteration: int | None = None
    position: int | None = None  # index in the rank's plan (bubbles excluded)
    time_ns: int | None = None  # when it began (ns since Run.t0_ns)
    note: str | None = None  # e.g. "blocked in recv from rank 2"


@dataclass
class Finding:
    """What went wrong in a recorded run, where and when, and its likely cause.

    The static verifier has its own `pipetrace.schedule.verify.Finding`, on purpose: it is
    about a plan, not a run, so it has no cause, time, iteration or details, and its step
    positions count the plan's bubbles while these (`StepRef.position`) do not. Each is a
    documented JSON contract (docs/schedules.md, docs/analyze.md); one type for both would
    give a field two meanings depending on who made it. They share the severity words."""

    kind: str
    severity: str
    message: str  # one line: what happened
    cause: str  # one line: the likely cause
    ranks: list[int] = field(default_factory=list)
    steps: list[StepRef] = field(default_factory=list)
    microbatches: list[int] = field(default_factory=list)
    iterations: list[int] = field(default_factory=list)
    time_ns: tuple[int, int] | None = None  # (start, end) of what it is about
    details: dict[str, Any] = field(default_factory=dict)  # kind-specific (docs/analyze.md)

    def __post_init__(self) -> None:
        self.ranks = list(dict.fromkeys(int(r) for r in self.ranks))  # order kept: chains, cycles
        self.microbatches = sorted({int(m) for m in self.microbatches})
        self.iterations = sorted({int(i) for i in self.iterations})

    def to_json(self) -> dict[str, Any]:
        return record_json(
            self,
            steps=[s.to_json() for s in self.steps],
            time_ns=list(self.time_ns) if self.time_ns else None,
        )


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Most severe first; then by kind order above (root causes such as a failed rank before
    what follows from them), then earliest first, then by first rank."""
    order = {k: i for i, k in enumerate(KINDS)}
    return sorted(
        findings,
        key=lambda f: (
            _RANK.get(f.severity, 3),
            order.get(f.kind, 99),
            f.time_ns[0] if f.time_ns else 2**63,
            f.ranks[0] if f.ranks else -1,
        ),
    )


def counts(findings: list[Finding]) -> dict[str, int]:
    return {sev: sum(f.severity == sev for f in findings) for sev in SEVERITIES}
