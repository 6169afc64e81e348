"""Lowering: messages that match, plans that run under every P2P semantics, FSDP steps, errors."""

from __future__ import annotations

import random
from collections import Counter, defaultdict, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from schedule_cases import V_CHOICES

from pipetrace.schedule.builders import SCHEDULE_NAMES, build_compute_plan, build_plan
from pipetrace.schedule.csvio import parse_csv_text
from pipetrace.schedule.ir import (
    B,
    F,
    I,
    Plan,
    ScheduleError,
    Step,
    StepKind,
    W,
    format_step,
    infer_placement,
)
from pipetrace.schedule.lowering import add_fsdp_steps, layout_bubbles, lower

SEMANTICS = ("eager", "rendezvous", "fifo")


def valid_sizes(name: str, p: int) -> list[tuple[int, int]]:
    out = []
    for v in V_CHOICES[name]:
        for m in sorted({1, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p} - {0}):
            rounds = max(1, m // p)
            if (name == "interleaved-1f1b" or (name == "zb1p" and v > 1)) and m % rounds:
                continue
            if name == "dualpipev" and m < 2 * p:
                continue
            out.append((m, v))
    return out


# ---------------------------------------------------------------------------------------
# A tiny executor, independent of the real verifier
# ---------------------------------------------------------------------------------------


def message_of(step: Step, rank: int, placement: tuple[int, ...]) -> tuple[int, int, tuple]:
    """(sender, receiver, identity) of a comm step; both halves of a message share identity."""
    s, mb = step.stage, step.microbatch
    assert s is not None and mb is not None
    if step.kind is StepKind.SEND_F:
        return rank, placement[s + 1], ("F", s, mb)
    if step.kind is StepKind.RECV_F:
        return placement[s - 1], rank, ("F", s - 1, mb)
    if step.kind is StepKind.SEND_B:
        return rank, placement[s - 1], ("B", s, mb)
    return placement[s + 1], rank, ("B", s + 1, mb)


def leaf_needs(leaf: Step, last: int) -> list[tuple[str, int, int]]:
    s, mb = leaf.stage, leaf.microbatch
    assert s is not None and mb is not None
    if leaf.kind is StepKind.F:
        return [("act", s - 1, mb)] if s else []
    if leaf.kind is StepKind.W:
        return [("grad", s, mb)]
    return [("act", s, mb)] + ([("grad", s + 1, mb)] if s < last else [])


def execute(plan: Plan, semantics: str) -> None:
    """Run a lowered plan step by step; fail on a deadlock, a missing input or a mismatch.

    Data lives per rank: a compute step needs its inputs on its own rank, put there by an
    earlier local step or a receive. eager: sends never block; rendezvous: a send and the
    receive with the same identity complete together; fifo: like rendezvous, but the send
    pairs with whatever receive from the same sender the peer has reached.
    """
    placement, last = plan.placement, plan.num_stages - 1
    rows = [plan.steps(r) for r in range(plan.num_ranks)]
    has_fsdp = any(s.kind is StepKind.UNSHARD for row in rows for s in row)
    pos = [0] * len(rows)
    data: list[set[tuple[str, int, int]]] = [set() for _ in rows]
    unsharded: list[set[int]] = [set() for _ in rows]
    mailbox: dict[tuple[int, int], deque[tuple]] = defaultdict(deque)

    def produce(rank: int, leaf: Step) -> None:
        tag = "act" if leaf.kind is StepKind.F else "grad" if leaf.kind is not StepKind.W else "w"
        data[rank].add((tag, leaf.stage, leaf.microbatch))  # type: ignore[arg-type]

    def run_local(rank: int, step: Step) -> None:
        if step.kind is StepKind.UNSHARD:
            unsharded[rank].add(step.stage)  # type: ignore[arg-type]
            return
        if step.kind is StepKind.RESHARD:
            unsharded[rank].discard(step.stage)  # type: ignore[arg-type]
            return
        if step.kind is StepKind.REDUCE_GRAD:
            assert step.stage in unsharded[rank], f"rank {rank}: {step} while resharded"
            return
        for leaf in step.leaves():
            for need in leaf_needs(leaf, last):
                assert need in data[rank], f"rank {rank}: {format_step(step)} runs without {need}"
            if has_fsdp:
                assert leaf.stage in unsharded[rank], f"rank {rank}: {step} while resharded"
        for leaf in step.leaves():
            produce(rank, leaf)

    def deliver(receiver: int, ident: tuple) -> None:
        kind, s, mb = ident
        data[receiver].add(("act" if kind == "F" else "grad", s, mb))

    def send_has_data(rank: int, ident: tuple) -> None:
        kind, s, mb = ident
        assert ("act" if kind == "F" else "grad", s, mb) in data[rank], (
            f"rank {rank} sends {ident} before computing it"
        )

    def advance(rank: int) -> bool:
        step = rows[rank][pos[rank]]
        if not step.is_comm:
            run_local(rank, step)
            return True
        sender, receiver, ident = message_of(step, rank, placement)
        if semantics == "eager":
            if step.kind in (StepKind.SEND_F, StepKind.SEND_B):
                send_has_data(rank, ident)
                mailbox[(sender, receiver)].append(ident)
                return True
            if ident in mailbox[(sender, receiver)]:
                mailbox[(sender, receiver)].remove(ident)
                deliver(receiver, ident)
                return True
            return False
        if step.kind not in (StepKind.SEND_F, StepKind.SEND_B):
            return False  # a receive completes together with its send, below
        peer_pos = pos[receiver]
        if peer_pos >= len(rows[receiver]):
            return False
        peer_step = rows[receiver][peer_pos]
        if not peer_step.is_comm or peer_step.kind in (StepKind.SEND_F, StepKind.SEND_B):
            return False
        peer_sender, _, peer_ident = message_of(peer_step, receiver, placement)
        if peer_sender != sender:
            return False
        if semantics == "rendezvous" and peer_ident != ident:
            return False
        assert peer_ident == ident, (
            f"fifo mismatch: rank {sender} sends {ident}, rank {receiver} expects {peer_ident}"
        )
        send_has_data(rank, ident)
        deliver(receiver, ident)
        pos[receiver] += 1
        return True

    progress = True
    while progress:
        progress = False
        for rank in range(len(rows)):
            while pos[rank] < len(rows[rank]) and advance(rank):
                pos[rank] += 1
                progress = True
    stuck = {r: format_step(rows[r][pos[r]]) for r in range(len(rows)) if pos[r] < len(rows[r])}
    assert not stuck, f"{plan.name} deadlocks under {semantics}: {stuck}"
    assert all(not q for q in mailbox.values()), "messages never received"


def check_messages(compute: Plan, lowered: Plan) -> None:
    """Same compute order per rank; one send and one receive per cross-rank edge, paired in
    the same order on both sides of every (sender, receiver, kind) channel."""
    placement, last = compute.placement, compute.num_stages - 1
    expected: Counter[tuple] = Counter()
    for rank in range(compute.num_ranks):
        for step in compute.steps(rank):
            for leaf in step.leaves():
                s, mb = leaf.stage, leaf.microbatch
                if leaf.kind is StepKind.F and s < last and placement[s + 1] != rank:
                    expected[(rank, placement[s + 1], ("F", s, mb))] += 1
                if leaf.kind in (StepKind.B, StepKind.I) and s > 0 and placement[s - 1] != rank:
                    expected[(rank, placement[s - 1], ("B", s, mb))] += 1
    sends: dict[tuple[int, int, str], list[tuple]] = defaultdict(list)
    recvs: dict[tuple[int, int, str], list[tuple]] = defaultdict(list)
    for rank in range(lowered.num_ranks):
        steps = lowered.steps(rank)
        assert [s for s in steps if not s.is_comm] == compute.steps(rank)
        for step in steps:
            if step.is_comm:
                sender, receiver, ident = message_of(step, rank, placement)
                is_send = step.kind in (StepKind.SEND_F, StepKind.SEND_B)
                (sends if is_send else recvs)[(sender, receiver, ident[0])].append(ident)
    got = Counter((snd, rcv, ident) for (snd, rcv, _), idents in sends.items() for ident in idents)
    assert got == expected
    assert sends == recvs


# ---------------------------------------------------------------------------------------
# Built-in schedules, lowered
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_lowered_builtins_match_and_run(name: str, p: int) -> None:
    for m, v in valid_sizes(name, p):
        compute = build_plan(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)
        lowered = build_plan(name, num_ranks=p, num_microbatches=m, stages_per_rank=v, comms=True)
        assert lowered.name == name and lowered.params == compute.params
        assert all(s is not None for row in lowered.ranks for s in row), (
            "lowered plans have no bubbles"
        )
        check_messages(compute.without_bubbles(), lowered)
        for semantics in SEMANTICS:
            execute(lowered, semantics)


def test_executor_catches_a_deadlock() -> None:
    """The test's own executor must be able to fail: swap two receives on one rank."""
    lowered = build_plan("1f1b", num_ranks=2, num_microbatches=3, comms=True)
    row = lowered.ranks[1]
    recvs = [i for i, s in enumerate(row) if s is not None and s.kind is StepKind.RECV_F]
    row[recvs[0]], row[recvs[1]] = row[recvs[1]], row[recvs[0]]
    with pytest.raises(AssertionError, match="deadlocks under rendezvous"):
        execute(lowered, "rendezvous")
    with pytest.raises(AssertionError, match="fifo mismatch"):
        execute(lowered, "fifo")


def test_1f1b_lowered_by_hand() -> None:
    """P=2, M=2 with F=1, B=2: every message is posted right when its data exists."""
    lowered = build_plan("1f1b", num_ranks=2, num_microbatches=2, comms=True)
    assert [format_step(s) for s in lowered.ranks[0]] == (
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"]
    )
    assert [format_step(s) for s in lowered.ranks[1]] == (
        ["1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"]
    )


def test_overlap_composites_receive_before_and_send_after() -> None:
    lowered = build_plan("dualpipev", num_ranks=3, num_microbatches=7, comms=True)
    placement = lowered.placement
    seen = 0
    for rank in range(lowered.num_ranks):
        steps = [format_step(s) for s in lowered.steps(rank)]
        for index, step in enumerate(lowered.steps(rank)):
            if not step.sub_steps:
                continue
            fwd, bwd = step.sub_steps
            if fwd.stage > 0 and placement[fwd.stage - 1] != rank:
                assert steps.index(f"{fwd.stage}RECV_F{fwd.microbatch}") < index
            if fwd.stage < lowered.num_stages - 1 and placement[fwd.stage + 1] != rank:
                assert steps.index(f"{fwd.stage}SEND_F{fwd.microbatch}") > index
            if bwd.stage > 0 and placement[bwd.stage - 1] != rank:
                assert steps.index(f"{bwd.stage}SEND_B{bwd.microbatch}") > index
            seen += 1
    assert seen > 0


def test_single_rank_plan_has_no_comms() -> None:
    compute = build_compute_plan(
        "interleaved-1f1b", num_ranks=1, num_microbatches=4, stages_per_rank=3
    )
    lowered = lower(compute)
    assert not lowered.has_comms()
    assert lowered.steps(0) == compute.steps(0)
    execute(lowered, "rendezvous")


def test_lower_ignores_bubbles_and_keeps_name() -> None:
    compute = build_compute_plan("gpipe", num_ranks=3, num_microbatches=4)
    assert lower(compute).ranks == lower(compute.without_bubbles()).ranks
    assert lower(compute).name == "gpipe"


@pytest.mark.timeout(60)
def test_large_plan_has_every_step() -> None:
    """P=64, V=2, M=512 interleaved (~400k steps): how fast it builds is measured by
    bench/bench_schedule.py, not asserted here (no timed tests)."""
    plan = build_plan(
        "interleaved-1f1b", num_ranks=64, num_microbatches=512, stages_per_rank=2, comms=True
    )
    assert sum(len(row) for row in plan.ranks) == 391168


# ---------------------------------------------------------------------------------------
# Arbitrary compute plans (as from a CSV)
# ---------------------------------------------------------------------------------------


def random_compute_plan(seed: int) -> Plan:
    """A random executable compute plan: a random topological order of all work, split by a
    random placement, with random I/W splits and random OVERLAP_F_B pairs."""
    rng = random.Random(seed)
    num_ranks = rng.randint(1, 4)
    num_stages = rng.randint(1, 7)
    num_mbs = rng.randint(1, 5)
    drawn = [rng.randrange(num_ranks) for _ in range(num_stages)]
    renumber = {r: i for i, r in enumerate(dict.fromkeys(drawn))}  # every rank holds a stage
    placement = [renumber[r] for r in drawn]
    num_ranks = len(renumber)
    split = {(s, m): rng.random() < 0.4 for s in range(num_stages) for m in range(num_mbs)}
    last = num_stages - 1
    deps: dict[Step, list[Step]] = {}
    for s in range(num_stages):
        for m in range(num_mbs):
            deps[F(s, m)] = [F(s - 1, m)] if s else []
            back_needs = [F(s, m)] + (
                [I(s + 1, m) if split[(s + 1, m)] else B(s + 1, m)] if s < last else []
            )
            if split[(s, m)]:
                deps[I(s, m)] = back_needs
                deps[W(s, m)] = [I(s, m)]
            else:
                deps[B(s, m)] = back_needs
    done: dict[Step, int] = {}  # step -> its place in the global order
    ready = [step for step, needs in deps.items() if not needs]
    rows: list[list[Step | None]] = [[] for _ in range(num_ranks)]
    while ready:
        step = ready.pop(rng.randrange(len(ready)))
        done[step] = len(done)
        rows[placement[step.stage]].append(step)  # type: ignore[index]
        if rng.random() < 0.2:
            rows[placement[step.stage]].append(None)  # type: ignore[index]
        ready.extend(
            s
            for s, needs in deps.items()
            if s not in done and s not in ready and step in needs and all(n in done for n in needs)
        )
    # Fuse some adjacent F, B pairs into composites, only when the B's inputs all exist before
    # the F in the global order: the composite can then run where the F ran. (Fusing more
    # eagerly can deadlock, e.g. when another rank needs the F's output to make the B's input.)
    for row in rows:
        i = 0
        while i + 1 < len(row):
            a, b = row[i], row[i + 1]
            if (
                a
                and b
                and a.kind is StepKind.F
                and b.kind is StepKind.B
                and all(done[need] < done[a] for need in deps[b])
                and rng.random() < 0.5
            ):
                row[i : i + 2] = [Step(StepKind.OVERLAP_F_B, None, None, (a, b))]
            i += 1
    return Plan(num_mbs, tuple(placement), rows, name=f"random-{seed}")


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32))
def test_random_compute_plans_lower_safely(seed: int) -> None:
    compute = random_compute_plan(seed)
    laid_out = layout_bubbles(compute)
    assert [laid_out.steps(r) for r in range(compute.num_ranks)] == [
        compute.steps(r) for r in range(compute.num_ranks)
    ]
    lowered = lower(compute)
    check_messages(compute, lowered)
    for semantics in SEMANTICS:
        execute(lowered, semantics)
    execute(lower(compute, fsdp=True), "rendezvous")


# ---------------------------------------------------------------------------------------
# Plans that cannot run
# ---------------------------------------------------------------------------------------


def plan_from_csv(text: str) -> Plan:
    rows = parse_csv_text(text)
    placement = infer_placement(rows)
    mbs = [leaf.microbatch for row in rows for s in row if s for leaf in s.leaves()]
    return Plan(max(mbs) + 1, placement, rows, name="bad.csv")


def test_stuck_plan_names_each_rank_and_step() -> None:
    plan = plan_from_csv("0F0,0B0\n1B0,1F0\n")  # rank 1 runs its backward before its forward
    for make in (lower, layout_bubbles):
        with pytest.raises(ScheduleError) as info:
            make(plan)
        text = str(info.value)
        assert "rank 0" in text and "0B0" in text and "1B0 or 1I0" in text
        assert "rank 1" in text and "1F0" in text


def test_missing_step_names_what_is_waited_for() -> None:
    plan = plan_from_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1\n")  # 1B1 is missing
    with pytest.raises(ScheduleError) as info:
        lower(plan)
    text = str(info.value)
    assert "rank 0" in text and "0B1" in text and "1B1 or 1I1" in text
    assert "rank 1" not in text


def test_stuck_composite_names_its_step_and_every_missing_input() -> None:
    """A composite runs as several ops (two inputs each): the message names the composite
    by its index among the rank's steps and what it waits for, whichever op it stopped at."""
    plan = plan_from_csv(
        "0F0,0F1,(0I0;0W0;0F2)OVERLAP_B_F,(0I1;0W1;0F3)OVERLAP_B_F,0B2,0B3\n"
        "1F0,(1I0;1W0;1F1)OVERLAP_B_F,(1I1;1W1;1F2)OVERLAP_B_F,(1I2;1W2;1F3)OVERLAP_B_F,1B3\n"
    )
    del plan.ranks[0][1]  # 0F1: rank 1's first composite waits for it, rank 0's for rank 1
    for make in (lower, layout_bubbles):
        with pytest.raises(ScheduleError) as info:
            make(plan)
        assert str(info.value) == (
            "the compute plan cannot run to the end (deadlock): rank 0 waits forever at its "
            "compute step 1 ((0I0;0W0;0F2)OVERLAP_B_F) for 1B0 or 1I0; rank 1 waits forever "
            "at its compute step 1 ((1I0;1W0;1F1)OVERLAP_B_F) for 0F1"
        )


def test_lower_rejects_comms_and_misplaced_steps() -> None:
    lowered = build_plan("1f1b", num_ranks=2, num_microbatches=2, comms=True)
    with pytest.raises(ScheduleError, match="compute-only"):
        lower(lowered)
    plan = build_compute_plan("1f1b", num_ranks=2, num_microbatches=2)
    plan.ranks[0].append(F(1, 0))
    with pytest.raises(ScheduleError, match=r"rank 0.*stage 1 is placed on rank 1"):
        lower(plan)


# ---------------------------------------------------------------------------------------
# FSDP
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_fsdp_steps_wrap_each_stage(name: str) -> None:
    plan = build_plan(name, num_ranks=3, num_microbatches=6, comms=True, fsdp=True)
    for rank in range(plan.num_ranks):
        steps = plan.steps(rank)
        text = [format_step(s) for s in steps]
        for stage in plan.stages_of(rank):
            touching = [
                i
                for i, s in enumerate(steps)
                if s.is_compute or s.sub_steps
                if any(leaf.stage == stage for leaf in s.leaves())
            ]
            grads = [
                i
                for i in touching
                if any(
                    leaf.stage == stage and leaf.kind in (StepKind.B, StepKind.W)
                    for leaf in steps[i].leaves()
                )
            ]
            for kind in ("UNSHARD", "REDUCE_GRAD", "RESHARD"):
                assert text.count(f"{stage}{kind}") == 1, (name, rank, stage, kind)
            unshard = text.index(f"{stage}UNSHARD")
            assert unshard < touching[0]
            assert all(t.endswith("UNSHARD") for t in text[unshard + 1 : touching[0]])
            assert grads[-1] < text.index(f"{stage}REDUCE_GRAD") < text.index(f"{stage}RESHARD")
            assert touching[-1] < text.index(f"{stage}RESHARD")
            between = text[touching[-1] + 1 : text.index(f"{stage}RESHARD")]
            assert all(t.endswith(("REDUCE_GRAD", "RESHARD")) for t in between)
        execute(plan, "rendezvous")


def test_fsdp_on_compute_plan_keeps_bubbles() -> None:
    plan = build_plan("gpipe", num_ranks=2, num_microbatches=2, fsdp=True)
    assert [format_step(s) for s in plan.ranks[0]] == (
        ["0UNSHARD", "0F0", "0F1", "", "", "0B0", "0B1", "0REDUCE_GRAD", "0RESHARD"]
    )
    assert (
        add_fsdp_steps(build_compute_plan("gpipe", num_ranks=2, num_microbatches=2)).ranks
        == plan.ranks
    )
