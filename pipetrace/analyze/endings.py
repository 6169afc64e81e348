"""How each rank's log ended: one verdict per rank, from the evidence, told alike by every finding.

`rank_failed` (failures.py) and the end of a `rank_stalled` chain (terminal.py) both describe
how a rank ended; they read it here so that one rank never gets two stories (a rank "still
computing" in one finding and "died without a trace" in the next). The verdict is one of the
terminal states documented in docs/diagnosis.md, with the evidence that decided it:

- `exited`: it finished its plan: `run_end`, or its end-of-run clock exchange completed
  (`load` then calls it finished), or its watchdog caught it waiting in that exchange;
- `crashed`: it raised (`exception`), a signal ended it (`signal`), or it died without a
  trace: its log stops and a peer's connection to it closed later, or it stops between steps
  while other ranks went on to finish or fail;
- `computing`: its watchdog recorded it stalled inside a step (alive, the step never returns);
- `hung`: its watchdog recorded it stalled outside any step;
- `unknown`: its log just stops and nothing tells whether it hung or died;
- `missing`: no usable log;
- `interrupted`: the user interrupted the run (Ctrl-C: a rank recorded SIGINT or raised
  KeyboardInterrupt) and the rank ended then, or after it, with no hang of its own before.

`Where` says where in its plan a rank was when its log ended: in an open step, after its last
step (between steps or iterations), or before its first step; never a placeholder.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from pipetrace import units
from pipetrace.analyze.derive import counterpart_rows, step_message
from pipetrace.analyze.findings import StepRef
from pipetrace.analyze.model import MAIN_THREAD, OPEN, RankState, RankTimeline, Run
from pipetrace.analyze.selection import short_rank_list
from pipetrace.recorder import format as fmt

EXITED, CRASHED, COMPUTING, HUNG, UNKNOWN, MISSING, NOT_LOADED, INTERRUPTED = (
    "exited",
    "crashed",
    "computing",
    "hung",
    "unknown",
    "missing",
    "not_loaded",
    "interrupted",
)
"""Terminal states of a rank (docs/diagnosis.md); `rank_stalled` adds "transfer" for a chain
that ends at a message both sides posted. NOT_LOADED: left out of the analysis (``--ranks``,
``--replica``): nothing is known of it."""

CLOSED_WORDS = ("connection closed", "connection reset", "broken pipe")
"""An error with these words is a lost connection: the peer at the other end went away."""
TIMED_OUT_WORDS = ("timed out", "timeout", "recv failed", "send failed")
"""An error with these words is a wait that gave up: the peer never came (MindSpore's CPU
collectives say "Recv failed." when `MS_CPU_COMM_OP_TIMEOUT` runs out)."""


def _through_the_end(run: Run, rank: int) -> int | None:
    """A rank whose completed end-of-run clock exchange proves that ``rank`` took part in it:
    rank 0 exchanges with ranks 1, 2, ... in turn, so rank 0 completing it, or a rank after
    ``rank`` (any rank, for rank 0), means ``rank`` did too (None: no such rank)."""
    for other in run.present_ranks:
        if other.rank == rank or not (other.rank == 0 or rank == 0 or other.rank > rank):
            continue
        if any(ev.fields.get("phase") == "end" for ev in other.events_of(fmt.CLOCK)):
            return other.rank
    return None


def ran_without_log(run: Run, rank: int) -> tuple[int, int] | None:
    """(iteration, peer) of the last message a peer completed with ``rank``, which has no
    usable log: it ran, and its log was lost (None: no peer saw it run)."""
    seen = ran_past_log(run, run.ranks[rank])
    return seen[:2] if seen else None


def ran_past_log(run: Run, rank: RankTimeline) -> tuple[int, int, str] | None:
    """(iteration, peer, the peer's step) of the latest message a peer completed with
    ``rank`` after the rank's last record, of which the rank's log has no side: the rank ran
    on, and its last records were lost (a kill before its flush). None: no peer saw that."""
    last = rank.last_time() if rank.present else np.iinfo(np.int64).min
    seen = []
    for peer in run.present_ranks:
        p = peer.p2p
        if peer.rank == rank.rank or not len(p):
            continue
        rows = np.flatnonzero(
            (p.peer == rank.rank) & (p.done != OPEN) & (p.match_rank == -1) & (p.done > last)
        )
        if len(rows):
            row = int(rows[np.lexsort((p.done[rows], p.it[rows]))[-1]])  # latest of all
            seen.append((int(p.it[row]), peer.rank, run.catalog.texts[int(p.code[row])]))
    return max(seen) if seen else None


LOST_LOG = "killed before the log was written (kill -9, the OOM killer) or the file was lost"


def missing_cause(run: Run, rank: int) -> str:
    """Why a rank has no usable log, as far as its peers' logs tell: it never started, or
    it ran (a peer completed messages with it) and its log was lost."""
    if run.ranks[rank].status.from_another_run:
        return "its log is another run's (set aside: see the input warnings)"
    seen = ran_without_log(run, rank)
    if seen is None:
        return "the rank never started recording (it crashed at start) or its file was lost"
    it, peer = seen
    return (
        f"the rank ran (rank {peer} completed messages with it until iteration {it}) but left "
        f"no usable log: {LOST_LOG}"
    )


def said_ranks(ranks: Iterable[int]) -> str:
    """``rank 3``, ``rank(s) 1, 3`` (each named where there are replicas), or past four a
    compact ``ranks 0-52,54-127``: a cause that names the rest of a big job stays a line."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) <= 4:
        return f"rank(s) {', '.join(map(str, ranks))}"
    return f"ranks {short_rank_list(ranks)}"


@dataclass(frozen=True)
class Where:
    """Where a rank was in its plan when its log ended."""

    step: str | None
    """The open step, else the last step it ran, else None (it ran none)."""
    open: bool
    """The log ends inside ``step``."""
    ref: StepRef | None

    @property
    def phrase(self) -> str:
        """ "in 2F1", "after 3SEND_B7" or "before its first step", for a message."""
        if self.step is None:
            return "before its first step"
        return f"{'in' if self.open else 'after'} {self.step}"

    @property
    def iterations(self) -> list[int]:
        it = self.ref.iteration if self.ref is not None else None
        return [it] if it is not None and it >= 0 else []


@dataclass(frozen=True)
class Ending:
    """The verdict on one rank's end."""

    rank: int
    state: str
    """A terminal state above."""
    evidence: str
    """What decided it, as a clause: "raised ...", "rank 2's connection to it closed ..."."""
    last_alive_ns: int
    """The last moment its log shows it alive."""
    idle: bool
    """Nothing open at the end of its log: no step, no P2P op."""
    keeps_peers_waiting: bool = False
    """Its peers wait for it at the end of the run (`waiting_outside_iterations`)."""


def rank_endings(run: Run) -> dict[int, Ending]:
    """The verdict on every rank of the run, by rank (made once inside `endings_kept`)."""
    kept = _KEPT.get(id(run))
    if kept is None or kept[0] is not run:
        return _endings(run)
    if kept[1] is None:
        kept = _KEPT[id(run)] = (run, _endings(run))
    return kept[1]


def _endings(run: Run) -> dict[int, Ending]:
    evidence = _PeerEvidence(run)
    return {rank.rank: _ending(run, rank, evidence) for rank in run.ranks}


_KEPT: dict[int, tuple[Run, dict[int, Ending] | None]] = {}
"""The verdicts of the runs inside `endings_kept`, by the run's id."""


@contextmanager
def endings_kept(run: Run) -> Iterator[None]:
    """Inside, `rank_endings(run)` reads the run once: `analysis.analyze` asks for the
    verdicts from several analyzers, and a hang's finding once per chain, each time over
    every rank (0.07 s at 1024 ranks). Outside, each call reads the run as it is then."""
    _KEPT[id(run)] = (run, None)
    try:
        yield
    finally:
        del _KEPT[id(run)]


def error_words(rank: RankTimeline) -> tuple[bool, bool]:
    """(lost a connection, timed out): what kind of failure the rank's error is."""
    error = str(rank.status.error or "").lower()
    return any(w in error for w in CLOSED_WORDS), any(w in error for w in TIMED_OUT_WORDS)


def failed_first_hand(run: Run) -> set[int]:
    """Ranks that raised an error of their own (not a lost connection, not a wait that timed
    out): such a rank is not waiting for anybody, whatever it had posted."""
    return {
        rank.rank
        for rank in run.present_ranks
        if rank.status.state == RankState.FAILED and not any(error_words(rank))
    }


def where(run: Run, rank: RankTimeline) -> Where:
    """The innermost step the last exception/signal/stall lists open; else the rank's last
    open step in its log; else the last step it ran; else before its first step."""
    listed = _listed_open_step(rank)
    if listed is not None:
        return Where(listed.step, True, listed)
    steps = rank.steps
    main = np.flatnonzero(steps.thread == MAIN_THREAD)
    if not len(main):
        return Where(None, False, None)
    open_rows = main[steps.end[main] == OPEN]
    row = int(open_rows[-1]) if len(open_rows) else int(main[-1])
    text = run.catalog.texts[int(steps.code[row])]
    note = "open" if len(open_rows) else "last step run"
    ref = StepRef(
        rank.rank, text, int(steps.it[row]), int(steps.pos[row]), int(steps.begin[row]), note
    )
    return Where(text, bool(len(open_rows)), ref)


def _listed_open_step(rank: RankTimeline) -> StepRef | None:
    for ev in (rank.last_of(fmt.EXCEPTION), rank.last_of(fmt.SIGNAL), rank.final_stall()):
        listed = fmt.listed(ev.fields, "open_steps") if ev else None
        if listed and isinstance(listed[-1], dict) and isinstance(listed[-1].get("step"), str):
            item = listed[-1]
            pos = item.get("pos") if isinstance(item.get("pos"), int) else None
            it = item.get("it") if isinstance(item.get("it"), int) else _last_iteration(rank)
            return StepRef(rank.rank, item["step"], it, pos, None, "open")
    return None


def _last_iteration(rank: RankTimeline) -> int | None:
    its = rank.iterations.it
    return int(its[-1]) if len(its) else None


def waiting_outside_iterations(run: Run) -> dict[int, str]:
    """Ranks whose watchdog caught them waiting in a collective outside iterations (the
    end-of-run clock exchange), with what they waited in."""
    waiting = {}
    for rank in run.present_ranks:
        for name in (fmt.ABORT, fmt.STALL):
            ev = rank.last_of(name)
            if ev is not None and isinstance(ev.fields.get("waiting_in"), str):
                waiting[rank.rank] = ev.fields["waiting_in"]
                break
    return waiting


def failure_events(run: Run) -> list[tuple[int, int]]:
    """(time, rank) of every recorded failure (exception, watchdog abort, signal), in order."""
    return sorted(
        (ev.t, r.rank)
        for r in run.present_ranks
        for name in (fmt.EXCEPTION, fmt.ABORT, fmt.SIGNAL)
        for ev in r.events_of(name)
    )


def interrupted_at(run: Run) -> int | None:
    """When the user interrupted the run: the first SIGINT a rank recorded (its watchdog notes
    it even while the main thread is blocked in a transfer) or KeyboardInterrupt it raised;
    None when nobody interrupted it."""
    return min(
        (
            ev.t
            for r in run.present_ranks
            for ev in r.lifecycle
            if (ev.e == fmt.SIGNAL and ev.fields.get("signal") == "SIGINT")
            or (ev.e == fmt.EXCEPTION and ev.fields.get("type") == "KeyboardInterrupt")
        ),
        default=None,
    )


def hung_before(rank: RankTimeline, t: int) -> bool:
    """Its watchdog recorded a stall whose idle time lay mostly before ``t``: the rank hung
    first and the interrupt came later (a stall of a rank merely blocked while the others
    wind down after the interrupt does not count)."""
    ev = rank.final_stall()  # one it recovered from is no hang
    idle_s = ev.fields.get("idle_s") if ev else None
    return isinstance(idle_s, int | float) and ev.t - t <= t - (ev.t - idle_s * 1e9)


def _ended_by_interrupt(rank: RankTimeline, t: int) -> bool:
    """A rank whose recorded end (exception, signal, abort) came at or after the interrupt at
    ``t``, or whose log just stops, and which had not hung before it."""
    ends = [ev.t for ev in rank.lifecycle if ev.e in (fmt.EXCEPTION, fmt.SIGNAL, fmt.ABORT)]
    return not hung_before(rank, t) and (not ends or ends[-1] >= t)


class _PeerEvidence:
    """What the other ranks' logs say after a given moment: failures, lost connections, ends."""

    def __init__(self, run: Run) -> None:
        ranks = run.present_ranks
        self.pipelines = run.pipelines
        self.interrupted = interrupted_at(run)
        self.waiting = waiting_outside_iterations(run)
        self.finished = [r.rank for r in ranks if r.status.state == RankState.FINISHED]
        self.ended = failure_events(run)
        self.terms = sorted(
            (ev.t, r.rank)
            for r in ranks
            for ev in r.events_of(fmt.SIGNAL)
            if ev.fields.get("signal") == "SIGTERM"
        )
        self.stalls = [
            (r.rank, ev.t - int(ev.fields["idle_s"] * 1e9), ev.t)
            for r in ranks
            for ev in r.events_of(fmt.STALL)
            if isinstance(ev.fields.get("idle_s"), int | float)
        ]
        self.closed = sorted(
            (ev.t, r.rank)
            for r in ranks
            for ev in r.events_of(fmt.EXCEPTION)
            if any(w in str(ev.fields.get("message", "")).lower() for w in CLOSED_WORDS)
        )

    def stalled_since(self, rank: int, since: int, until: int) -> list[int]:
        """Ranks of ``rank``'s pipeline whose watchdog recorded, before ``until``, a stall
        whose idle time began after ``since``: they waited while ``rank`` showed no progress
        (another replica's ranks wait on their own pipeline, not on this rank)."""
        replica = self.pipelines.replica_of(rank)
        return sorted(
            {
                r
                for r, idle_from, t in self.stalls
                if r != rank
                and self.pipelines.replica_of(r) == replica
                and since <= idle_from
                and t <= until
            }
        )

    def terminated_after(self, rank: int, t: int) -> tuple[int, int] | None:
        """The first peer that recorded SIGTERM after ``t``: (its rank, ns later)."""
        return next(((r, when - t) for when, r in self.terms if when > t and r != rank), None)

    def closed_after(self, rank: int, t: int) -> tuple[int, int] | None:
        """The first peer whose connection closed after ``t``: (its rank, ns later)."""
        return next(((r, when - t) for when, r in self.closed if when > t and r != rank), None)

    def went_on(self, rank: int, t: int) -> list[int]:
        """Ranks that failed or ended after ``t``, or finished."""
        later = {r for when, r in self.ended if when > t and r != rank}
        return sorted(later.union(r for r in self.finished if r != rank))


def _ending(run: Run, rank: RankTimeline, peers: _PeerEvidence) -> Ending:
    st = rank.status
    alive = rank.last_time()  # the last moment its log shows it alive
    idle = not (rank.steps.end == OPEN).any() and not (rank.p2p.done == OPEN).any()

    def verdict(state: str, evidence: str, keeps_peers_waiting: bool = False) -> Ending:
        return Ending(rank.rank, state, evidence, alive, idle, keeps_peers_waiting)

    if st.state == RankState.MISSING:
        return verdict(MISSING, f"it has no usable log ({st.detail})")
    if st.state == RankState.NOT_LOADED:
        return verdict(NOT_LOADED, st.detail)
    if st.state == RankState.FINISHED:
        return verdict(EXITED, st.detail)
    if peers.interrupted is not None:
        if hung_before(rank, peers.interrupted):
            return _watched(rank, peers, verdict)
        if _ended_by_interrupt(rank, peers.interrupted):
            return verdict(INTERRUPTED, "the user interrupted the run (Ctrl-C) while it ran")
    if st.state == RankState.SIGNALED and _hung_when_signaled(rank):
        return _watched(rank, peers, verdict)  # the signal ended a hang; the hang is the news
    if st.state == RankState.SIGNALED and idle:
        waited = peers.stalled_since(rank.rank, rank.last_progress(), rank.last_of(fmt.SIGNAL).t)
        if waited:
            return verdict(
                HUNG,
                f"nothing after it moved until {st.error} ended it, while {said_ranks(waited)} "
                "stalled (watchdog) waiting",
            )
    if st.state in (RankState.FAILED, RankState.SIGNALED):
        return verdict(CRASHED, st.detail)
    if st.state in (RankState.STALLED, RankState.ABORTED):
        return _watched(rank, peers, verdict)
    through = _through_the_end(run, rank.rank)
    if through is not None:
        return verdict(
            EXITED,
            f"its log stops early, but rank {through} completed the end-of-run clock exchange, "
            "which waits for it: it ran to the end, and its last records were lost (a full "
            "disk, or the file cut)",
        )
    closed = peers.closed_after(rank.rank, alive)
    if closed is not None:
        return verdict(
            CRASHED,
            f"rank {closed[0]}'s connection to it closed {units.duration(closed[1])} after its "
            "last event",
        )
    if idle and peers.waiting:
        return verdict(
            UNKNOWN,
            f"it never reached the end of the run that {said_ranks(peers.waiting)} waited in: "
            "hung or slow between iterations, or died (the logs cannot tell which)",
            keeps_peers_waiting=True,
        )
    if idle:
        waited = peers.stalled_since(rank.rank, rank.last_progress(), np.iinfo(np.int64).max)
        if waited:  # a live process stuck between steps, not a dead one: see the docstring
            return verdict(
                HUNG,
                f"nothing after it moved while {said_ranks(waited)} stalled (watchdog) waiting, "
                "and no peer's connection to it closed (a dead process's closes on gloo; NCCL "
                "may not notice)",
            )
    went_on = peers.went_on(rank.rank, alive)
    if idle and went_on:
        return verdict(
            CRASHED,
            f"it stopped between steps while {said_ranks(went_on)} went on to end later",
        )
    through = _got_through(run, rank) if went_on else None
    if through is not None:
        return verdict(
            CRASHED,
            f"its log stops inside {through[0]}, whose message rank {through[1]} completed, "
            f"while {said_ranks(went_on)} went on to end later: it went on "
            "too, and its last records were lost (killed before they were written, or the "
            "file cut)",
        )
    termed = peers.terminated_after(rank.rank, alive)
    if termed:
        return verdict(
            CRASHED,
            f"its log stops {units.duration(termed[1])} before rank {termed[0]} recorded SIGTERM, "
            "which it never recorded itself (a live rank does): it died first, and the "
            "launcher ended the others",
        )
    return verdict(
        UNKNOWN,
        "its log stops with no later record: hung or killed, the logs cannot tell "
        "(no watchdog record, no peer lost its connection to it)",
    )


def _hung_when_signaled(rank: RankTimeline) -> bool:
    """Its watchdog recorded a stall and nothing moved between it and the terminating signal:
    the signal (a scheduler's time limit, `timeout`, the launcher tearing the job down) ended
    a rank that had already hung."""
    sig, stall = rank.last_of(fmt.SIGNAL), rank.final_stall()
    return sig is not None and stall is not None and stall.t <= sig.t


def _got_through(run: Run, rank: RankTimeline) -> tuple[str, int] | None:
    """A message the rank's log leaves open (an op posted, or the open SEND/RECV step's own
    when its post was not recorded) whose other side the peer completed: the message got
    through, so the rank was not waiting on it. (The step, the peer.)"""
    p2p = rank.p2p
    for row in np.flatnonzero((p2p.done == OPEN) & (p2p.match_rank >= 0)):
        peer = int(p2p.match_rank[row])
        if run.ranks[peer].p2p.done[int(p2p.match_index[row])] != OPEN:
            return run.catalog.texts[int(p2p.code[row])], peer
    steps = rank.steps
    for row in np.flatnonzero(steps.end == OPEN):
        message = step_message(run, rank.rank, int(steps.code[row]))
        if message is None or not 0 <= message.peer < run.world_size:
            continue
        if not run.ranks[message.peer].present:
            continue
        hits = counterpart_rows(run, rank.rank, message, int(steps.it[row]))
        if (run.ranks[message.peer].p2p.done[hits] != OPEN).any():
            return run.catalog.texts[int(steps.code[row])], message.peer
    return None


def _watched(rank: RankTimeline, peers: _PeerEvidence, verdict) -> Ending:
    """A rank its watchdog recorded stalled (and perhaps ended): alive where it stalled."""
    waiting_in = peers.waiting.get(rank.rank)
    if waiting_in is not None:
        return verdict(EXITED, f"finished its plan and waits in {waiting_in}")
    if (rank.steps.end == OPEN).any():
        return verdict(COMPUTING, "its watchdog recorded it stalled inside a step")
    return verdict(HUNG, "its watchdog recorded it stalled outside any step")


_CHAINED = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)


def own_error(rank: RankTimeline) -> str | None:
    """The error the user's code raised on ``rank`` when the framework wrapped it (`origin`
    of its last exception), None otherwise: what findings quote of it."""
    exc = rank.last_of(fmt.EXCEPTION)
    return origin(str(exc.fields.get("traceback", "")))[1] if exc else None


def origin(traceback: str) -> tuple[str | None, str | None]:
    """The innermost frame of the first exception of the chain, and that exception when
    another one wrapped it (torch's pipelining re-raises a stage's error as its own
    "[Stage N] failed to run forward"): the frame and error the user's code raised."""
    first = traceback
    for separator in _CHAINED:
        first = first.split(separator, 1)[0]
    lines = [ln.strip() for ln in first.splitlines() if ln.strip()]
    frames = [ln for ln in lines if ln.startswith("File ")]
    chained = first != traceback and lines and not lines[-1].startswith(("File ", "Traceback"))
    return (frames[-1] if frames else None), (lines[-1] if chained else None)
