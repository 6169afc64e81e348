"""The built-in schedules: parameters, completeness, hand-derived orders and torch's own orders."""

from __future__ import annotations

from collections import Counter

import pytest
from schedule_cases import V_CHOICES

from pipetrace.schedule.builders import (
    SCHEDULE_NAMES,
    ScheduleInfo,
    build_compute_plan,
    build_plan,
    describe_schedules,
    resolve_schedule_name,
)
from pipetrace.schedule.ir import (
    Placement,
    Plan,
    ScheduleError,
    Step,
    StepKind,
    format_step,
    infer_placement,
    stage_to_rank,
)


def is_valid(name: str, p: int, m: int, v: int) -> bool:
    """The parameter rules of the brief, restated independently of the builders."""
    rounds = max(1, m // p)
    if name == "interleaved-1f1b" or (name == "zb1p" and v > 1):
        return m % rounds == 0
    if name == "dualpipev":
        return m >= 2 * p
    return True


def microbatch_counts(p: int) -> list[int]:
    return sorted(set(range(1, 2 * p + 3)) | {3 * p, 4 * p})


def texts(row: list[Step | None]) -> list[str]:
    return [format_step(s) for s in row]


def rows_text(plan: Plan) -> list[list[str]]:
    return [texts(row) for row in plan.without_bubbles().ranks]


def check_complete(plan: Plan, p: int, m: int, v: int, placement: Placement) -> None:
    """Exactly one F and one B, or one I then one W, per (stage, micro-batch); stages where the
    placement puts them."""
    where = f"{plan.name} P={p} M={m} V={v}"
    assert plan.num_ranks == p, where
    assert plan.placement == stage_to_rank(placement, p, v * p), where
    assert infer_placement(plan.ranks) == plan.placement, where
    counts: Counter[tuple[StepKind, int, int]] = Counter()
    positions: dict[tuple[StepKind, int, int], tuple[int, int]] = {}
    for rank, row in enumerate(plan.ranks):
        for index, step in enumerate(row):
            if step is None:
                continue
            for leaf in step.leaves():
                assert leaf.kind in (StepKind.F, StepKind.B, StepKind.I, StepKind.W), (where, leaf)
                key = (leaf.kind, leaf.stage, leaf.microbatch)
                counts[key] += 1
                positions[key] = (rank, index)
    for stage in range(v * p):
        for mb in range(m):
            f, b, i, w = (counts.pop((k, stage, mb), 0) for k in "FBIW")
            assert f == 1, f"{where}: {f} forwards of stage {stage} mb {mb}"
            assert (b, i, w) in ((1, 0, 0), (0, 1, 1)), (
                f"{where}: stage {stage} mb {mb} has {b} B, {i} I, {w} W"
            )
            if i:
                i_at = positions[(StepKind.I, stage, mb)]
                w_at = positions[(StepKind.W, stage, mb)]
                assert i_at[0] == w_at[0] and i_at[1] < w_at[1], f"{where}: W before I {stage},{mb}"
    assert not counts, f"{where}: unexpected steps {sorted(counts)[:5]}"


def check_layout(plan: Plan) -> None:
    """Each step sits in the earliest slot its rank and its inputs allow (unit costs)."""
    end: dict[tuple[str, int, int], int] = {}
    slot_of: list[tuple[int, int, Step]] = [
        (slot, rank, step)
        for rank, row in enumerate(plan.ranks)
        for slot, step in enumerate(row)
        if step is not None
    ]
    last = plan.num_stages - 1
    for slot, _, step in slot_of:
        for leaf in step.leaves():
            tag = (
                "act" if leaf.kind is StepKind.F else "grad" if leaf.kind is not StepKind.W else "w"
            )
            end[(tag, leaf.stage, leaf.microbatch)] = slot + 1
    previous_end = [0] * plan.num_ranks
    for slot, rank, step in sorted(slot_of, key=lambda t: (t[1], t[0])):
        ready = previous_end[rank]
        for leaf in step.leaves():
            s, mb = leaf.stage, leaf.microbatch
            if leaf.kind is StepKind.F:
                needs = [("act", s - 1, mb)] if s else []
            elif leaf.kind is StepKind.W:
                needs = [("grad", s, mb)]
            else:
                needs = [("act", s, mb)] + ([("grad", s + 1, mb)] if s < last else [])
            for need in needs:
                assert need in end, (plan.name, step, need)
                ready = max(ready, end[need])
        assert slot == ready, (
            f"{plan.name}: rank {rank} {format_step(step)} at {slot}, ready at {ready}"
        )
        previous_end[rank] = slot + 1


# ---------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------


def test_describe_schedules_covers_every_name() -> None:
    infos = describe_schedules()
    assert tuple(i.name for i in infos) == SCHEDULE_NAMES
    assert all(isinstance(i, ScheduleInfo) and i.description for i in infos)
    by_name = {i.name: i for i in infos}
    assert by_name["zbv"].placement is Placement.V and by_name["zbv"].stages_per_rank == "2"
    assert by_name["interleaved-1f1b"].stages_per_rank == "1.."
    assert by_name["gpipe"].placement is Placement.LOOP and by_name["gpipe"].stages_per_rank == "1"


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("ScheduleGPipe", "gpipe"),
        ("schedule1f1b", "1f1b"),
        ("SCHEDULEINTERLEAVED1F1B", "interleaved-1f1b"),
        ("ScheduleInterleavedZeroBubble", "zb1p"),
        ("ScheduleZBVZeroBubble", "zbv"),
        ("ScheduleDualPipeV", "dualpipev"),
        ("zb-h1", "zb1p"),
        ("ZBH1", "zb1p"),
        ("interleaved", "interleaved-1f1b"),
        ("Interleaved1F1B", "interleaved-1f1b"),
        *((name, name) for name in SCHEDULE_NAMES),
    ],
)
def test_resolve_schedule_name(alias: str, canonical: str) -> None:
    assert resolve_schedule_name(alias) == canonical


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ScheduleError) as info:
        resolve_schedule_name("looped-bfs")
    for name in SCHEDULE_NAMES:
        assert name in str(info.value)
    with pytest.raises(ScheduleError):
        build_plan("nope", num_ranks=2, num_microbatches=2)


# ---------------------------------------------------------------------------------------
# Every schedule, many sizes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_valid_size_builds_complete_and_laid_out(name: str, p: int) -> None:
    placement = next(i.placement for i in describe_schedules() if i.name == name)
    built = 0
    for v in V_CHOICES[name]:
        for m in microbatch_counts(p):
            kwargs = dict(num_ranks=p, num_microbatches=m, stages_per_rank=v)
            if not is_valid(name, p, m, v):
                with pytest.raises(ScheduleError):
                    build_compute_plan(name, **kwargs)
                continue
            plan = build_compute_plan(name, **kwargs)
            assert plan.name == name
            assert plan.params == {"num_ranks": p, "num_microbatches": m, "stages_per_rank": v}
            check_complete(plan, p, m, v, placement)
            check_layout(plan)
            built += 1
    assert built > 0


def test_default_stages_per_rank() -> None:
    expected = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb1p": 1, "zbv": 2, "dualpipev": 2}
    for name, v in expected.items():
        plan = build_compute_plan(name, num_ranks=3, num_microbatches=6)
        assert plan.params["stages_per_rank"] == v
        assert plan.num_stages == 3 * v


# ---------------------------------------------------------------------------------------
# Orders derived by hand
# ---------------------------------------------------------------------------------------


def test_1f1b_two_ranks_three_microbatches() -> None:
    plan = build_compute_plan("1f1b", num_ranks=2, num_microbatches=3)
    assert rows_text(plan) == [
        ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"],
        ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"],
    ]
    # The staircase: rank 0 waits two slots for the first gradient, then at the end.
    assert texts(plan.ranks[0]) == ["0F0", "0F1", "", "0B0", "0F2", "0B1", "", "0B2"]
    assert texts(plan.ranks[1]) == ["", "1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]


def test_gpipe_order_and_bubbles() -> None:
    plan = build_compute_plan("gpipe", num_ranks=2, num_microbatches=2)
    assert texts(plan.ranks[0]) == ["0F0", "0F1", "", "", "0B0", "0B1"]
    assert texts(plan.ranks[1]) == ["", "1F0", "1F1", "1B0", "1B1"]


def test_interleaved_two_ranks_two_stages_four_microbatches() -> None:
    # rounds = 2, 2 micro-batches per round; warm-up 4 ops on rank 0, 2 on rank 1.
    plan = build_compute_plan(
        "interleaved-1f1b", num_ranks=2, num_microbatches=4, stages_per_rank=2
    )
    assert rows_text(plan) == [
        [
            "0F0",
            "0F1",
            "2F0",
            "2F1",
            "0F2",
            "2B0",
            "0F3",
            "2B1",
            "2F2",
            "0B0",
            "2F3",
            "0B1",
            "2B2",
            "2B3",
            "0B2",
            "0B3",
        ],
        [
            "1F0",
            "1F1",
            "3F0",
            "3B0",
            "3F1",
            "3B1",
            "1F2",
            "1B0",
            "1F3",
            "1B1",
            "3F2",
            "3B2",
            "3F3",
            "3B3",
            "1B2",
            "1B3",
        ],
    ]


def test_zb_h1_defers_weights_by_rank() -> None:
    plan = build_compute_plan("zb-h1", num_ranks=2, num_microbatches=3)
    assert plan.name == "zb1p"
    assert rows_text(plan) == [
        ["0F0", "0F1", "0I0", "0W0", "0F2", "0I1", "0W1", "0I2", "0W2"],
        ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1W2"],
    ]


def test_zbv_drops_missing_microbatches() -> None:
    # P=2 runs as if M were 3, then drops micro-batch 2 and beyond.
    full = build_compute_plan("zbv", num_ranks=2, num_microbatches=3)
    short = build_compute_plan("zbv", num_ranks=2, num_microbatches=2)
    for full_row, short_row in zip(rows_text(full), rows_text(short), strict=True):
        assert short_row == [t for t in full_row if not t.endswith("2")]


def test_dualpipev_uses_overlapped_pairs() -> None:
    plan = build_compute_plan("dualpipev", num_ranks=2, num_microbatches=5)
    composites = [s for row in plan.ranks for s in row if s is not None and s.sub_steps]
    assert composites
    assert all(s.kind is StepKind.OVERLAP_F_B for s in composites)
    assert all([k.kind for k in s.sub_steps] == [StepKind.F, StepKind.B] for s in composites)
    # Last rank, first main step: F0 then a full B1 as separate steps, not overlapped.
    assert "1F2 2B0" in " ".join(rows_text(plan)[1])


# ---------------------------------------------------------------------------------------
# Parameter errors name the numbers
# ---------------------------------------------------------------------------------------


def error_text(name: str, **kwargs: object) -> str:
    with pytest.raises(ScheduleError) as info:
        build_plan(name, **kwargs)  # type: ignore[arg-type]
    return str(info.value)


def test_rounds_error_names_numbers_and_suggests() -> None:
    text = error_text("interleaved-1f1b", num_ranks=4, num_microbatches=9)
    assert "4 ranks" in text and "9 micro-batches" in text
    assert "= 2" in text and "try 8 or 10" in text
    text = error_text("zb1p", num_ranks=4, num_microbatches=9, stages_per_rank=2)
    assert "zb1p" in text and "9 micro-batches" in text


def test_zb1p_one_stage_takes_any_microbatch_count() -> None:
    plan = build_compute_plan("zb1p", num_ranks=4, num_microbatches=9)
    check_complete(plan, 4, 9, 1, Placement.LOOP)


def test_dualpipev_error_names_numbers() -> None:
    text = error_text("dualpipev", num_ranks=4, num_microbatches=7)
    assert "4 ranks" in text and "8" in text and "7" in text


@pytest.mark.parametrize(
    ("name", "kwargs", "needles"),
    [
        (
            "gpipe",
            {"num_ranks": 2, "num_microbatches": 4, "stages_per_rank": 2},
            ["stages_per_rank=2", "1 stage"],
        ),
        (
            "1f1b",
            {"num_ranks": 2, "num_microbatches": 4, "stages_per_rank": 3},
            ["stages_per_rank=3"],
        ),
        (
            "zbv",
            {"num_ranks": 2, "num_microbatches": 4, "stages_per_rank": 3},
            ["stages_per_rank=3", "2 stages"],
        ),
        (
            "dualpipev",
            {"num_ranks": 2, "num_microbatches": 4, "stages_per_rank": 1},
            ["stages_per_rank=1"],
        ),
        (
            "interleaved-1f1b",
            {"num_ranks": 2, "num_microbatches": 4, "stages_per_rank": 0},
            ["stages_per_rank", "0"],
        ),
        ("1f1b", {"num_ranks": 0, "num_microbatches": 4}, ["num_ranks", "0"]),
        ("gpipe", {"num_ranks": 2, "num_microbatches": 0}, ["num_microbatches", "0"]),
        ("gpipe", {"num_ranks": 2, "num_microbatches": -3}, ["num_microbatches", "-3"]),
    ],
)
def test_invalid_parameters(name: str, kwargs: dict, needles: list[str]) -> None:
    text = error_text(name, **kwargs)
    for needle in needles:
        assert needle in text, text


# ---------------------------------------------------------------------------------------
# torch's own orders
# ---------------------------------------------------------------------------------------


def torch_orders(name: str, p: int, m: int, v: int) -> list[list[str]]:
    """torch's per-rank compute orders, bubbles removed.

    The schedule classes want real pipeline stages (a process group) in __init__, but
    ``_calculate_single_rank_operations`` only reads a few attributes, so the object is made
    with ``object.__new__`` and given those.
    """
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = {
        "interleaved-1f1b": schedules.ScheduleInterleaved1F1B,
        "zb1p": schedules.ScheduleInterleavedZeroBubble,
        "zbv": schedules.ScheduleZBVZeroBubble,
        "dualpipev": schedules.ScheduleDualPipeV,
    }[name]
    sched = object.__new__(cls)
    rounds = max(1, m // p)
    sched.pp_group_size = p
    sched.n_local_stages = v
    sched._n_microbatches = m
    sched.number_of_rounds = rounds
    sched.microbatches_per_round = m // rounds
    sched.num_stages = v * p
    sched._num_stages = v * p
    return [
        [str(a) for a in sched._calculate_single_rank_operations(rank) if a is not None]
        for rank in range(p)
    ]


TORCH_CASES = [
    (name, p, m, v)
    for name in ("interleaved-1f1b", "zb1p", "zbv", "dualpipev")
    for p in (2, 3, 4)
    for v in V_CHOICES[name]
    for m in sorted({1, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 2, 3 * p, 4 * p} - {0})
    if is_valid(name, p, m, v)
]


@pytest.mark.parametrize(("name", "p", "m", "v"), TORCH_CASES)
def test_matches_torch_order(name: str, p: int, m: int, v: int) -> None:
    ours = build_compute_plan(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)
    assert rows_text(ours) == torch_orders(name, p, m, v)
