"""The static verifier: every problem a plan has, each as a :class:`Finding` with a stable kind.

torch.distributed.pipelining's validator counts steps with sets (duplicates slip through),
ignores the comm schedule and simulates sends as fire-and-forget, so it misses the classic
hang where two ranks each SEND to the other first. This verifier counts, checks data
dependencies and comm pairing, and runs the plan under a chosen P2P semantics with the
shared executor (:mod:`.execution`), naming every blocked rank and the wait-for cycle.

Positions (``StepRef.position``) index ``plan.ranks[rank]`` as stored, bubbles included:
the convention of :func:`pipetrace.schedule.grid.render_grid` marks.

The checks run on the compiled int form of the plan (:class:`.execution.Program`) with
comprehensions and set algebra: plans reach ~4e5 steps and must verify in well under a
second. Slow, readable code runs only once something is wrong.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import accumulate, chain

import numpy as np

from pipetrace.records import JsonRecord, record_json

from .execution import (
    CODE_B,
    CODE_F,
    CODE_I,
    CODE_RECV_B,
    CODE_RECV_F,
    CODE_SEND_B,
    CODE_SEND_F,
    CODE_W,
    NO_PEER,
    SEMANTICS,
    Checked,
    Outcome,
    Program,
    compile_plan,
    counterpart,
    execute,
    stalls,
    with_messages,
)
from .ir import COMM_KINDS, COMPUTE_KINDS, Plan, ScheduleError, StepKind, format_step, thread_parts
from .lowering import CannotFinish

__all__ = [
    "FINDING_KINDS",
    "SEMANTICS",
    "BlockedRank",
    "Finding",
    "StepRef",
    "VerifyReport",
    "verify",
]

FINDING_KINDS = (  # every Finding.kind, documented in docs/schedules.md
    "index_out_of_range",
    "stage_on_two_ranks",
    "placement_mismatch",
    "missing_step",
    "duplicate_step",
    "conflicting_backward",
    "backward_before_forward",
    "weight_before_input",
    "forward_before_input",
    "backward_before_grad",
    "send_before_compute",
    "unknown_peer",
    "missing_recv",
    "missing_send",
    "channel_order",
    "fifo_mismatch",
    "deadlock",
    "stuck",
    "deadlock_unchecked",
    "tied_reduce",
    # activation swap groups (`verify_swap.check_swaps`)
    "swap_without_activations",
    "swap_incomplete",
    "swap_order",
    "offload_not_waited",
    "load_late",
)

_KIND_NAMES = ("F", "B", "I", "W", "RECV_F", "RECV_B", "SEND_F", "SEND_B")  # by code


@dataclass(frozen=True, slots=True)
class StepRef(JsonRecord):
    """A step of the plan, by its position with bubbles (see `Finding` on why this is not
    `pipetrace.analyze.findings.StepRef`)."""

    rank: int
    position: int  # index into plan.ranks[rank], bubbles included
    text: str


@dataclass(slots=True)
class Finding:
    """A problem of a plan, found without running it.

    Not `pipetrace.analyze.findings.Finding` (a problem of a recorded run): a plan has no
    times, iterations or likely causes to report, its step positions count bubbles where
    the run's do not, and the two JSON forms are separate documented contracts
    (docs/schedules.md, docs/analyze.md). The kinds differ too (`FINDING_KINDS` here); the
    severity words are the same."""

    kind: str
    severity: str  # "error" | "warning"
    message: str
    ranks: tuple[int, ...] = ()
    steps: tuple[StepRef, ...] = ()

    def to_json(self) -> dict[str, object]:
        return record_json(self, ranks=list(self.ranks), steps=[s.to_json() for s in self.steps])


@dataclass(slots=True)
class BlockedRank(JsonRecord):
    """A rank that cannot move: the step it is in and whom it waits for.

    ``peer_state`` is ``"blocked"``, ``"finished"`` or ``"missing"`` (the peer stage has no
    rank), so a reader can tell a cycle from a message that will never come.
    """

    rank: int
    position: int
    step: str
    waits_for: int | None
    peer_state: str


@dataclass(slots=True)
class VerifyReport:
    """The findings of one :func:`verify` call.

    ``blocked`` and ``cycle`` are None when no execution ran (a compute-only plan that could
    not be lowered); ``blocked`` is empty when every rank finished. For a compute-only plan
    the execution findings (``deadlock``, ``stuck``, ``fifo_mismatch``) and ``blocked`` refer
    to positions in ``lowered``, every other finding to ``plan``.
    """

    plan: Plan
    semantics: str
    findings: list[Finding]
    blocked: dict[int, BlockedRank] | None
    cycle: list[int] | None
    lowered: Plan | None = None

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    @property
    def executed(self) -> Plan:
        """The plan that ran, whose positions ``blocked`` refers to."""
        return self.lowered if self.lowered is not None else self.plan

    def marks(self) -> dict[tuple[int, int], str]:
        """Grid marks (for :attr:`executed`) on every blocked step."""
        return {
            (b.rank, b.position): "BLOCKED"
            if b.waits_for is None
            else f"BLOCKED waiting for rank {b.waits_for}"
            for b in (self.blocked or {}).values()
        }

    def to_json(self) -> dict[str, object]:
        plan = self.plan
        return {
            "plan": {
                "name": plan.name,
                "params": plan.params,
                "num_ranks": plan.num_ranks,
                "num_stages": plan.num_stages,
                "num_microbatches": plan.num_microbatches,
                "has_comms": plan.has_comms(),
            },
            "semantics": self.semantics,
            "ok": self.ok,
            "lowered": self.lowered is not None,
            "counts": {
                sev: sum(f.severity == sev for f in self.findings) for sev in ("error", "warning")
            },
            "findings": [f.to_json() for f in self.findings],
            "blocked": None
            if self.blocked is None
            else [self.blocked[r].to_json() for r in sorted(self.blocked)],
            "cycle": self.cycle,
        }


def verify(plan: Plan, *, semantics: str = "eager") -> VerifyReport:
    """Check coverage, dependencies, comm pairing and (by execution) deadlock freedom.

    A compute-only plan gets the coverage and dependency checks, and its deadlock check runs
    on :func:`pipetrace.schedule.lowering.lower`'s output when lowering succeeds.
    """
    if semantics not in SEMANTICS:
        raise ScheduleError(f"unknown semantics {semantics!r}; expected one of {SEMANTICS}")
    from pipetrace.gc_pause import gc_paused

    with gc_paused():
        comms = plan.has_comms()
        program = compile_plan(plan)
        checked = program.checked_ids()
        raw_stages = program.stages_named()
        findings = [
            *_check_indices(program, raw_stages),
            *_check_placement(program, raw_stages),
            *_check_dependencies(program, checked, comms),
            *_check_coverage(program, checked),
            *_check_tied(program),
            *_check_swaps(program),
        ]
        report = VerifyReport(plan, semantics, findings, None, None)
        if comms:
            findings.extend(_check_comms(program, semantics))
        else:
            try:
                report.lowered = with_messages(plan)
            except CannotFinish as exc:
                findings.append(_cannot_finish(exc, findings))
                return report
            except ScheduleError as exc:
                findings.append(
                    Finding(
                        "deadlock_unchecked",
                        "warning",
                        f"the compute-only plan could not be lowered to comms ({exc}); "
                        "the deadlock check was skipped",
                    )
                )
                return report
            program = compile_plan(report.lowered)
        _check_execution(report, execute(program, semantics))
        return report


def _cannot_finish(exc: CannotFinish, findings: list[Finding]) -> Finding:
    """A compute order whose ranks wait on each other forever is a deadlock under any
    semantics (no message is involved yet); where the plan has errors already (a step
    missing, say), they may be why, so the lowering's verdict stays a warning."""
    if any(f.severity == "error" for f in findings):
        return Finding(
            "deadlock_unchecked",
            "warning",
            f"the compute-only plan could not be lowered to comms ({exc}); "
            "the deadlock check was skipped",
        )
    return Finding("deadlock", "error", str(exc), tuple(exc.ranks))


# ---------------------------------------------------------------------------------------
# Indices, placement, data dependencies, coverage
# ---------------------------------------------------------------------------------------


def _ref(program: Program, rank: int, index: int) -> StepRef:
    """A reference to step ``index`` of a compiled rank, by its position in the plan."""
    return StepRef(rank, program.positions[rank][index], format_step(program.steps[rank][index]))


def _check_indices(program: Program, raw_stages: list[set[int | None]]) -> list[Finding]:
    """Stage and micro-batch indices in range (checked per rank with sets; slow path on error)."""
    plan = program.plan
    S, M = plan.num_stages, plan.num_microbatches
    good_stages, good_mbs = {*range(S), None}, {*range(M), None}
    findings = []
    for rank, steps in enumerate(program.steps):
        if (
            raw_stages[rank] <= good_stages
            and -2 not in program.ids[rank]
            and (program.mb_stride == M)
        ):
            continue  # indices are non-negative by construction; -2 marks a micro-batch >= M
        for index, step in enumerate(steps):
            bad = [
                leaf
                for leaf in step.leaves()
                if leaf.stage not in good_stages or leaf.microbatch not in good_mbs
            ]
            if bad:
                findings.append(
                    Finding(
                        "index_out_of_range",
                        "error",
                        f"rank {rank}: {format_step(bad[0])} is out of range (stages 0..{S - 1}, "
                        f"micro-batches 0..{M - 1})",
                        (rank,),
                        (_ref(program, rank, index),),
                    )
                )
    return findings


def _first_of_stage(program: Program, rank: int, stage: int) -> StepRef:
    steps = program.steps[rank]
    index = next(i for i, s in enumerate(steps) if any(x.stage == stage for x in s.leaves()))
    return _ref(program, rank, index)


def _check_placement(program: Program, raw_stages: list[set[int | None]]) -> list[Finding]:
    """Each stage on exactly one rank, and on the rank the placement names."""
    plan = program.plan
    holders: dict[int, list[int]] = {}
    for rank, stages in enumerate(raw_stages):
        for stage in sorted(stages & set(range(plan.num_stages))):
            holders.setdefault(stage, []).append(rank)
    findings = []
    for stage, owner in enumerate(plan.placement):
        ranks = holders.get(stage, [])
        refs = (
            tuple(_first_of_stage(program, r, stage) for r in ranks)
            if (len(ranks) > 1 or owner not in ranks)
            else ()
        )
        if len(ranks) > 1:
            findings.append(
                Finding(
                    "stage_on_two_ranks",
                    "error",
                    f"stage {stage} has steps on ranks {ranks}; a stage must live on one rank",
                    tuple(ranks),
                    refs,
                )
            )
        elif not 0 <= owner < plan.num_ranks:
            findings.append(
                Finding(
                    "placement_mismatch",
                    "error",
                    f"the placement puts stage {stage} on rank {owner}, which does not exist "
                    f"(the plan has {plan.num_ranks} ranks)",
                    tuple(ranks),
                    refs,
                )
            )
        elif ranks and owner not in ranks:
            findings.append(
                Finding(
                    "placement_mismatch",
                    "error",
                    f"the placement puts stage {stage} on rank {owner} but its steps are on "
                    f"rank {ranks[0]}",
                    (owner, *ranks),
                    refs,
                )
            )
    return findings


_NEEDS = {  # dependency finding kind -> what the step ran before ({r} is the rank)
    "forward_before_input": "runs before its input exists (no {s}RECV_F{m} or {p}F{m} "
    "earlier on rank {r})",
    "backward_before_forward": "runs before its forward {s}F{m}",
    "backward_before_grad": "runs before its output gradient exists (no {s}RECV_B{m}, "
    "{n}B{m} or {n}I{m} earlier on rank {r})",
    "weight_before_input": "runs before {s}I{m}, which the weight gradient needs",
    "send_before_activation": "sends before {s}F{m} produced the activation",
    "send_before_gradient": "sends before {s}B{m} or {s}I{m} produced the gradient",
}


def _check_dependencies(program: Program, checked: Checked, comms: bool) -> list[Finding]:
    """Every step runs after what it consumes exists on its rank.

    F needs its RECV_F or the previous stage's F; a backward (B/I) needs its RECV_B or the
    next stage's backward, and its own F; W needs its I; a SEND needs the compute that
    produces what it sends. In a compute-only plan an input from another rank counts as
    available (the comms are implicit). Each step id is compared by arithmetic with the
    first index of its inputs' ids on the same rank.
    """
    if _dependencies_met(program, checked, comms):
        return []
    plan = program.plan
    one_stage = 8 * program.mb_stride
    last_stage = one_stage * (plan.num_stages - 1)
    placement = plan.placement
    findings: list[Finding] = []
    for rank, (ids, leaves) in enumerate(checked):
        never = len(ids)
        first = dict(zip(reversed(ids), range(never - 1, -1, -1)))  # id -> first index
        for i, k in leaves:
            if first.get(k, never) > i:
                first[k] = i
        get = first.get
        for i, k in chain(enumerate(ids), leaves):
            code = k & 7
            if k < 0 or code in (CODE_RECV_F, CODE_RECV_B):
                continue  # not checked here, or needs nothing
            if code == CODE_SEND_F:
                if not get(k - CODE_SEND_F, never) < i:
                    findings.append(_dependency(program, rank, i, k, "send_before_activation"))
            elif code == CODE_SEND_B:
                if not (
                    get(k - CODE_SEND_B + CODE_B, never) < i
                    or get(k - CODE_SEND_B + CODE_I, never) < i
                ):
                    findings.append(_dependency(program, rank, i, k, "send_before_gradient"))
            elif code == CODE_F:
                if (
                    k >= one_stage
                    and not (get(k + CODE_RECV_F, never) < i or get(k - one_stage, never) < i)
                    and (comms or placement[k // one_stage - 1] == rank)
                ):
                    findings.append(_dependency(program, rank, i, k, "forward_before_input"))
            elif code == CODE_W:
                if _weight_too_early(program, rank, i, k, get(k - 1, -1)):
                    findings.append(_dependency(program, rank, i, k, "weight_before_input"))
            elif i <= get(k - code, -1):  # B or I, and its F is not before it
                findings.append(_dependency(program, rank, i, k, "backward_before_forward"))
            elif (
                k < last_stage
                and not (
                    get(k - code + CODE_RECV_B, never) < i
                    or get(k - code + one_stage + CODE_B, never) < i
                    or get(k - code + one_stage + CODE_I, never) < i
                )
                and (comms or placement[k // one_stage + 1] == rank)
            ):
                findings.append(_dependency(program, rank, i, k, "backward_before_grad"))
    return findings


def _weight_too_early(program: Program, rank: int, index: int, step_id: int, at: int) -> bool:
    """Whether the W ``step_id`` at ``index`` runs before its I, first at ``at`` (-1: none).

    A W in the same composite as its I runs after it only in an OVERLAP_B_F that writes the
    I first: its backward parts share one thread (`thread_parts`). The parts of an
    OVERLAP_F_B run concurrently, so there a W never waits for its I.
    """
    if index != at:
        return index < at
    stage, mb = step_id // (8 * program.mb_stride), (step_id >> 3) % program.mb_stride
    weight, need = (StepKind.W, stage, mb), (StepKind.I, stage, mb)
    for group in thread_parts(program.steps[rank][index]):
        work = [(leaf.kind, leaf.stage, leaf.microbatch) for leaf in group]
        if weight in work:
            return need not in work[: work.index(weight)]
    return True


def _dependencies_met(program: Program, checked: Checked, comms: bool) -> bool:
    """Whether `_check_dependencies` finds nothing, decided with arrays: what it finds for
    nearly every plan. False (the loop then says what is wrong) whenever a step may run
    too early, and for plans the tables below cannot describe: composite steps,
    out-of-range indices, or a step id present twice.

    With every id present once, a table over the id space gives each id's index and rank;
    an input that is absent, or on another rank, counts as "never" (after every step).
    Each kind's inputs are looked up for the steps of that kind only (`_Lookup`).
    """
    arrays, plan = program.arrays, program.plan
    if arrays.ids.dtype == object or any(
        leaves or ids is not compiled for (ids, leaves), compiled in zip(checked, program.ids)
    ):
        return False
    ids = arrays.ids
    one_stage = 8 * program.mb_stride
    span = one_stage * (plan.num_stages + 2)  # every id looked up, shifted by one stage
    present = ids >= 0
    slot = ids[present] + one_stage
    if np.bincount(slot, minlength=span).max(initial=0) > 1:
        return False
    lengths = list(map(len, program.ids))
    index = np.arange(len(ids)) - np.repeat(np.cumsum([0, *lengths])[:-1], lengths)
    at_index, on_rank = np.full(span, np.iinfo(np.int64).max), np.full(span, -1)
    at_index[slot], on_rank[slot] = index[present], arrays.ranks[present]
    table = _Lookup(program, comms, at_index, on_rank, ids, index)
    code = np.where(present, ids & 7, -1)
    return all(
        table.kind_ok(np.flatnonzero(chosen))
        for chosen in (code == CODE_F, (code == CODE_B) | (code == CODE_I), code == CODE_W)
    ) and table.sends_ok(np.flatnonzero(code >= CODE_SEND_F))


@dataclass(slots=True)
class _Lookup:
    """`_dependencies_met`'s tables: by id (shifted by one stage), the index of the step
    with that id and its rank (``never`` and -1 when absent); and every step's id and index."""

    program: Program
    comms: bool
    at_index: np.ndarray
    on_rank: np.ndarray
    ids: np.ndarray
    index: np.ndarray

    def before(self, wanted: np.ndarray, rank: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Whether the step with id ``wanted`` comes earlier on ``rank``, before ``index``."""
        one_stage = 8 * self.program.mb_stride
        at = np.clip(wanted + one_stage, 0, len(self.at_index) - 1)
        return (self.on_rank[at] == rank) & (self.at_index[at] < index)

    def kind_ok(self, chosen: np.ndarray) -> bool:
        """F, B / I, or W steps (``chosen``, one kind): each after its inputs. An F needs its
        RECV_F or the previous stage's F; a B or I its own F, and its RECV_B or the next
        stage's B or I; a W its I. Without comms an input on another rank counts as there."""
        plan, one_stage = self.program.plan, 8 * self.program.mb_stride
        k, index = self.ids[chosen], self.index[chosen]
        rank = self.program.arrays.ranks[chosen]
        code, stage = k & 7, k // one_stage
        if not len(k):
            return True
        holder = np.array([*plan.placement, -2, -2])  # by stage, -2 past the last one
        if code[0] == CODE_F:
            ok = (stage == 0) | self.before(k + CODE_RECV_F, rank, index)
            ok |= self.before(k - one_stage, rank, index)
            if not self.comms:
                ok |= holder[np.clip(stage - 1, -1, plan.num_stages)] != rank
            return bool(ok.all())
        own = k - 1 if code[0] == CODE_W else k - code  # the I a W needs, the F a B or I needs
        at = own + one_stage
        if ((self.on_rank[at] == rank) & (self.at_index[at] >= index)).any():
            return False
        if code[0] == CODE_W:
            return True
        base = k - code
        grad = (stage == plan.num_stages - 1) | self.before(base + CODE_RECV_B, rank, index)
        grad |= self.before(base + one_stage + CODE_B, rank, index)
        grad |= self.before(base + one_stage + CODE_I, rank, index)
        if not self.comms:
            grad |= holder[np.clip(stage + 1, 0, plan.num_stages)] != rank
        return bool(grad.all())

    def sends_ok(self, chosen: np.ndarray) -> bool:
        """SEND steps (``chosen``): a SEND_F after its F, a SEND_B after its B or I."""
        k, index = self.ids[chosen], self.index[chosen]
        rank = self.program.arrays.ranks[chosen]
        base = k - (k & 7)
        ok = np.where(
            (k & 7) == CODE_SEND_F,
            self.before(base + CODE_F, rank, index),
            self.before(base + CODE_B, rank, index) | self.before(base + CODE_I, rank, index),
        )
        return bool(ok.all())


def _dependency(program: Program, rank: int, index: int, step_id: int, need: str) -> Finding:
    """The finding for a step that ran before what it needs (built only on failure)."""
    one_stage = 8 * program.mb_stride
    s, m, code = step_id // one_stage, (step_id >> 3) % program.mb_stride, step_id & 7
    what = _NEEDS[need].format(s=s, m=m, p=s - 1, n=s + 1, r=rank)
    return Finding(
        "send_before_compute" if need.startswith("send") else need,
        "error",
        f"rank {rank}: {s}{_KIND_NAMES[code]}{m} {what}",
        (rank,),
        (_ref(program, rank, index),),
    )


def _check_swaps(program: Program) -> list[Finding]:
    """The activation swap groups (`verify_swap`), when the plan has swap steps."""
    from .swap import has_swap_steps

    if not has_swap_steps(program):
        return []
    from .verify_swap import check_swaps  # it imports this module's Finding

    return check_swaps(program.plan)


def _check_coverage(program: Program, checked: Checked) -> list[Finding]:
    """Exactly one F and one B (or one I plus one W) per (stage, micro-batch), by counting."""
    if _covered_once(program, checked):
        return []
    counts: Counter[int] = Counter()
    for ids, leaves in checked:  # -1 & 7 is 7: skipped ids never count
        counts.update([k for k in chain(ids, (k for _, k in leaves)) if k & 7 <= CODE_W])
    dups = sorted(k for k, n in counts.items() if n > 1)
    cases = _coverage_cases(program, counts)
    wanted = set(dups) | {
        (base << 3) + c for _, bases, _, codes in cases for base in bases for c in codes
    }
    where = program.locate(checked, wanted) if wanted else {}
    findings = [_duplicate(program, k, counts[k], where[k]) for k in dups]
    for kind, bases, text, codes in cases:
        for base in sorted(bases):
            s, m = divmod(base, program.mb_stride)
            refs = [_ref(program, r, x) for c in codes for r, x in where.get((base << 3) + c, ())]
            findings.append(
                Finding(
                    kind,
                    "error",
                    f"stage {s} micro-batch {m} " + text.format(s=s, m=m),
                    tuple(sorted({ref.rank for ref in refs})),
                    tuple(refs),
                )
            )
    return findings


def _coverage_cases(
    program: Program, counts: Counter[int]
) -> list[tuple[str, set[int], str, tuple[int, ...]]]:
    """(finding kind, the (stage, micro-batch) keys it holds for, its text, the step codes
    whose places it lists) of each way a (stage, micro-batch) is not covered once."""
    plan, stride = program.plan, program.mb_stride
    f, b, i, w = ({k >> 3 for k in counts if k & 7 == code} for code in range(4))
    every = {s * stride + m for s in range(plan.num_stages) for m in range(plan.num_microbatches)}
    return [
        ("missing_step", every - f, "has no forward ({s}F{m})", ()),
        (
            "missing_step",
            every - b - i - w,
            "has no backward ({s}B{m}, or {s}I{m} plus {s}W{m})",
            (CODE_F,),
        ),
        (
            "conflicting_backward",
            b & (i | w),
            "has both a full backward ({s}B{m}) and a split one ({s}I{m}/{s}W{m})",
            (CODE_B, CODE_I, CODE_W),
        ),
        ("missing_step", i - w - b, "has {s}I{m} but no {s}W{m}", (CODE_I,)),
        ("missing_step", w - i - b, "has {s}W{m} but no {s}I{m}", (CODE_W,)),
    ]


def _duplicate(program: Program, k: int, count: int, places: list) -> Finding:
    """The step of key ``k`` appears ``count`` times, at ``places``."""
    stride = program.mb_stride
    s, m, letter = k // (8 * stride), (k >> 3) % stride, _KIND_NAMES[k & 7]
    refs = [_ref(program, r, x) for r, x in places]
    return Finding(
        "duplicate_step",
        "error",
        f"{s}{letter}{m} appears {count} times: "
        + ", ".join(f"rank {ref.rank} position {ref.position}" for ref in refs),
        tuple(sorted({ref.rank for ref in refs})),
        tuple(refs),
    )


def _check_tied(program: Program) -> list[Finding]:
    """With a TIED_REDUCE anywhere, the first and the last stage each have exactly one, on
    their own rank, after every step of that stage there (its gradients are complete); no
    other stage has one. A reduction on one side only would wait for its partner forever."""
    plan = program.plan
    found = _tied_reduces(program)
    if not found:
        return []
    tied = {0, plan.num_stages - 1}
    problems = [
        (f"stage {stage} holds no tied parameter: only stages {sorted(tied)} do", where)
        for stage, where in found.items()
        if stage not in tied
    ]
    for stage in sorted(tied):
        where = found.get(stage, [])
        owner = plan.placement[stage]
        if len(where) != 1 or where[0][0] != owner:
            problems.append((f"stage {stage} needs one {stage}TIED_REDUCE on rank {owner}", where))
        elif _later_step_of(program, owner, stage, where[0][1]):
            problems.append((f"{stage}TIED_REDUCE comes before stage {stage}'s last step", where))
        elif len(set(map(plan.placement.__getitem__, tied))) > 1 and _later_message(
            program, owner, where[0][1]
        ):  # an exchange with the other rank: a message after it may be what that one awaits
            problems.append(
                (
                    f"{stage}TIED_REDUCE comes before a message of rank {owner} (it exchanges "
                    "gradients with the other tied stage's rank, which may wait for that message)",
                    where,
                )
            )
    return [
        Finding(
            "tied_reduce",
            "error",
            message,
            tuple(sorted({rank for rank, _ in where})),
            tuple(_ref(program, rank, index) for rank, index in where),
        )
        for message, where in problems
    ]


def _tied_reduces(program: Program) -> dict[int, list[tuple[int, int]]]:
    """Stage -> (rank, index) of each TIED_REDUCE, in plan order. A collective step has
    id -1 (no simple id), so only those steps are read: a plan without any reads none."""
    found: dict[int, list[tuple[int, int]]] = {}
    candidates = np.flatnonzero(program.arrays.ids == -1)
    if not candidates.size:
        return found
    starts = list(accumulate(map(len, program.ids), initial=0))
    for at, rank in zip(candidates.tolist(), program.arrays.ranks[candidates].tolist()):
        index = at - starts[rank]
        step = program.steps[rank][index]
        if step.kind is StepKind.TIED_REDUCE:
            found.setdefault(step.stage, []).append((rank, index))  # type: ignore[arg-type]
    return found


def _later_step_of(program: Program, rank: int, stage: int, index: int) -> bool:
    """Whether a compute step of ``stage`` follows position ``index`` on ``rank``."""
    return any(
        leaf.stage == stage and leaf.kind in COMPUTE_KINDS
        for step in program.steps[rank][index + 1 :]
        for leaf in step.leaves()
    )


def _later_message(program: Program, rank: int, index: int) -> bool:
    """Whether a SEND or RECV follows position ``index`` on ``rank``."""
    return any(step.kind in COMM_KINDS for step in program.steps[rank][index + 1 :])


def _covered_once(program: Program, checked: Checked) -> bool:
    """Whether every (stage, micro-batch) has one F and either one B or one I and one W,
    and nothing else: what `_check_coverage` finds for nearly every plan, decided by
    counting ids in an array. False when the plan has composite steps or out-of-range
    indices (then the checked ids differ from the compiled ones) or anything is missing."""
    plan, arrays = program.plan, program.arrays
    if (
        program.mb_stride != plan.num_microbatches
        or arrays.ids.dtype == object
        or any(
            leaves or ids is not compiled for (ids, leaves), compiled in zip(checked, program.ids)
        )
    ):
        return False
    ids = arrays.ids[(arrays.ids >= 0) & ((arrays.ids & 7) <= CODE_W)]
    size = plan.num_stages * program.mb_stride
    counts = np.bincount(ids, minlength=size * 8).reshape(size, 8)
    f, b, i, w = (counts[:, code] for code in (CODE_F, CODE_B, CODE_I, CODE_W))
    split = (b == 0) & (i == 1) & (w == 1)
    full = (b == 1) & (i == 0) & (w == 0)
    return bool(counts.max(initial=0) <= 1 and (f == 1).all() and (full | split).all())


# ---------------------------------------------------------------------------------------
# Communication pairing and channel order
# ---------------------------------------------------------------------------------------


def _check_comms(program: Program, semantics: str) -> list[Finding]:
    """Every SEND has its RECV on the peer and vice versa, in the same order per channel.

    Messages are compared by id (see ``Program.comm_refs``), which names the destination
    rank, so a recv on a rank other than the one its sender targets counts as missing.
    """
    findings = [
        finding
        for rank, peers in enumerate(program.peers)
        if NO_PEER in peers
        for finding in _unknown_peers(program, rank)
    ]
    if _comms_in_order(program):
        return findings
    per_message = program.plan.num_ranks + 1
    messages: tuple[list[int], list[int]] = ([], [])  # every send's and recv's message id
    lanes: tuple[dict, dict] = ({}, {})  # (src, dst, direction) -> message ids in order
    for rank, (keys, peers) in enumerate(zip(program.keys, program.peers)):
        comm = [(k, p) for k, p in zip(keys, peers) if p >= 0]  # with a rank at the other end
        for side in (0, 1):
            chosen = [(k >> 1, p) for k, p in comm if k & 1 == side]
            ids = [m * per_message + (p if side == 0 else rank) for m, p in chosen]
            codes = [p * 2 + (m & 1) for m, p in chosen]  # peer and direction (1: gradients)
            messages[side].extend(ids)
            for code in set(codes):
                peer, direction = divmod(code, 2)
                lane = (rank, peer, direction) if side == 0 else (peer, rank, direction)
                lanes[side][lane] = [m for m, c in zip(ids, codes) if c == code]
    unique = set(messages[0])
    if not (len(unique) == len(messages[0]) == len(messages[1]) and unique == set(messages[1])):
        findings.extend(_pairing_findings(program, *map(Counter, messages)))
    for lane, order in lanes[0].items():
        other = lanes[1].get(lane, [])
        if order != other:
            finding = _channel_order(program, lane, order, other)
            if finding is not None:
                finding.severity = "warning" if semantics == "eager" else "error"
                findings.append(finding)
    return findings


def _comms_in_order(program: Program) -> bool:
    """Whether every message has exactly one send and one recv and every channel receives
    in the order it sends: what `_check_comms` finds for nearly every plan, decided with
    array sorts. Only when this is False do the per-rank lists name what is wrong.

    Messages and channels are those of `_check_comms`: a message id names the destination
    rank, a channel is (source rank, destination rank, direction). Sorting each side stably
    by channel keeps every channel's messages in its rank's order.
    """
    arrays = program.arrays
    if arrays.keys.dtype == object:
        return False  # indices beyond int64: leave it to the exact lists
    comm = arrays.peers >= 0  # a SEND or RECV with a rank at the other end
    keys, peers, ranks = arrays.keys[comm], arrays.peers[comm], arrays.ranks[comm]
    recv = (keys & 1) == 1
    num_ranks = program.plan.num_ranks
    message = keys >> 1
    ident = message * (num_ranks + 1) + np.where(recv, ranks, peers)
    lane = (np.where(recv, peers, ranks) * num_ranks + np.where(recv, ranks, peers)) * 2 + (
        message & 1
    )
    sides = []
    for chosen in (~recv, recv):
        order = np.argsort(lane[chosen], kind="stable")
        sides.append((lane[chosen][order], ident[chosen][order]))
    (send_lanes, sent), (recv_lanes, received) = sides
    if len(sent) != len(received):
        return False
    return bool(
        (_all_distinct(message[~recv]) or _all_distinct(sent))  # messages sent once each
        and np.array_equal(send_lanes, recv_lanes)
        and np.array_equal(sent, received)
    )


def _all_distinct(values: np.ndarray) -> bool:
    """Whether no value repeats: counted when the values are small non-negative ints (a
    lowered plan's sent messages: ~4x faster than a sort at ~1e5 of them), else sorted."""
    if len(values) and values.min() >= 0 and values.max() < 8 * len(values) + 1024:
        return int(np.bincount(values).max()) <= 1
    once = np.sort(values)
    return bool((once[1:] != once[:-1]).all())


def _unknown_peers(program: Program, rank: int) -> list[Finding]:
    findings = []
    for index, (key, peer) in enumerate(zip(program.keys[rank], program.peers[rank])):
        if key >= 0 and peer == NO_PEER:
            step = program.steps[rank][index]
            findings.append(
                Finding(
                    "unknown_peer",
                    "error",
                    f"rank {rank}: {format_step(step)} pairs with {counterpart(step)}, but that "
                    "stage does not exist or has no rank",
                    (rank,),
                    (_ref(program, rank, index),),
                )
            )
    return findings


def _pairing_findings(program: Program, sent: Counter, received: Counter) -> list[Finding]:
    bad = {m for m in sent.keys() | received.keys() if sent[m] != received[m] or sent[m] > 1}
    where = program.comm_refs(bad)
    findings = []
    for message in sorted(bad):
        for side, count, other, kind in (
            (0, sent[message], received[message], "missing_recv"),
            (1, received[message], sent[message], "missing_send"),
        ):
            refs = where.get((side, message), [])
            if count > 1:
                findings.append(
                    Finding(
                        "duplicate_step",
                        "error",
                        f"{_ref(program, *refs[0]).text} appears {count} times",
                        tuple(sorted({r for r, _ in refs})),
                        tuple(_ref(program, *ref) for ref in refs),
                    )
                )
            for rank, index in refs[other:]:
                step = program.steps[rank][index]
                peer = program.peers[rank][index]
                findings.append(
                    Finding(
                        kind,
                        "error",
                        f"rank {rank}: {format_step(step)} has no matching "
                        f"{counterpart(step)} on rank {peer}",
                        (rank, peer),
                        (_ref(program, rank, index),),
                    )
                )
    return findings


def _channel_order(
    program: Program, lane: tuple[int, int, int], order: list[int], other: list[int]
) -> Finding | None:
    """One finding per channel whose recv order differs from its send order."""
    common = set(order) & set(other)
    sent = [k for k in order if k in common]
    received = [k for k in other if k in common]
    j = next((j for j, (a, b) in enumerate(zip(sent, received)) if a != b), None)
    if j is None:
        return None  # only unpaired or duplicated messages differ: the pairing findings say so
    src, dst, direction = lane
    first, overtaker = sent[j], received[j]
    where = program.comm_refs({first, overtaker})
    refs = tuple(
        _ref(program, *where[(side, message)][0])
        for side, message in ((0, first), (0, overtaker), (1, overtaker), (1, first))
    )
    crossed = sum(a != b for a, b in zip(sent, received))
    what = "gradients" if direction else "activations"
    return Finding(
        "channel_order",
        "error",
        f"channel rank {src} -> rank {dst} ({what}): rank {src} sends {refs[0].text} before "
        f"{refs[1].text}, but rank {dst} receives {refs[2].text} before {refs[3].text} "
        f"({crossed} of {len(sent)} messages out of place); blocking or untagged P2P would "
        "hang or pair them wrongly",
        (src, dst),
        refs,
    )


# ---------------------------------------------------------------------------------------
# Execution: fifo mix-ups, blocked ranks and the wait-for cycle
# ---------------------------------------------------------------------------------------


def _check_execution(report: VerifyReport, outcome: Outcome) -> None:
    program = outcome.program
    for send_rank, send_index, recv_rank, recv_index in outcome.mismatches:
        send = _ref(program, send_rank, send_index)
        recv = _ref(program, recv_rank, recv_index)
        report.findings.append(
            Finding(
                "fifo_mismatch",
                "error",
                f"untagged matching pairs rank {send_rank}'s {send.text} with rank {recv_rank}'s "
                f"{recv.text}: messages between two ranks are received in the order they were "
                f"sent, so {recv.text} would receive what {send.text} carries",
                (send_rank, recv_rank),
                (send, recv),
            )
        )
    stuck = outcome.blocked()
    report.blocked = {}
    for rank in sorted(stuck):
        peer = outcome.waits_for(rank)
        state = "missing" if peer is None else "blocked" if peer in stuck else "finished"
        ref = _ref(program, rank, stuck[rank])
        report.blocked[rank] = BlockedRank(rank, ref.position, ref.text, peer, state)
    for stall in stalls(outcome):
        if stall.kind == "deadlock" and report.cycle is None:
            report.cycle = stall.chain
        report.findings.append(
            Finding(
                stall.kind,
                "error",
                stall.message,
                tuple(stall.ranks),
                tuple(_ref(program, r, stuck[r]) for r in stall.ranks),
            )
        )
