"""rank_failed: ranks that raised, were killed, died silently or left no log.

A rank's state comes from how its log ends (`load._status`). Only root causes are errors: a
"connection closed" failure after another rank's first failure is named a consequence of it
(gloo tears down the peers of a dead rank), and a P2P timeout of a rank caught in a deadlock
or stall a symptom of that hang; both are warnings.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrace.analyze import findings as fk
from pipetrace.analyze.deadlock import _open_rows, waiting_outside_iterations
from pipetrace.analyze.findings import Finding, StepRef
from pipetrace.analyze.model import OPEN, RankState, RankTimeline, Run
from pipetrace.recorder import format as fmt

_CLOSED = ("connection closed", "connection reset", "broken pipe")
_TIMED_OUT = ("timed out", "timeout")


def find_failures(run: Run, hung: set[int] = frozenset()) -> list[Finding]:  # type: ignore[assignment]
    """``hung``: ranks in a deadlock or stall finding; their P2P timeouts are symptoms."""
    findings = []
    finished = sum(r.status.state == RankState.FINISHED for r in run.ranks)
    failures = sorted(
        (ev.t, r.rank) for r in run.present_ranks for ev in r.events_of(fmt.EXCEPTION)
    )
    # A rank killed outright (SIGKILL, OOM) leaves no event; its peers then fail with
    # "connection closed". Its last event is when it was last alive: count it as a failure.
    # A rank its watchdog ended (a hang) or a signal ended drops its connections too.
    ended = [
        (ev.t, r.rank)
        for r in run.present_ranks
        for e in (fmt.ABORT, fmt.SIGNAL)
        for ev in r.events_of(e)
    ]
    later = failures + ended
    # A log that stops mid-step (its last flush caught the step open) is a hang, unless a
    # peer's connection to it closed afterwards: a hung process keeps its sockets open.
    closed = [
        (ev.t, r.rank)
        for r in run.present_ranks
        for ev in r.events_of(fmt.EXCEPTION)
        if any(w in str(ev.fields.get("message", "")).lower() for w in _CLOSED)
    ]
    silent: dict[int, _Death] = {}
    for rank in run.ranks:
        if rank.status.state != RankState.ENDED:
            continue
        last = _last_time(rank)
        idle = not len(_open_rows(rank)) and not (rank.p2p.done == OPEN).any()
        after = any(t > last and r != rank.rank for t, r in (later if idle else closed))
        if after or (idle and finished):
            silent[rank.rank] = _Death(last, open=not idle)
    failures = sorted(later + [(d.t, r) for r, d in silent.items()])
    first_failure = failures[0] if failures else None
    waiting = waiting_outside_iterations(run)
    for rank in run.ranks:
        st = rank.status
        where = _last_step(run, rank)
        if st.state == RankState.FAILED:
            exc = rank.last_of(fmt.EXCEPTION)
            tb = str(exc.fields.get("traceback", "")) if exc else ""
            frame = _last_frame(tb)
            cause = f"an exception in step {where.step}" + (f" at {frame}" if frame else "")
            error = str(st.error).lower()
            severity = fk.ERROR
            if (
                any(w in error for w in _CLOSED)
                and first_failure
                and first_failure[1] != rank.rank
                and exc
                and exc.t > first_failure[0]
            ):
                severity = fk.WARNING
                cause = (
                    f"follows rank {first_failure[1]}'s failure {(exc.t - first_failure[0]) / 1e9:.3g} s "
                    "earlier: its connection to a failed peer closed"
                )
            elif any(w in error for w in _TIMED_OUT) and rank.rank in hung:
                severity = fk.WARNING
                cause = (
                    "a P2P wait gave up: a symptom of the hang reported as deadlock / rank_stalled"
                )
            findings.append(
                Finding(
                    fk.RANK_FAILED,
                    severity,
                    f"rank {rank.rank} raised {_one_line(st.error)} in {where.step}",
                    cause,
                    ranks=[rank.rank],
                    steps=[where],
                    iterations=_it(where),
                    time_ns=(exc.t, exc.t) if exc else None,
                    details={"error": st.error, "traceback": tb, "last_step": where.step},
                )
            )
        elif st.state == RankState.SIGNALED:
            sig = rank.last_of(fmt.SIGNAL)
            severity, cause = (
                fk.ERROR,
                (
                    "killed from outside (job scheduler timeout, a user's Ctrl-C, "
                    "or a peer's failure tearing the job down)"
                ),
            )
            if sig and first_failure and first_failure[1] != rank.rank and sig.t > first_failure[0]:
                severity = fk.WARNING
                cause = (
                    f"follows rank {first_failure[1]}'s failure {(sig.t - first_failure[0]) / 1e9:.3g} s "
                    "earlier: the launcher ended the ranks left behind"
                )
            findings.append(
                Finding(
                    fk.RANK_FAILED,
                    severity,
                    f"rank {rank.rank} was ended by {st.error} in {where.step}",
                    cause,
                    ranks=[rank.rank],
                    steps=[where],
                    iterations=_it(where),
                    time_ns=(sig.t, sig.t) if sig else None,
                    details={"signal": st.error, "last_step": where.step},
                )
            )
        elif st.state == RankState.MISSING:
            findings.append(
                Finding(
                    fk.RANK_FAILED,
                    fk.WARNING,
                    f"rank {rank.rank} has no usable log ({st.detail})",
                    "the rank never started recording (it crashed at start) or its file was lost",
                    ranks=[rank.rank],
                    details={"last_step": None},
                )
            )
        elif rank.rank in silent:
            cause = "the process died without a trace (SIGKILL, the OOM killer, a segfault)"
            if silent[rank.rank].open:
                cause += ": a peer's connection to it closed later"
            elif waiting:
                cause = (
                    f"it never reached the end of the run that rank(s) {', '.join(map(str, sorted(waiting)))} "
                    f"waited in: hung or slow between iterations, or {cause}"
                )
            findings.append(
                Finding(
                    fk.RANK_FAILED,
                    fk.ERROR,
                    f"rank {rank.rank}'s log stops {'inside' if silent[rank.rank].open else 'after'} {where.step} "
                    "with no run_end and no error",
                    cause,
                    ranks=[rank.rank],
                    steps=[where],
                    iterations=_it(where),
                    details={"last_step": where.step},
                )
            )
    return findings


@dataclass(frozen=True)
class _Death:
    t: int
    """The last moment the log shows the rank alive."""
    open: bool
    """The log stops inside a step or P2P op."""


def _last_time(rank: RankTimeline) -> int:
    """The last moment the rank's log shows it alive."""
    times = [
        int(rank.steps.begin.max()) if len(rank.steps) else 0,
        int(rank.steps.end.max()) if len(rank.steps) else 0,
        int(rank.p2p.done.max()) if len(rank.p2p) else 0,
        int(rank.iterations.end.max()) if len(rank.iterations) else 0,
        max((ev.t for ev in rank.lifecycle), default=0),
    ]
    return max(times)


def _it(ref: StepRef) -> list[int]:
    return [ref.iteration] if ref.iteration is not None and ref.iteration >= 0 else []


def _last_step(run: Run, rank: RankTimeline) -> StepRef:
    for e in (fmt.EXCEPTION, fmt.SIGNAL, fmt.STALL):
        ev = rank.last_of(e)
        listed = ev.fields.get("open_steps") if ev else None
        if listed and isinstance(listed[-1], dict) and isinstance(listed[-1].get("step"), str):
            item = listed[-1]
            pos = item.get("pos") if isinstance(item.get("pos"), int) else None
            its = rank.iterations.it
            return StepRef(
                rank.rank, item["step"], int(its[-1]) if len(its) else None, pos, None, "open"
            )
    if len(rank.steps):
        row = len(rank.steps) - 1
        return StepRef(
            rank.rank,
            run.catalog.texts[int(rank.steps.code[row])],
            int(rank.steps.it[row]),
            int(rank.steps.pos[row]),
            int(rank.steps.begin[row]),
            "last step begun",
        )
    return StepRef(rank.rank, "(no step)", None, None, None, None)


def _one_line(text: str | None, limit: int = 160) -> str:
    line = (text or "").splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _last_frame(traceback: str) -> str | None:
    lines = [ln.strip() for ln in traceback.splitlines() if ln.strip().startswith("File ")]
    return lines[-1] if lines else None
