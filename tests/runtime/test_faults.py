"""Fault specs (`pipetrace.runtime.faults`): parsing, defaults, checks against the plan, the
flags of `pipetrace run`, and what `pipetrace.runtime.inject` puts on the wire (with a fake
P2P: no process is started here; tests/diagnosis runs them for real)."""

from __future__ import annotations

import dataclasses

import click
import pytest
from click.testing import CliRunner

from pipetrace.cli import main
from pipetrace.cli.run_options import run_options
from pipetrace.errors import PipetraceError
from pipetrace.runtime import fault_spec
from pipetrace.runtime import faults as ft
from pipetrace.runtime.config import RunConfig
from pipetrace.runtime.fault_plan import StepOrder, finishes, peer_of, waited_at
from pipetrace.schedule.builders import build_plan
from pipetrace.schedule.ir import StepKind, format_step


def resolved(spec: str, schedule: str = "1f1b", **run) -> ft.Fault:
    run = {"ranks": 4, "microbatches": 4, "steps": 2, **run}
    return RunConfig(schedule, faults=(spec,), **run).faults[0]


def error_of(spec: str, schedule: str = "1f1b", **run) -> str:
    with pytest.raises(PipetraceError) as info:
        resolved(spec, schedule, **run)
    message = str(info.value)
    assert "\n" not in message and message.startswith("--inject ")
    return message


# -- parsing -------------------------------------------------------------------------------


def test_every_kind_parses_alone_and_resolves_with_defaults():
    for kind in ft.FAULT_KINDS:
        fault = resolved(kind)
        assert kind == fault.KIND
        names = set(fault.keys()) - {"replica"}  # the fault's fields; replica: with replicas only
        assert all(getattr(fault, name) is not None for name in names), fault
        assert fault_spec.parse_fault(fault.spec) == fault  # the spec shows every filled-in default


def test_keys_and_values_are_converted():
    fault = fault_spec.parse_fault("straggler:rank=2,factor=3.5,phase=b,step=0")
    assert fault == ft.Straggler(rank=2, step=0, factor=3.5, phase="B")
    assert fault_spec.parse_fault("slow-link:delay=20ms").delay == pytest.approx(0.02)
    assert fault_spec.parse_fault("slow-link:delay=1s").delay == 1.0
    assert fault_spec.parse_fault("shape-mismatch:shape=16x128,channel=b").shape == (16, 128)
    assert fault_spec.parse_fault(" Hang : rank = 1 ").rank == 1
    assert fault_spec.parse_fault("straggler:phase=ALL").phase == "all"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("foo", "unknown fault kind 'foo'; choose from crash, hang, deadlock, drop-recv"),
        ("hang:rnak=2", "hang takes rank, step, replica, microbatch, phase; got 'rnak'"),
        ("hang:rank", "expected KEY=VALUE, got 'rank'"),
        ("hang:rank=1,rank=2", "rank given twice"),
        ("hang:rank=-1", "rank must be an integer >= 0, got '-1'"),
        ("crash:microbatch=one", "microbatch must be an integer >= 0"),
        ("crash:phase=X", "phase must be F or B or W, got 'X'"),
        ("straggler:factor=x", "factor must be a number > 1, got 'x'"),
        ("straggler:factor=1", "factor must be a number > 1"),
        ("straggler:phase=W", "phase must be F or B or all"),
        ("slow-link:delay=0", "delay must be a time > 0 and at most 60 s"),
        ("slow-link:delay=fast", "delay must be a time such as 0.02, 20ms or 1s"),
        ("drop-recv:channel=X", "channel must be F or B"),
        ("shape-mismatch:shape=16by128", "shape must be dimensions > 0 joined by x"),
        (
            "swap-order:factor=2",
            "swap-order takes rank, step, replica, microbatch, channel; got 'factor'",
        ),
    ],
)
def test_bad_specs_name_the_problem_and_what_is_allowed(spec, message):
    with pytest.raises(PipetraceError) as info:
        fault_spec.parse_fault(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


# -- defaults and checks against the run ---------------------------------------------------


def test_defaults_strike_a_middle_rank_after_a_clean_first_step():
    assert resolved("hang") == ft.Hang(rank=2, step=1, microbatch=1, phase="F")
    assert resolved("hang", ranks=3).rank == 1
    assert resolved("drop-recv").channel == "F" and resolved("drop-recv", ranks=2).channel == "F"
    assert resolved("extra-send", ranks=2).channel == "B"  # the last rank sends gradients only
    assert resolved("shape-mismatch").shape == (16, 128)  # half the demo's 32 x 128 rows
    # persistent faults last the whole run by default
    assert resolved("straggler") == ft.Straggler(rank=2, step=0, factor=3.0, phase="F")
    assert resolved("slow-link") == ft.SlowLink(rank=2, step=0, delay=0.02)


def test_defaults_fit_small_runs():
    assert resolved("crash", steps=1).step == 0
    assert resolved("crash", microbatches=1).microbatch == 0
    assert resolved("hang", ranks=1).rank == 0


@pytest.mark.parametrize(
    "spec, run, message",
    [
        ("hang:rank=4", {}, "rank must be 0..3 (--ranks 4), got 4"),
        ("hang:step=2", {}, "step must be 0..1 (--steps 2; step counts iterations from 0), got 2"),
        ("crash:microbatch=4", {}, "microbatch must be 0..3 (--microbatches 4), got 4"),
        ("crash:phase=W", {}, "rank 2's plan has no W step of micro-batch 1"),
        (
            "drop-recv:rank=0,channel=F",
            {},
            "rank 0 receives no F message of micro-batch 1 in this plan",
        ),
        ("extra-send:rank=3,channel=F", {}, "rank 3 sends no F message of micro-batch 1"),
        ("shape-mismatch:shape=64x128", {}, "has more elements than the right 32x128: gloo aborts"),
        ("shape-mismatch:shape=32x128", {}, "is the message's right shape"),
        ("drop-recv:step=0,microbatch=0", {}, "first message of its stream at step 0"),
        ("drop-send:step=0,microbatch=0", {}, "first message of its stream at step 0"),
        ("shape-mismatch:step=0,microbatch=0", {}, "first message of its stream at step 0"),
        ("swap-order:microbatch=3", {}, "sends no F message after micro-batch 3's"),
        (
            "swap-order:microbatch=2",
            {},
            "without a deadlock in 1f1b (plain P2P); microbatch= can be 0",
        ),
        ("deadlock:rank=1,peer=1", {}, "peer must be another rank than rank"),
        ("deadlock:rank=0,peer=3", {}, "rank 0 sends nothing to rank 3"),
        ("deadlock:rank=2,peer=1", {"ranks": 2}, "rank must be 0..1 (--ranks 2), got 2"),
        (
            "deadlock:rank=1,peer=0",
            {"ranks": 2, "schedule": "gpipe"},
            "no send of rank 1 to rank 0 deadlocks gpipe",
        ),
        ("deadlock", {"ranks": 1}, "a deadlock needs two ranks"),
        (
            "crash:replica=2",
            {"ranks": 2, "data_parallel": 2, "fsdp": True},
            "replica must be 0..1 (--data-parallel 2), got 2",
        ),
        ("crash:replica=1", {}, "replica= needs --data-parallel 2 or more"),
        ("hang:replica=0", {}, "replica= needs --data-parallel 2 or more"),
    ],
)
def test_faults_are_checked_against_the_plan(spec, run, message):
    run = dict(run)
    schedule = run.pop("schedule", "1f1b")
    assert message in error_of(spec, schedule, **run)


def test_a_fault_strikes_one_replica():
    """With replicas a fault names its replica (default 0); without, its spec is unchanged."""
    fault = resolved("hang:rank=1,replica=1", "1f1b", ranks=2, data_parallel=2, fsdp=True)
    assert (fault.rank, fault.replica, fault.spec) == (
        1,
        1,
        "hang:rank=1,step=1,replica=1,microbatch=1,phase=F",
    )
    assert resolved("hang", "1f1b", ranks=2, data_parallel=2, fsdp=True).replica == 0
    single = resolved("hang", "1f1b")
    assert single.replica is None and "replica" not in single.spec


def test_deadlock_and_swap_defaults_are_chosen_with_the_plan_executor():
    """The held send of a deadlock must deadlock, and a swap must not, in the P2P mode of the
    run: checked by the schedule verifier's executor, for every built-in schedule."""

    for schedule, ranks, mbs in [
        ("gpipe", 4, 4),
        ("1f1b", 4, 4),
        ("interleaved-1f1b", 2, 4),
        ("zb1p", 2, 4),
        ("zbv", 2, 4),
        ("dualpipev", 2, 4),
        ("zbv", 4, 8),
    ]:
        for overlap in (False, True):
            config = RunConfig(
                schedule,
                ranks=ranks,
                microbatches=mbs,
                steps=2,
                overlap_p2p=overlap,
                stages_per_rank=2 if schedule in ("interleaved-1f1b", "zb1p") else None,
                faults=("deadlock", "swap-order"),
            )
            plan = config.plan()
            deadlock, swap = config.faults
            assert isinstance(deadlock, ft.Deadlock) and isinstance(swap, ft.SwapOrder)
            send, recv = deadlock.hold(plan, overlap=overlap)
            assert (
                abs(deadlock.rank - deadlock.peer) == 1 or plan.placement.count(deadlock.rank) > 1
            )
            assert not finishes(plan, deadlock.rank, send, after=recv, overlap=overlap)
            first, second = swap.pair(plan, overlap=overlap)
            assert first.kind is second.kind and peer_of(plan, first) == peer_of(plan, second)
            assert finishes(plan, swap.rank, first, before=second, overlap=overlap)


def test_descriptions_name_the_steps():
    config = RunConfig(
        "1f1b",
        ranks=4,
        microbatches=4,
        steps=2,
        faults=("hang", "deadlock", "swap-order", "drop-recv"),
    )
    plan = config.plan()
    texts = [f.describe(plan) for f in config.faults]
    assert texts[0] == "hang: rank 2 blocks forever in 2F1 at step 1"
    assert texts[1].startswith(
        "deadlock: rank 1 runs 1SEND_F0 only once 1RECV_B0 (from rank 2) has completed"
    )
    assert texts[2].startswith("swap-order: rank 2 runs 2SEND_F1 before 2SEND_F0 at step 1")
    assert texts[3].startswith("drop-recv: rank 2 skips 2RECV_F1 at step 1")
    assert RunConfig("1f1b", ranks=4, microbatches=4, faults=("drop-send",)).faults[0].describe(
        plan
    ) == ("drop-send: rank 2 skips 2SEND_F1 at step 1 (posts nothing); rank 3 waits for it")


# -- RunConfig and the flags ---------------------------------------------------------------


def test_run_config_records_faults_as_specs():
    config = RunConfig(
        "1f1b", ranks=4, microbatches=4, faults=("hang:rank=1", ft.Straggler(factor=2.0))
    )
    assert config.to_dict()["faults"] == [
        "hang:rank=1,step=1,microbatch=1,phase=F",
        "straggler:rank=2,step=0,factor=2,phase=F",
    ]
    assert config.hangs and not RunConfig("1f1b", faults=("straggler",)).hangs
    assert dataclasses.replace(config, steps=5).faults == config.faults  # resolving is idempotent


def made_config(args: list[str]) -> RunConfig:
    made = []

    @click.command()
    @run_options
    def probe(make_config):
        made.append(make_config(4))

    result = CliRunner().invoke(probe, ["-s", "1f1b", "-m", "4", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return made[0]


def test_faults_that_hang_lower_the_timeouts_not_given():
    plain = made_config([])
    assert (plain.stall_timeout, plain.abort_timeout, plain.timeout) == (30.0, 30.0, 60.0)
    hang = made_config(["--inject", "hang"])
    assert (hang.stall_timeout, hang.abort_timeout, hang.timeout) == (
        ft.HANG_STALL_TIMEOUT,
        ft.HANG_ABORT_TIMEOUT,
        ft.HANG_P2P_TIMEOUT,
    )
    given = made_config(["--inject", "deadlock", "--stall-timeout", "7", "--timeout", "9"])
    assert (given.stall_timeout, given.abort_timeout, given.timeout) == (
        7.0,
        ft.HANG_ABORT_TIMEOUT,
        9.0,
    )
    slow = made_config(["--inject", "straggler", "--inject", "slow-link:delay=5ms"])
    assert slow.stall_timeout == 30.0 and [f.KIND for f in slow.faults] == [
        "straggler",
        "slow-link",
    ]


@pytest.mark.parametrize(
    "inject, message",
    [
        ("nosuch", "unknown fault kind 'nosuch'"),
        ("hang:rank=7", "rank must be 0..3 (--ranks 4), got 7"),
        ("straggler:factor=slow", "factor must be a number > 1"),
        ("deadlock:peer=9", "peer must be 0..3"),
    ],
)
def test_pipetrace_run_refuses_bad_faults_in_one_line_before_starting_ranks(
    capsys, no_launch, inject, message
):
    code = main(["run", "-s", "1f1b", "-p", "4", "-m", "4", "--inject", inject])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("pipetrace: error: --inject ") and message in err


def test_help_lists_every_fault_compactly():
    from pipetrace.cli.run import run

    result = CliRunner().invoke(run, ["--help"], terminal_width=80)
    assert result.exit_code == 0
    for kind in ft.FAULT_KINDS:
        assert f"\n    {kind} " in result.output
    listing = result.output[result.output.index("Faults for --inject") :]
    assert max(len(line) for line in listing.splitlines()) <= 90


# -- on the wire (fake P2P) ----------------------------------------------------------------


class FakeP2P:
    """Records what the runtime would put on the wire."""

    device = "cpu"

    def __init__(self):
        self.sent, self.received = [], []

    def begin_iteration(self):
        pass

    def drain(self):
        pass

    def stream_meta(self, channel, src_stage):
        import torch

        from pipetrace.runtime.p2p import TensorMeta

        return TensorMeta((32, 128), torch.float64)

    def send(self, step, tensor, *, peer, channel, wire=None):
        self.sent.append((format_step(step), tuple(tensor.shape), float(tensor.sum()), peer, wire))

    def recv(self, step, *, peer, channel, src_stage):
        self.received.append(format_step(step))
        return "posted"


class Context:
    iteration = 0


def drive(spec: str, schedule="1f1b", ranks=4, overlap=False):
    """Two iterations of the fault's rank, its sends and recvs only, through a FaultyP2P;
    per iteration, what went on the wire and which recvs were posted."""
    torch = pytest.importorskip("torch")
    from pipetrace.runtime.inject import FaultyP2P

    config = RunConfig(
        schedule, ranks=ranks, microbatches=4, steps=2, overlap_p2p=overlap, faults=(spec,)
    )
    fault, plan = config.faults[0], config.plan()
    fake, context = FakeP2P(), Context()
    p2p = FaultyP2P(fake, context, plan, [fault], overlap=overlap)
    sent, received, results = [], [], {}
    for iteration in range(2):
        context.iteration = iteration
        fake.sent, fake.received = [], []
        p2p.begin_iteration()
        for step in plan.steps(fault.rank):
            if step.kind in (StepKind.SEND_F, StepKind.SEND_B):
                value = torch.full((32, 128), float(step.microbatch), dtype=torch.float64)
                p2p.send(step, value, peer=peer_of(plan, step), channel=step.kind.value[-1])
            elif step.kind in (StepKind.RECV_F, StepKind.RECV_B):
                got = p2p.recv(
                    step, peer=peer_of(plan, step), channel=step.kind.value[-1], src_stage=0
                )
                results[(iteration, format_step(step))] = got
        p2p.drain()
        sent.append(fake.sent)
        received.append(fake.received)
    return fault, sent, received, results


def clean_wire(plan_rank_steps):
    return [format_step(s) for s in plan_rank_steps if s.kind in (StepKind.SEND_F, StepKind.SEND_B)]


def test_swap_order_sends_each_message_under_the_other_ones_tag():
    _, sent, _, _ = drive("swap-order:rank=2")
    f_sends = [(text, value, wire) for text, _, value, _, wire in sent[1] if "SEND_F" in text]
    (t0, v0, w0), (t1, v1, w1) = f_sends[:2]
    assert (t0, t1) == ("2SEND_F0", "2SEND_F1") and (v0, v1) == (
        0.0,
        32 * 128 * 1.0,
    )  # own tensors ...
    assert w0.as_message == (2, 1) and w1.as_message == (2, 0)  # ... under the other's tag
    assert all(w is None for _, _, w in f_sends[2:]) and all(w is None for *_, w in sent[0])


def test_reordering_faults_move_steps_in_their_iteration_only():

    plan = build_plan("1f1b", num_ranks=4, num_microbatches=4, comms=True)
    steps = plan.steps(2)
    texts = [format_step(s) for s in steps]
    reorder = StepOrder(steps)
    reorder.move(1, steps[texts.index("2SEND_F0")], after=steps[texts.index("2SEND_F1")])
    assert reorder(0) is None
    order = [texts[i] for i in reorder(1)]
    assert order.index("2SEND_F0") == order.index("2SEND_F1") + 1 and sorted(order) == sorted(texts)
    recv = steps[texts.index("2RECV_B0")]
    assert (
        waited_at(steps, recv, False) == recv and format_step(waited_at(steps, recv, True)) == "2B0"
    )


def test_shape_mismatch_sends_fewer_rows_unchecked():
    _, sent, _, _ = drive("shape-mismatch")
    _, shape, _, peer, wire = next(s for s in sent[1] if s[0] == "2SEND_F1")
    assert shape == (16, 128) and peer == 3 and wire.unchecked


def test_extra_send_posts_a_detached_copy_under_a_tag_nobody_receives():
    _, sent, _, _ = drive("extra-send")
    copies = [s for s in sent[1] if s[0] == "2SEND_F1"]
    assert len(copies) == 2 and copies[0][4] is None
    wire = copies[1][4]
    assert wire.detached and wire.as_message == (2, ft.NOBODY_MICROBATCH)


def test_drop_recv_posts_nothing_and_hands_over_zeros():
    _, _, received, results = drive("drop-recv")
    assert "2RECV_F1" not in received[1] and "2RECV_F1" in received[0]
    dropped = results[(1, "2RECV_F1")]
    assert tuple(dropped.shape) == (32, 128) and float(dropped.abs().sum()) == 0.0
    assert results[(1, "2RECV_F2")] == "posted"


def test_drop_send_posts_nothing():
    _, sent, _, _ = drive("drop-send")
    assert "2SEND_F1" in [text for text, *_ in sent[0]]
    assert "2SEND_F1" not in [text for text, *_ in sent[1]] and len(sent[1]) == len(sent[0]) - 1


def test_slow_link_delays_every_send_of_the_rank_from_its_step_on():
    _, sent, _, _ = drive("slow-link:delay=5ms,step=1")
    assert all(wire is None for *_, wire in sent[0])
    assert sent[1] and all(wire is not None and wire.delay == 0.005 for *_, wire in sent[1])


@pytest.mark.parametrize(
    "spec", ["swap-order", "shape-mismatch", "extra-send", "drop-recv", "drop-send"]
)
def test_message_faults_leave_the_first_step_clean(spec):
    fault, sent, received, _ = drive(spec)
    plan = build_plan("1f1b", num_ranks=4, num_microbatches=4, comms=True)
    assert fault.step == 1
    assert [text for text, *_ in sent[0]] == clean_wire(plan.steps(2))
    assert all(wire is None for *_, wire in sent[0])
    assert received[0] == [
        format_step(s) for s in plan.steps(2) if s.kind in (StepKind.RECV_F, StepKind.RECV_B)
    ]
