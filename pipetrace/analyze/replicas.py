"""Across the replicas of a data-parallel run: which pipeline is slowest and by how much,
how long the gradient reduction waits for the last pipeline each iteration, a hang confined
to one replica, and findings that name global ranks with their replica and stage.

Every replica runs the same plan; what joins them is a collective step (`JOINING`: FSDP's
gradient reduce-scatter ``REDUCE_GRAD`` and parameter all-gather ``UNSHARD``). A replica
*arrives* at the reduction when its rank begins its first ``REDUCE_GRAD`` of the iteration
(its iteration end in a run without one); the early replicas wait there for the last, so
the spread of the arrivals is the time the reduction waited. A run of one pipeline has
nothing here (`replica_summary` is None) and its findings keep their plain ``rank N``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pipetrace.analyze import endings as en
from pipetrace.analyze import findings as fk
from pipetrace.analyze.blocked import COLLECTIVE
from pipetrace.analyze.findings import Finding
from pipetrace.analyze.model import KIND_CODE, OPEN, RankState, RankTimeline, Run
from pipetrace.analyze.pipelines import Pipelines
from pipetrace.analyze.selection import short_rank_list
from pipetrace.records import JsonRecord, record_json
from pipetrace.schedule.ir import Step, StepKind

_REDUCE = KIND_CODE[StepKind.REDUCE_GRAD]
_RANK = re.compile(r"(?<![\w-])(?:rank\(s\) (?P<many>\d+(?:, \d+)*)|rank (?P<one>\d+))")


def _waiting_in(step: Step | None) -> str:
    """The collective a rank of another replica waits in, by the step it sits in: FSDP's
    gradient reduction, or its parameter all-gather (its own step, or waited inside a
    forward or backward)."""
    if step is None:
        return "collective"
    if step.kind is StepKind.REDUCE_GRAD:
        return "gradient reduction"
    return (
        "parameter all-gather" if step.kind is StepKind.UNSHARD or step.is_compute else "collective"
    )


@dataclass(frozen=True)
class ReplicaSkew(JsonRecord):
    """One iteration: how long the first replica to arrive at the gradient reduction waited
    for the last one (on the pipeline rank where the spread is widest)."""

    iteration: int
    skew_ns: int
    first_replica: int
    last_replica: int


@dataclass(frozen=True)
class ReplicaTime(JsonRecord):
    """One replica: its global ranks and its mean time from the iteration's begin (its first
    rank on any replica) to this replica's last rank arriving at the gradient reduction (None:
    no complete iteration). The slowest replica is the one that arrives last."""

    replica: int
    ranks: list[int]
    mean_ns: float | None


@dataclass
class ReplicaSummary:
    """The cross-replica metrics of a run with several replicas (docs/analyze.md)."""

    count: int
    reduction: str  # what the arrival is: "REDUCE_GRAD" or "iteration end"
    replicas: list[ReplicaTime]
    slowest: int | None  # the replica the others wait for most, on average
    slowest_by_ns: float | None  # its mean lateness: after the first replica, where latest
    slowest_by_fraction: float | None  # ... relative to the fastest replica's mean time
    skew: list[ReplicaSkew] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        skews = [s.skew_ns for s in self.skew]
        return record_json(
            self,
            replicas=[r.to_json() for r in self.replicas],
            skew=[s.to_json() for s in self.skew],
            skew_mean_ns=float(np.mean(skews)) if skews else None,
            skew_max_ns=max(skews) if skews else None,
        )


def replica_summary(run: Run) -> ReplicaSummary | None:
    """None for a run of one pipeline."""
    pipelines = run.pipelines
    if not pipelines.several:
        return None
    iterations = run.iterations()
    reduced = any(_has_reduction(run, r) for r in run.present_ranks)
    # arrival[replica, pipeline rank, iteration] and begin[replica, iteration]; -1: unknown
    size = len(pipelines.members(0))
    arrival = np.full((pipelines.count, size, len(iterations)), OPEN, np.int64)
    begin = np.full((pipelines.count, len(iterations)), np.iinfo(np.int64).max, np.int64)
    index = {it: i for i, it in enumerate(iterations)}
    for rank in run.present_ranks:
        replica, prank = pipelines.replica_of(rank.rank), pipelines.pipeline_rank(rank.rank)
        cols = np.array([index[int(i)] for i in rank.iterations.it], np.int64)
        if len(cols):
            np.minimum.at(begin[replica], cols, rank.iterations.begin)
        for it, t in _arrivals(run, rank, reduced).items():
            arrival[replica, prank, index[it]] = t
    # the replicas loaded (`--replica`, `--ranks` may leave some out): measured among them
    loaded = [
        r
        for r in range(pipelines.count)
        if all(run.ranks[g].status.state != RankState.NOT_LOADED for g in pipelines.members(r))
    ]
    complete = (arrival[loaded] != OPEN).all(axis=(0, 1)) & bool(loaded)
    done = [it for it, ok in zip(iterations, complete.tolist()) if ok]
    return _summarize(pipelines, loaded, arrival[:, :, complete], begin[:, complete], reduced, done)


def _has_reduction(run: Run, rank: RankTimeline) -> bool:
    return bool((run.catalog.kind[rank.steps.code] == _REDUCE).any())


def _arrivals(run: Run, rank: RankTimeline, reduced: bool) -> dict[int, int]:
    """Iteration -> when the rank arrived at the gradient reduction (its first REDUCE_GRAD
    begin, or its iteration end without reductions)."""
    if not reduced:
        it = rank.iterations
        return {int(i): int(e) for i, e in zip(it.it, it.end) if e != OPEN}
    steps = rank.steps
    rows = np.flatnonzero(run.catalog.kind[steps.code] == _REDUCE)
    out: dict[int, int] = {}
    for it, t in zip(steps.it[rows].tolist(), steps.begin[rows].tolist()):
        out[it] = min(out.get(it, t), t)
    return out


def _summarize(
    pipelines: Pipelines,
    loaded: list[int],
    arrival: np.ndarray,
    begin: np.ndarray,
    reduced: bool,
    done: list[int],
) -> ReplicaSummary:
    """``arrival[replica, pipeline rank, i]`` and ``begin[replica, i]`` of the iterations
    ``done`` (complete on every rank of the ``loaded`` replicas); the others have no time."""
    means: list[float | None] = [None] * pipelines.count
    if loaded and done:
        ready = arrival[loaded].max(axis=1)  # [loaded replica, iteration]: its last rank arrives
        work = ready - begin[loaded].min(axis=0)  # from the iteration's first begin on any
        for r, w in zip(loaded, work):
            means[r] = float(w.mean())
    times = [ReplicaTime(r, list(pipelines.members(r)), m) for r, m in enumerate(means)]
    slowest = by = fraction = None
    if loaded and done:
        # how late each replica arrives after the first, at the pipeline rank where it is
        # latest: with FSDP the replicas meet at every all-gather, so their last ranks arrive
        # together and only the per-rank lateness tells which one the others wait for
        late = arrival[loaded] - arrival[loaded].min(axis=0)
        behind = late.max(axis=1).mean(axis=1)
        slowest = loaded[int(np.argmax(behind))]
        by = float(behind.max())
        fast_ns = min(m for m in means if m is not None)
        fraction = by / fast_ns if fast_ns else None
    skew = []
    for col, it in enumerate(done):
        at = arrival[loaded, :, col]
        spread = at.max(axis=0) - at.min(axis=0)
        p = int(np.argmax(spread))
        times_at = at[:, p]
        first, last = loaded[int(np.argmin(times_at))], loaded[int(np.argmax(times_at))]
        skew.append(ReplicaSkew(it, int(spread[p]), first, last))
    return ReplicaSummary(
        pipelines.count,
        StepKind.REDUCE_GRAD.value if reduced else "iteration end",
        times,
        slowest,
        by,
        fraction,
        skew,
    )


# -- findings --------------------------------------------------------------------------------


def replica_findings(run: Run, findings: list[Finding]) -> list[Finding]:
    """``findings`` with a hang confined to one replica said as such, and every ``rank N``
    named with its replica and stage; unchanged for a run of one pipeline."""
    if not run.pipelines.several:
        return findings
    quoted = _quoted(run)
    return [_named(run, _confined(run, f), quoted) for f in findings]


def _confined(run: Run, finding: Finding) -> Finding:
    """A hang whose root (the deadlock's cycle, the stalled chain's last rank) lies in one
    replica, while ranks of other replicas wait for it in a collective: say so. P2P waits
    never leave a pipeline, so another replica is in the finding only through a collective."""
    if finding.kind not in (fk.DEADLOCK, fk.RANK_STALLED):
        return finding
    details = finding.details
    roots = details.get("cycle") or [details.get("terminal_rank")]
    hung = {run.pipelines.replica_of(r) for r in roots if isinstance(r, int)}
    blocked = details.get("blocked", {})
    waiting = {
        int(r): b["step"]
        for r, b in blocked.items()
        if b.get("op") == COLLECTIVE and run.pipelines.replica_of(int(r)) not in hung
    }
    if len(hung) != 1 or not waiting:
        return finding
    (replica,) = hung
    others = sorted({run.pipelines.replica_of(r) for r in waiting})
    parsed = {text: run.catalog.step(run.catalog.code(text)) for text in set(waiting.values())}
    steps = sorted(parsed, key=lambda t: (getattr(parsed[t], "stage", -1), t))
    what = sorted({_waiting_in(parsed[text]) for text in steps})
    words = (
        ", ".join(f"replica {r}" for r in others)
        if len(others) <= 3
        else f"replicas {short_rank_list(others)}"
    )
    shown = ", ".join(steps[:3]) + (f" and {len(steps) - 3} more" if len(steps) > 3 else "")
    finding.message += (
        f"; the hang is confined to replica {replica}: {words} "
        f"{'was' if len(others) == 1 else 'were'} waiting for it in the {' and '.join(what)} "
        f"({shown})"
    )
    details["replicas"] = {
        "hung": replica,
        "waiting": others,
        "waiting_ranks": sorted(waiting),
        "waiting_in": steps,
    }
    return finding


def _named(run: Run, finding: Finding, quoted: dict[str, str]) -> Finding:
    def name(text: str | None) -> str | None:
        if text is None:
            return None
        text = _renamed(run, text)
        for renamed, own in quoted.items():  # the ranks' own words stay theirs
            text = text.replace(renamed, own)
        return text

    finding.message = name(finding.message) or ""
    finding.cause = name(finding.cause) or ""
    finding.steps = [replace(s, note=name(s.note)) for s in finding.steps]
    return finding


def _renamed(run: Run, text: str) -> str:
    return _RANK.sub(lambda m: _names(run, (m["many"] or m["one"]).split(", ")), text)


def _names(run: Run, ranks: list[str]) -> str:
    """``rank 1`` or ``rank(s) 1, 3`` named; names hold commas, so several are joined by
    "and" or ";"."""
    names = [run.rank_name(int(rank)) for rank in ranks]
    return " and ".join(names) if len(names) <= 2 else "; ".join(names)


def _quoted(run: Run) -> dict[str, str]:
    """The ranks' errors as findings quote them (on one line, perhaps cut short), renamed ->
    as written: an error that says "rank 1" means whatever rank the user's code meant."""
    quoted: dict[str, str] = {}
    for rank in run.present_ranks:
        for error in (rank.status.error, en.own_error(rank)):
            line = " ".join(error.split()) if error else ""
            for cut in (line, line[:97] + "...", line[:157] + "..."):
                if _renamed(run, cut) != cut:
                    quoted[_renamed(run, cut)] = cut
    return quoted
