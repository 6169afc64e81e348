"""The verifier's and the simulator's answers on random plans equal those of the
implementation before the array rewrite (issue 17), digest for digest.

Why golden digests rather than the old code itself: the old implementation is the whole
schedule package (executor, checks, lowering, builders), so keeping a frozen copy would
keep ~2,000 lines twice, and loading it from git needs the history in every checkout. So
the old code answered once, on a fixed list of plans made by `random_plans` from seeded
generators (not hypothesis: its examples change between versions, and golden answers need
the same plans every time). `differential_golden.json` holds one short digest per plan of
everything both tools say about it: `verify(...).to_json()` and `simulate(...).to_json()`
with the timeline under each semantics, or the error either raises. Regenerate it (only
with the old implementation on the path, and say so in the commit) with:

    PYTHONPATH=<old tree> python tests/schedule/test_differential.py

Regenerated once since, on purpose (commit "verify: a compute-only plan whose ranks wait on
each other forever is a deadlock error"): 33 plans changed only in that verdict and in the
error class simulate raises for them (`CannotFinish`, a `ScheduleError`), checked by mapping
both back and matching every old digest.

The plans are built-in schedules, compute-only or with messages and FSDP steps, broken by
a few random edits: steps swapped, dropped, duplicated, moved to another rank, renumbered
(indices out of range too), bubbles added, placements permuted. Some plans are also edited
in place after a first verification, so a reused compiled plan would be caught.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

from pipetrace.schedule.builders import SCHEDULE_NAMES, build_plan
from pipetrace.schedule.ir import Plan, ScheduleError, Step
from pipetrace.schedule.simulate import Costs, simulate
from pipetrace.schedule.verify import SEMANTICS, verify

GOLDEN = Path(__file__).with_name("differential_golden.json")
NUM_PLANS = 240
COSTS = Costs(F=1.0, B=2.5, I=1.0, W=0.5, comm=0.25, per_stage={(1, "F"): 1.5})


def _built(rng: random.Random) -> Plan:
    """A small built-in plan with random sizes (retrying sizes a schedule refuses)."""
    while True:
        name = rng.choice(SCHEDULE_NAMES)
        ranks = rng.randint(1, 4)
        v = {"zbv": 2, "dualpipev": 2, "gpipe": 1, "1f1b": 1}.get(name, rng.randint(1, 3))
        try:
            return build_plan(
                name,
                num_ranks=ranks,
                num_microbatches=rng.randint(1, 3 * ranks * v),
                stages_per_rank=v,
                comms=rng.random() < 0.6,
                fsdp=rng.random() < 0.2,
            )
        except ScheduleError:
            continue


def _renumbered(rng: random.Random, step: Step, plan: Plan) -> Step:
    if step.sub_steps or step.microbatch is None:
        return step
    if rng.random() < 0.5:
        return Step(step.kind, step.stage, rng.randint(0, plan.num_microbatches + 1))
    return Step(step.kind, rng.randint(0, plan.num_stages), step.microbatch)


def _edit(rng: random.Random, plan: Plan) -> None:
    """One random edit of ``plan``, in place."""
    rows = plan.ranks
    rank = rng.randrange(len(rows))
    row = rows[rank]
    if not row:
        return
    i = rng.randrange(len(row))
    edit = rng.randrange(7)
    if edit == 0 and i + 1 < len(row):
        row[i], row[i + 1] = row[i + 1], row[i]
    elif edit == 1:
        del row[i]
    elif edit == 2:
        rows[rng.randrange(len(rows))].insert(rng.randrange(len(row) + 1), row[i])
    elif edit == 3 and row[i] is not None:
        row[i] = _renumbered(rng, row[i], plan)
    elif edit == 4:
        step = row.pop(i)
        other = rows[rng.randrange(len(rows))]
        other.insert(rng.randrange(len(other) + 1), step)
    elif edit == 5:
        row.insert(i, None)
    elif edit == 6 and plan.num_stages > 1:
        placement = list(plan.placement)
        a, b = rng.sample(range(len(placement)), 2)
        placement[a], placement[b] = placement[b], placement[a]
        plan.placement = tuple(placement)


def random_plans() -> list[tuple[Plan, list[int]]]:
    """The fixed list of plans: each with the edits to apply after a first verification."""
    cases = []
    for seed in range(NUM_PLANS):
        rng = random.Random(seed)
        plan = _built(rng)
        for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
            _edit(rng, plan)
        later = [rng.randrange(1 << 30) for _ in range(rng.choice((0, 0, 0, 1)))]
        cases.append((plan, later))
    return cases


def _answer(action: Callable[[], object]) -> object:
    try:
        return action()
    except Exception as exc:  # which error, and its text, is the answer
        return {"error": type(exc).__name__, "message": str(exc)}


def answers(plan: Plan, later: list[int]) -> str:
    """A digest of what verify and simulate say about ``plan`` under every semantics, and
    again after each of the ``later`` edits (seeds), made in place."""
    said = []
    for seed in [None, *later]:
        if seed is not None:
            _edit(random.Random(seed), plan)
        for semantics in SEMANTICS:
            said.append(_answer(lambda s=semantics: verify(plan, semantics=s).to_json()))
            said.append(
                _answer(
                    lambda s=semantics: simulate(plan, COSTS, semantics=s).to_json(timeline=True)
                )
            )
    text = json.dumps(said, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def test_verify_and_simulate_answer_as_before_on_random_plans() -> None:
    golden = json.loads(GOLDEN.read_text())
    assert len(golden) == NUM_PLANS
    differ = [
        seed
        for seed, (plan, later) in enumerate(random_plans())
        if answers(plan, later) != golden[seed]
    ]
    assert differ == [], f"plans (by seed) answered differently from before: {differ}"


def test_random_plans_reach_the_checks_that_fail() -> None:
    """The fixed plans are varied enough to matter: clean and broken ones, deadlocks."""
    kinds: set[str] = set()
    ok = 0
    for plan, _ in random_plans():
        report = _answer(lambda plan=plan: verify(plan, semantics="fifo"))
        if isinstance(report, dict):
            continue
        ok += report.ok
        kinds |= {finding.kind for finding in report.findings}
    assert NUM_PLANS // 10 < ok < NUM_PLANS - NUM_PLANS // 10
    assert {"missing_step", "duplicate_step", "deadlock"} <= kinds, kinds


if __name__ == "__main__":
    digests = [answers(plan, later) for plan, later in random_plans()]
    GOLDEN.write_text(json.dumps(digests, indent=0) + "\n")
    print(f"wrote {len(digests)} digests to {GOLDEN}", file=sys.stderr)
