"""The rank at the end of a wait-for chain: what it was doing instead of the awaited step.

Told in the words of its `endings` verdict (the one `rank_failed` tells too), with the
likely cause, so that a stall's headline ends in something a user can act on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipetrace import units
from pipetrace.analyze import endings as en
from pipetrace.analyze.blocked import open_rows
from pipetrace.analyze.device_times import pending_work
from pipetrace.analyze.model import RankState, RankTimeline, Run


@dataclass(frozen=True)
class Terminal:
    state: str  # an `endings` state
    text: str  # what the rank did, for the headline
    cause: str  # the likely cause


@dataclass(frozen=True)
class _Case:
    """What the terminal rank's ending and the awaited step tell."""

    run: Run
    rank: RankTimeline
    ending: en.Ending
    wanted: str
    never: str  # why the awaited step never came, from the rank's own steps
    iteration: int  # the awaited step's

    @property
    def id(self) -> int:
        return self.rank.rank


def terminal(run: Run, rank_id: int, wanted: str, iteration: int) -> Terminal:
    """The rank ``rank_id`` that never ran ``wanted`` of ``iteration`` (``""``: nothing in
    particular was awaited)."""
    if not 0 <= rank_id < run.world_size:
        return Terminal(
            en.MISSING,
            f"rank {rank_id} does not exist (world size {run.world_size})",
            "the plan or the runtime addresses a rank outside the job",
        )
    rank = run.ranks[rank_id]
    ending = en.rank_endings(run)[rank_id]
    in_plan = wanted in rank.plan
    of = f" of iteration {iteration}" if iteration >= 0 else ""
    never = (
        (f"it never ran {wanted}{of}" + ("" if in_plan else ", which is not in its plan"))
        if not _executed(run, rank, wanted, iteration)
        else f"it ran {wanted} but the message never arrived"
    )
    case = _Case(run, rank, ending, wanted, never, iteration)
    return _BY_STATE.get(ending.state, _unknown)(case)


def _not_loaded(c: _Case) -> Terminal:
    return Terminal(
        en.NOT_LOADED,
        f"rank {c.id} was not loaded ({c.rank.status.detail})",
        f"unknown: load rank {c.id} too to see why it never ran {c.wanted or 'on'}",
    )


def _missing(c: _Case) -> Terminal:
    return Terminal(
        en.MISSING,
        f"rank {c.id} has no log",
        en.missing_cause(c.run, c.id),
    )


def _exited(c: _Case) -> Terminal:
    began = c.rank.iterations.it
    last = int(began.max()) if len(began) else -1
    if c.wanted in c.rank.plan and last < c.iteration:
        ran = f"after {last + 1} iteration(s)" if last >= 0 else "before its first iteration"
        return Terminal(
            en.EXITED,
            f"rank {c.id} left its training loop {ran} and {_waits(c.ending.evidence)}; it "
            f"never began iteration {c.iteration}",
            "the ranks ran different numbers of iterations (a data loader of another length "
            "on this rank, or a stopping condition that differs between ranks)",
        )
    return Terminal(
        en.EXITED,
        f"rank {c.id} {c.ending.evidence}; {c.never}",
        (
            "the plans of the two ranks disagree: the counterpart step is missing"
            if c.wanted not in c.rank.plan
            else "the counterpart was skipped (a custom step function that does not send/recv?)"
        ),
    )


def _waits(evidence: str) -> str:
    """An `exited` verdict's evidence without its "finished its plan and" (the plan of the
    iterations it ran)."""
    return evidence.removeprefix("finished its plan and ")


def _crashed(c: _Case) -> Terminal:
    how = c.rank.status.detail
    own = en.own_error(c.rank)
    if own:  # the user's own error, wrapped by the framework, as `rank_failed` names it
        how = f"raised {' '.join(own.split())}"
    if c.rank.status.state == RankState.ENDED:
        how = f"died without a trace ({c.ending.evidence})"
    at = en.where(c.run, c.rank)
    return Terminal(
        en.CRASHED,
        f"rank {c.id} {how} {at.phrase}",
        f"rank {c.id} failed before reaching {c.wanted}",
    )


def _computing(c: _Case) -> Terminal:
    at = en.where(c.run, c.rank)
    text = at.step if at.open else c.run.catalog.texts[c.rank.steps.code[open_rows(c.rank)[-1]]]
    begun = _open_since(c.run, c.rank, text)
    begun = c.ending.last_alive_ns if begun is None else begun
    return Terminal(
        en.COMPUTING,
        f"rank {c.id} is still in {text} (begun {begun / 1e9:.3f} s, open for at least "
        f"{units.duration(max(0, c.ending.last_alive_ns - begun))}); {c.never}",
        f"step {text} on rank {c.id} never returns (an infinite loop, a lock, or a very slow step)",
    )


def _interrupted(c: _Case) -> Terminal:
    at = en.where(c.run, c.rank)
    return Terminal(
        en.INTERRUPTED,
        f"rank {c.id} was interrupted by the user {at.phrase}; {c.never}",
        "the user interrupted the run (Ctrl-C) before the message came",
    )


def _hung(c: _Case) -> Terminal:
    pending = pending_work(c.rank)
    if pending is not None:  # its host finished enqueuing: the device never got through it
        work = pending.work
        behind = f" ({pending.behind} more after it)" if pending.behind else ""
        why = (
            "a transfer whose peer's device never ran its side: follow that peer"
            if work.stream == "p2p" or "SEND" in work.label or "RECV" in work.label
            else "a kernel that never ends: the root of the hang if its peers wait on it"
        )
        cause = f"rank {c.id} waits on its device: {work.describe()}{behind} ({why})"
    else:
        cause = (
            f"rank {c.id} is stuck outside the pipeline's steps (user code between steps, "
            "a lock, a data loader, a frozen process)"
        )
    return Terminal(en.HUNG, _stopped(c, " stalled"), cause)


def _unknown(c: _Case) -> Terminal:
    at = en.where(c.run, c.rank)
    return Terminal(
        en.UNKNOWN,
        _stopped(c, "'s log stops"),
        f"rank {c.id} hung or was killed {at.phrase}: look at its process and its stderr",
    )


def _stopped(c: _Case, verb: str) -> str:
    """Where the rank's log stopped (its iteration), the evidence, that its last records
    were lost when a peer saw it later, and what it never did."""
    at = en.where(c.run, c.rank)
    of = f" (iteration {at.iterations[0]})" if at.iterations else ""
    ran_on = en.ran_past_log(c.run, c.rank)
    lost = ""
    if ran_on is not None:
        it, peer, step = ran_on
        lost = f"; its last records were lost: rank {peer} completed {step} with it"
        lost += f" in iteration {it}"
    return f"rank {c.id}{verb} {at.phrase}{of} ({c.ending.evidence}){lost}; {c.never}"


_BY_STATE: dict[str, Callable[[_Case], Terminal]] = {
    en.NOT_LOADED: _not_loaded,
    en.MISSING: _missing,
    en.EXITED: _exited,
    en.CRASHED: _crashed,
    en.COMPUTING: _computing,
    en.INTERRUPTED: _interrupted,
    en.HUNG: _hung,
}


def _executed(run: Run, rank: RankTimeline, text: str, iteration: int) -> bool:
    code = run.catalog.code(text)
    if code < 0:
        return False
    rows = rank.steps.code == code
    return bool((rows & (rank.steps.it == iteration)).any())


def _open_since(run: Run, rank: RankTimeline, text: str | None) -> int | None:
    """When the rank began the still-open step ``text`` (its latest open row)."""
    begun = [
        int(rank.steps.begin[r])
        for r in open_rows(rank)
        if run.catalog.texts[rank.steps.code[r]] == text
    ]
    return begun[-1] if begun else None
