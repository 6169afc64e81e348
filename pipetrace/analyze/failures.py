"""rank_failed: ranks that raised, were killed, died silently or left no log.

How a rank ended is decided once, in `endings`; this module turns the verdicts into findings.
Only root causes are errors: a "connection closed" failure after another rank's first failure
is named a consequence of it (gloo tears down the peers of a dead rank), a signal after it the
launcher ending the ranks left behind, and the end of a P2P wait of a rank caught in a
deadlock or stall (a timeout, or a connection closed under it) a symptom of that hang; those
are warnings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipetrace import units
from pipetrace.analyze import endings as en
from pipetrace.analyze import findings as fk
from pipetrace.analyze.findings import Finding
from pipetrace.analyze.model import OPEN, RankState, RankTimeline, Run
from pipetrace.analyze.selection import short_rank_list
from pipetrace.recorder import format as fmt


@dataclass(frozen=True)
class _FirstFailure:
    """The earliest failure of the run: what later failures may be consequences of."""

    t: int
    rank: int

    def explains(self, rank: int, t: int) -> bool:
        return self.rank != rank and t > self.t

    def follows(self, t: int, what: str) -> str:
        return f"follows rank {self.rank}'s failure {units.duration(t - self.t)} earlier: {what}"


_NOT_FAILED = (en.INTERRUPTED, en.COMPUTING, en.HUNG)
"""Endings that are no failure of the rank: the user's interrupt (`interrupts` tells it), or
a hang that its watchdog caught before the interrupt ended it (`rank_stalled` tells it)."""


def find_failures(run: Run, hung: set[int] = frozenset()) -> list[Finding]:  # type: ignore[assignment]
    """``hung``: ranks in a deadlock or stall finding; their P2P timeouts are symptoms."""
    endings = en.rank_endings(run)
    first = _first_failure(run, endings)
    hanging = {r for r, e in endings.items() if e.state in (en.COMPUTING, en.HUNG)}
    together = _signaled_together(run, first)
    findings = []
    ended_alike: dict[tuple[object, ...], list[Finding]] = {}
    for rank in run.ranks:
        state = rank.status.state
        if endings[rank.rank].state in _NOT_FAILED:
            continue
        if state == RankState.FAILED:
            findings.append(_raised(run, rank, endings[rank.rank], first, rank.rank in hung))
        elif state == RankState.SIGNALED:
            found, alike = _signaled(run, rank, endings[rank.rank], first, hanging, together)
            findings.append(found)
            if alike is not None:
                ended_alike.setdefault(alike, []).append(found)
        elif state == RankState.MISSING:
            found = _missing(run, rank, endings[rank.rank])
            findings.append(found)
            foreign = rank.status.from_another_run
            ended_alike.setdefault(("missing", foreign), []).append(found)
        elif state == RankState.ENDED and _stopped_for_good(endings[rank.rank]):
            findings.append(_died_silently(run, rank, endings[rank.rank]))
    for alike, members in ended_alike.items():
        if len(members) > 1:
            at = findings.index(members[0])
            findings = [f for f in findings if f not in members]
            findings.insert(at, _ended_alike(run, alike, members, first))
    stopped = None if hung else _stopped_together(run, endings)  # else the hang's says it
    if stopped is not None:
        findings.append(stopped)
    return findings


def _lost_logs(run: Run, ranks: list[int]) -> str:
    """Why these ranks have no usable log: how many of them ran (their peers completed
    messages with them) and lost it."""
    ran = [r for r in ranks if en.ran_without_log(run, r) is not None]
    if not ran:
        return "the ranks never started recording (they crashed at start) or their files were lost"
    return (
        f"{'all' if len(ran) == len(ranks) else len(ran)} of them ran (their peers completed "
        f"messages with them) but left no usable log: {en.LOST_LOG}"
    )


def _ended_alike(
    run: Run, alike: tuple[object, ...], members: list[Finding], first: _FirstFailure | None
) -> Finding:
    """One warning for the ranks a signal ended for one reason (the launcher ending the
    ranks left behind), or without a usable log: a job of a thousand ranks gets one line,
    not a thousand."""
    ranks = [r for f in members for r in f.ranks]
    if alike[0] == "missing":
        return Finding(
            fk.RANK_FAILED,
            fk.WARNING,
            f"{len(ranks)} ranks have no usable log: ranks {short_rank_list(ranks)}",
            members[0].cause if alike[1] else _lost_logs(run, ranks),
            ranks=ranks,
            details={"ended": [{"rank": f.ranks[0], **f.details} for f in members]},
        )
    signal = str(alike[-1])
    cause = members[0].cause
    times = [f.time_ns[0] for f in members if f.time_ns is not None]
    if alike[0] == "follows" and first is not None and times:
        early, late = (units.duration(t - first.t) for t in (min(times), max(times)))
        after = early if early == late else f"{early} to {late}"
        cause = (
            f"follows rank {first.rank}'s failure {after} earlier: the launcher ended the "
            "ranks left behind"
        )
    return Finding(
        fk.RANK_FAILED,
        fk.WARNING,
        f"{len(ranks)} ranks were ended by {signal}: ranks {short_rank_list(ranks)}",
        cause,
        ranks=ranks,
        steps=[s for f in members for s in f.steps],
        iterations=sorted({i for f in members for i in f.iterations}),
        time_ns=(min(times), max(times)) if times else None,
        details={
            "signal": signal,
            "ended": [{"rank": f.ranks[0], **f.details} for f in members],
        },
    )


_AT_ONCE_NS = 1_000_000_000
"""Ends this close together came at once: signals (a launcher signals its ranks in one loop;
torchrun's agent, a scheduler, a user's `kill` of the process group alike), or logs that just
stop (a log loses at most its last flush interval, 0.1 s by default, to a kill)."""


def _stopped_together(run: Run, endings: dict[int, en.Ending]) -> Finding | None:
    """Every rank's log stops at about the same time with nothing recorded about it: the job
    was killed as a whole, out of the ranks' sight, or every rank was stuck from then on."""
    ranks = run.present_ranks
    if len(ranks) < 2 or any(r.status.state != RankState.ENDED for r in ranks):
        return None
    ends = [r.last_time() for r in ranks]
    spread = max(ends) - min(ends)
    if spread > _AT_ONCE_NS:
        return None
    between = _between_iterations(ranks, endings)
    severity, cause = (
        fk.ERROR,
        (
            "the job was killed at once where no rank could record it (SIGKILL of the job or its "
            "launcher, an out-of-memory kill of the whole job, the node lost), or every rank was "
            "stuck from then on with no watchdog to say so (see rank_stalled / deadlock)"
        ),
    )
    if run.recording:  # their processes still run here: not killed, just not done yet
        severity, cause = (
            fk.INFO,
            "the run is still being recorded (see the input warnings): analyze it again once "
            "the job has ended",
        )
    elif between is not None:
        severity, cause = (
            fk.WARNING,
            (
                f"every rank had ended iteration {between} and had nothing open: the script ended "
                "without closing the recording (PipelineRunner.close(), the end of its `with` "
                "block or of record()'s), or the job was killed between iterations"
            ),
        )
    return Finding(
        fk.RANK_FAILED,
        severity,
        f"every rank's log stops within {units.duration(spread)}, with no run_end, error or "
        "signal recorded",
        cause,
        ranks=[r.rank for r in ranks],
        time_ns=(min(ends), max(ends)),
        details={"spread_ns": spread, "last_step": None, "ending": en.UNKNOWN},
    )


def _first_failure(run: Run, endings: dict[int, en.Ending]) -> _FirstFailure | None:
    """The earliest exception, abort or signal, or silent death (at its last sign of life);
    a signal that ended a hang is no failure of its own."""
    times = [(t, r) for t, r in en.failure_events(run) if endings[r].state not in _NOT_FAILED]
    times += [
        (e.last_alive_ns, r)
        for r, e in endings.items()
        if e.state == en.CRASHED and run.ranks[r].status.state == RankState.ENDED
    ]
    return _FirstFailure(*min(times)) if times else None


@dataclass(frozen=True)
class _Together:
    """Ranks a signal ended at about the same time, the first failure among them: the job
    was ended from outside, all at once, and no rank's signal follows from another's."""

    ranks: frozenset[int]
    signal: str
    spread_ns: int

    def cause(self, first: int, rank: int) -> str:
        said = f"{len(self.ranks)} ranks got {self.signal} within {units.duration(self.spread_ns)}"
        if rank == first:
            return (
                f"the job was ended from outside: {said} (a scheduler's time limit, the "
                "launcher, or a user)"
            )
        return f"ended with the rest of the job: {said} (see rank {first})"


def _signaled_together(run: Run, first: _FirstFailure | None) -> _Together | None:
    """When the run's first failure is a signal, the ranks the same signal ended within
    `_AT_ONCE_NS` of it (None: none but the first)."""
    if first is None:
        return None
    signals = {
        r.rank: sig
        for r in run.ranks
        if r.status.state == RankState.SIGNALED and (sig := r.last_of(fmt.SIGNAL)) is not None
    }
    head = signals.get(first.rank)
    if head is None or head.t != first.t:
        return None
    name = head.fields.get("signal")
    ranks = {
        r
        for r, sig in signals.items()
        if sig.fields.get("signal") == name and sig.t - first.t <= _AT_ONCE_NS
    }
    if len(ranks) < 2:
        return None
    spread = max(signals[r].t for r in ranks) - first.t
    return _Together(frozenset(ranks), str(name), spread)


def _between_iterations(ranks: list[RankTimeline], endings: dict[int, en.Ending]) -> int | None:
    """The iteration every rank ended last, with no step or op open after it (None: not so)."""
    last = set()
    for rank in ranks:
        its = rank.iterations
        if not len(its) or its.end[-1] == OPEN or not endings[rank.rank].idle:
            return None
        last.add(int(its.it[-1]))
    return last.pop() if len(last) == 1 else None


def _raised(
    run: Run, rank: RankTimeline, ending: en.Ending, first: _FirstFailure | None, hung: bool
) -> Finding:
    st = rank.status
    exc = rank.last_of(fmt.EXCEPTION)
    tb = str(exc.fields.get("traceback", "")) if exc else ""
    at = en.where(run, rank)
    frame, origin = en.origin(tb)
    severity = fk.ERROR
    cause = (f"an exception in step {at.step}" if at.open else f"an exception {at.phrase}") + (
        f" at {frame}" if frame else ""
    )
    if origin:  # the user's own error, wrapped by the framework: name it first
        cause += f" (re-raised as {_one_line(st.error, 100)})"
    closed, timed_out = en.error_words(rank)
    aborted = _aborted_before(run, rank.rank, exc.t) if closed and exc else None
    if aborted is not None and first is not None and first.t < aborted[0]:
        aborted = None  # a failure before the abort explains it
    if closed and first and exc and aborted is None and first.explains(rank.rank, exc.t):
        severity = fk.WARNING
        cause = first.follows(exc.t, "its connection to a failed peer closed")
    elif aborted is not None and exc:
        # a hung rank its watchdog ended (the hang is the root cause, told by rank_stalled):
        # its connections close under every peer waiting on it, in a collective too
        severity = fk.WARNING
        cause = (
            f"follows rank {aborted[1]}'s end by its watchdog "
            f"{units.duration(exc.t - aborted[0])} earlier: its connection to that hung "
            "rank closed (a symptom of the hang reported as deadlock / rank_stalled)"
        )
    elif (closed or timed_out) and hung:
        # A hung rank's wait ends when it gives up or when a peer that gave up first closes the
        # connection; gloo may close it before that peer records its own error, so a lost
        # connection recorded first is still the hang's symptom, not a root cause.
        severity = fk.WARNING
        how = "a P2P wait gave up" if timed_out else "a peer that gave up closed its connection"
        cause = f"{how}: a symptom of the hang reported as deadlock / rank_stalled"
    message = f"rank {rank.rank} raised {_one_line(origin or st.error)} {at.phrase}"
    details = {"error": st.error, "traceback": tb}
    return _told(rank, ending, at, exc.t if exc else None, severity, message, cause, details)


def _aborted_before(run: Run, rank: int, t: int) -> tuple[int, int] | None:
    """(time, rank) of the first watchdog abort of another rank before ``t``, if any."""
    aborts = [
        (ev.t, r.rank)
        for r in run.present_ranks
        if r.rank != rank
        for ev in r.events_of(fmt.ABORT)
        if ev.t < t
    ]
    return min(aborts) if aborts else None


def _signaled(
    run: Run,
    rank: RankTimeline,
    ending: en.Ending,
    first: _FirstFailure | None,
    hanging: set[int],
    together: _Together | None,
) -> tuple[Finding, tuple[object, ...] | None]:
    st = rank.status
    sig = rank.last_of(fmt.SIGNAL)
    at = en.where(run, rank)
    severity = fk.ERROR
    cause = (
        "killed from outside (job scheduler timeout, a user's Ctrl-C, "
        "or a peer's failure tearing the job down)"
    )
    alike: tuple[object, ...] | None = None  # the reason shared with other ranks ended alike
    if hanging - {rank.rank}:  # a time limit or the launcher ended the job around a hang
        severity = fk.WARNING
        cause = (
            f"the job was ended while {en.said_ranks(hanging)} hung (see rank_stalled / deadlock): "
            "a time limit or the launcher ending the ranks left behind"
        )
        alike = ("hang", st.error)
    elif first and together and rank.rank in together.ranks:
        severity = fk.ERROR if rank.rank == first.rank else fk.WARNING
        cause = together.cause(first.rank, rank.rank)
        alike = None if rank.rank == first.rank else ("together", st.error)
    elif sig and first and first.explains(rank.rank, sig.t):
        severity = fk.WARNING
        cause = first.follows(sig.t, "the launcher ended the ranks left behind")
        alike = ("follows", st.error)
    message = f"rank {rank.rank} was ended by {st.error} {at.phrase}"
    details = {"signal": st.error}
    found = _told(rank, ending, at, sig.t if sig else None, severity, message, cause, details)
    return found, alike


def _missing(run: Run, rank: RankTimeline, ending: en.Ending) -> Finding:
    return Finding(
        fk.RANK_FAILED,
        fk.WARNING,
        f"rank {rank.rank} has no usable log ({rank.status.detail})",
        en.missing_cause(run, rank.rank),
        ranks=[rank.rank],
        details={"last_step": None, "ending": ending.state},
    )


def _stopped_for_good(ending: en.Ending) -> bool:
    """A silent log that is a root cause: the process died, or it never came to the end of
    the run that its peers wait in (hung or dead, it is the rank at fault either way)."""
    return ending.state == en.CRASHED or ending.keeps_peers_waiting


def _died_silently(run: Run, rank: RankTimeline, ending: en.Ending) -> Finding:
    """A log that stops with no run_end and no error, where the evidence blames the rank."""
    at = en.where(run, rank)
    cause = ending.evidence
    if ending.state == en.CRASHED:
        cause = f"the process died without a trace (SIGKILL, the OOM killer, a segfault): {cause}"
    stops = f"inside {at.step}" if at.open else at.phrase
    message = f"rank {rank.rank}'s log stops {stops} with no run_end and no error"
    found = _told(rank, ending, at, ending.last_alive_ns, fk.ERROR, message, cause, {})
    ran_on = en.ran_past_log(run, rank)
    if ran_on is None or (at.iterations and ran_on[0] < at.iterations[0]):
        return found
    it, peer, step = ran_on
    return replace(
        found,
        message=f"{message}; its last records were lost: it ran on into iteration {it}",
        cause=f"{cause}; rank {peer} completed {step} with it (iteration {it}) after its log ends",
        iterations=[it],
        details={**found.details, "ran_on_iteration": it},
    )


def _told(
    rank: RankTimeline,
    ending: en.Ending,
    at: en.Where,
    t: int | None,
    severity: str,
    message: str,
    cause: str,
    details: dict[str, object],
) -> Finding:
    """The rank_failed finding of a rank whose end was recorded at ``t`` (None: unknown)."""
    return Finding(
        fk.RANK_FAILED,
        severity,
        message,
        cause,
        ranks=[rank.rank],
        steps=[at.ref] if at.ref else [],
        iterations=at.iterations,
        time_ns=(t, t) if t is not None else None,
        details={**details, "last_step": at.step, "ending": ending.state},
    )


def _one_line(text: str | None, limit: int = 160) -> str:
    line = " ".join(text.split()) if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
