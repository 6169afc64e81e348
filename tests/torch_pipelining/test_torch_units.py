"""Without ranks: the version gate, recording off, a schedule that cannot be recorded, the
single-stage orders against torch's own description of them, and what ``pipetrace run
--runtime torch`` refuses."""

from __future__ import annotations

import contextlib
import warnings
from types import SimpleNamespace

import pytest

import pipetrace.runtime.launch
from pipetrace.cli import main
from pipetrace.recorder.hooks import NullRecorder
from pipetrace.schedule.ir import StepKind, format_step
from pipetrace.torch_pipelining import SUPPORTED_TORCH_VERSIONS, record
from pipetrace.torch_pipelining.api import Recording
from pipetrace.torch_pipelining.instrument import Instrumentation
from pipetrace.torch_pipelining.messages import Message, MessageLog
from pipetrace.torch_pipelining.plan import gpipe_order, one_f_one_b_order, plan_of
from pipetrace.torch_pipelining.replay import FakeStage, fake_p2p, fake_schedule
from pipetrace.torch_pipelining.version import unsupported_reason

torch = pytest.importorskip("torch")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def test_only_verified_releases_are_recorded():
    assert unsupported_reason("2.13.0+cpu") is None
    reason = unsupported_reason("2.14.1")
    assert reason is not None and "2.14.1" in reason
    assert all(version in reason for version in SUPPORTED_TORCH_VERSIONS)


def test_another_release_warns_once_and_patches_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    original = schedules._batch_p2p
    with pytest.warns(RuntimeWarning, match="supports torch 2.13.0"):
        recording = record(SimpleNamespace(), tmp_path / "run")
    assert not recording.active
    assert schedules._batch_p2p is original
    assert not (tmp_path / "run").exists()


def test_recording_off_patches_nothing(monkeypatch):
    monkeypatch.delenv("PIPETRACE_DIR", raising=False)
    original = schedules._batch_p2p
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with record(SimpleNamespace()) as recording:
            assert not recording.active
            assert schedules._batch_p2p is original


def test_a_schedule_it_cannot_read_runs_unrecorded(tmp_path):
    with pytest.warns(RuntimeWarning, match="training continues unrecorded"):
        recording = record(SimpleNamespace(), tmp_path / "run")
    assert not recording.active
    recording.close()


def compute_texts(steps):
    return [format_step(s) for s in steps if not s.is_comm]


@pytest.mark.parametrize(
    ("order", "torch_class"),
    [(gpipe_order, schedules.ScheduleGPipe), (one_f_one_b_order, schedules.Schedule1F1B)],
)
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (4, 4), (4, 8)])
def test_single_stage_orders_compute_what_torch_says(order, torch_class, stages, microbatches):
    """Torch's ``_get_pipeline_order`` (compute only, with bubbles) lists the compute in the
    order the loop runs it; ours adds the messages in the order the loop posts them.

    Torch 2.13's 1F1B description numbers the last stage's forwards from 1 (its warm-up count
    is 0, and the counter is bumped before the first forward), while the loop runs F0 first:
    there only the sequence of kinds is compared."""
    described = torch_class._get_pipeline_order(
        SimpleNamespace(_num_stages=stages, _n_microbatches=microbatches)
    )
    for stage in range(stages):
        ours = compute_texts(order(stage, stages, microbatches))
        theirs = [str(a) for a in described[stage] if a is not None]
        if torch_class is schedules.Schedule1F1B and stage == stages - 1:
            ours, theirs = (
                [t.rstrip("0123456789") for t in ours],
                [t.rstrip("0123456789") for t in theirs],
            )
        assert ours == theirs


@pytest.mark.parametrize("order", [gpipe_order, one_f_one_b_order])
def test_single_stage_orders_send_and_receive_in_the_same_order(order):
    """Untagged gloo matches messages in posting order: stage s's sends and stage s+1's
    recvs of each channel must list the same micro-batches in the same order."""
    stages, microbatches = 4, 8
    plans = [order(stage, stages, microbatches) for stage in range(stages)]
    for stage in range(stages - 1):

        def mbs(steps, kind):
            return [s.microbatch for s in steps if s.kind is kind]

        assert mbs(plans[stage], StepKind.SEND_F) == mbs(plans[stage + 1], StepKind.RECV_F)
        assert mbs(plans[stage + 1], StepKind.SEND_B) == mbs(plans[stage], StepKind.RECV_B)
        assert len(mbs(plans[stage], StepKind.SEND_F)) == microbatches


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "mindspore"], "--runtime torch runs on torch only, not --backend mindspore"),
        (["--overlap-p2p"], "--overlap-p2p is a feature of pipetrace's runtime"),
        (["--swap", "all"], "--swap is a feature of pipetrace's runtime"),
        (
            ["--inject", "deadlock"],
            "--inject deadlock: not on --runtime torch, which takes crash, hang, drop-send, "
            "straggler",
        ),
    ],
)
def test_what_torchs_runtime_cannot_do_is_refused_before_any_rank_starts(
    capsys, monkeypatch, args, message
):
    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(pipetrace.runtime.launch, "launch", refuse)
    assert main(["run", "-s", "1f1b", "--runtime", "torch", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pipetrace: error: {message}") and err.count("\n") == 1, err


class CallLog(NullRecorder):
    """A recorder that lists the hooks called, with what identifies each report."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def begin_step(self, position, step, thread="main"):
        self.calls.append(("begin", format_step(step)))
        return format_step(step)

    def end_step(self, token, nbytes=None):
        self.calls.append(("end", token))

    def p2p_posted(self, **report):
        token = (report["op"], report["seq"])
        self.calls.append(("post", token, report["nbytes"], report["shape"], report["dtype"]))
        return token

    def p2p_enqueued(self, token):
        self.calls.append(("enqueued", token))

    def p2p_completed(self, token):
        self.calls.append(("done", token))

    def exception(self, exc):
        self.calls.append(("exception", str(exc)))


def test_single_stage_ops_are_posted_inside_their_message_steps_and_complete_once():
    """GPipe / 1F1B have no SEND/RECV actions: posting a batch opens each op's step, one
    step for consecutive ops of the same message; an op no stage made is not reported; each
    op completes once, when its work is waited (no device stream: no `p2p_enqueued`)."""
    steps = {format_step(s): s for s in one_f_one_b_order(0, 2, 2) if s.is_comm}
    send, recv = steps["0SEND_F0"], steps["0RECV_B0"]
    recorder = CallLog()
    log = MessageLog(recorder, current_stream=None)
    log.begin_iteration()
    send_ops = [SimpleNamespace(tensor=torch.zeros(2, 3), group_peer=1) for _ in range(2)]
    recv_op, stray = (SimpleNamespace(tensor=torch.zeros(2, 3), group_peer=1) for _ in range(2))
    for ops, message in (
        (send_ops, Message.of(1, send, "F")),
        ([recv_op], Message.of(5, recv, "B")),
    ):
        log.pending.update((id(op), (op, message)) for op in ops)  # as the stages' wrappers note

    tokens = log.post([*send_ops, stray, recv_op], open_steps=True)
    assert tokens == [("send", 0), ("send", 1), None, ("recv", 0)]
    assert recorder.calls == [
        ("begin", "0SEND_F0"),
        ("post", ("send", 0), 24, (2, 3), "float32"),
        ("post", ("send", 1), 24, (2, 3), "float32"),
        ("end", "0SEND_F0"),
        ("begin", "0RECV_B0"),
        ("post", ("recv", 0), 24, (2, 3), "float32"),
        ("end", "0RECV_B0"),
    ]
    waits = []
    works = [SimpleNamespace(wait=lambda n=n: waits.append(n)) for n in range(len(tokens))]
    log.posted_works(works, tokens)
    recorder.calls.clear()
    log.waited(works[1:])
    assert waits == [1, 2, 3]
    assert recorder.calls == [("done", ("send", 1)), ("done", ("recv", 0))]
    log.waited(works)
    assert waits == [1, 2, 3, 0, 1, 2, 3]
    assert recorder.calls[2:] == [("done", ("send", 0))]  # each op completes once


@contextlib.contextmanager
def _instrumented(stage, schedule_class: str):
    """``stage`` in a fake ``schedule_class`` schedule of 4 micro-batches, recorded into a
    `CallLog` over fake P2P: (schedule, plan, recorder, instrumentation), undone at the end."""
    schedule = fake_schedule(schedule_class, stage, 4)
    plan = plan_of(schedule)
    recorder = CallLog()
    instrumentation = Instrumentation(schedule, plan, stage.group_rank, recorder)
    with fake_p2p():
        instrumentation.install()
        try:
            yield schedule, plan, recorder, instrumentation
        finally:
            instrumentation.undo()


@pytest.mark.parametrize("schedule_class", ["Schedule1F1B", "ScheduleGPipe"])
@pytest.mark.parametrize("stage_index", [0, 1, 3])
def test_a_replayed_iteration_records_each_step_of_the_plan_once_in_order(
    schedule_class, stage_index
):
    """Torch's calls of one single-stage iteration, replayed against a fake stage (the
    bench's hook-cost figure runs the same): every plan step of the rank is opened and
    closed once, in plan order, and every op is posted inside its step and completed once."""
    stage = FakeStage(stage_index, 4, (2, 3))
    with _instrumented(stage, schedule_class) as (schedule, plan, recorder, _):
        schedule.step()
    texts = [format_step(step) for step in plan.steps(stage.group_rank)]
    calls = recorder.calls
    assert [call[1] for call in calls if call[0] == "begin"] == texts
    assert [call[1] for call in calls if call[0] == "end"] == texts
    posts = [call[1] for call in calls if call[0] == "post"]
    assert len(posts) == sum(step.is_comm for step in plan.steps(stage.group_rank))
    assert sorted(call[1] for call in calls if call[0] == "done") == sorted(posts)


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"PIPETRACE_STALL_TIMEOUT": "-3"}, "PIPETRACE_STALL_TIMEOUT must be >= 0 seconds"),
        (
            {"PIPETRACE_RECORD": "off", "PIPETRACE_STALL_TIMEOUT": "abc"},
            "PIPETRACE_STALL_TIMEOUT='abc'",
        ),
        ({"PIPETRACE_RECORD": "bogus"}, "PIPETRACE_RECORD must be one of off, steps, full"),
        ({"PIPETRACE_BUFFER_EVENTS": "0"}, "PIPETRACE_BUFFER_EVENTS must be >= 1, got 0"),
    ],
)
@pytest.mark.parametrize("directory", ["none", "env", "argument"])
def test_a_bad_variable_is_one_warning_and_the_job_runs_unrecorded(
    monkeypatch, tmp_path, variables, named, directory
):
    """Recording never stops training, whether it would be on or not: the variable and its
    value are named once, and nothing is patched or written."""
    monkeypatch.delenv("PIPETRACE_DIR", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    if directory == "env":
        monkeypatch.setenv("PIPETRACE_DIR", str(tmp_path / "run"))
    original = schedules._batch_p2p
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recording = record(SimpleNamespace(), tmp_path / "run" if directory == "argument" else None)
    assert [w.category for w in caught] == [RuntimeWarning]
    message = str(caught[0].message)
    assert named in message and message.endswith("training continues unrecorded"), message
    assert caught[0].filename == __file__  # it points at the record() call
    assert not recording.active and schedules._batch_p2p is original
    assert not (tmp_path / "run").exists()
    recording.close()


def test_a_forward_only_schedule_is_not_recorded(tmp_path):
    """A schedule built with no loss function runs no backward: its steps are not its plan."""
    schedule = schedules.Schedule1F1B(FakeStage(0, 2, (2, 3)), n_microbatches=2)
    original = schedules._batch_p2p
    with pytest.warns(RuntimeWarning, match=r"Schedule1F1B has no loss_fn \(forward-only\)"):
        recording = record(schedule, tmp_path / "run")
    assert not recording.active and schedules._batch_p2p is original
    assert "step" not in vars(schedule)
    assert not (tmp_path / "run").exists()


def test_a_set_up_that_fails_midway_leaves_no_recorder_running(tmp_path):
    """meta.json cannot hold an object: the recorder's flush thread, started before, ends."""
    import threading

    schedule = fake_schedule("Schedule1F1B", FakeStage(0, 2, (2, 3)), 2)
    original = schedules._batch_p2p
    before = set(threading.enumerate())
    with pytest.warns(RuntimeWarning, match="could not record Schedule1F1B"):
        recording = record(schedule, tmp_path / "run", config={"unwritable": object()})
    assert not recording.active and schedules._batch_p2p is original
    assert set(threading.enumerate()) == before


class CountingStage(FakeStage):
    """A fake stage that counts the forwards torch's loop (here, the replay) runs on it."""

    forwards = 0

    def forward_one_chunk(self, chunk_id, *args, **kwargs):
        self.forwards += 1


@pytest.mark.parametrize("stage_index", [0, 1])
def test_an_eval_between_steps_runs_unrecorded_and_is_no_iteration(stage_index):
    """torch's ``eval`` calls ``step`` with no backward: it runs with every patch off (no
    step, op or iteration reported), and the next training step is the next iteration."""
    stage = CountingStage(stage_index, 2, (2, 3))
    with _instrumented(stage, "Schedule1F1B") as (schedule, _, recorder, instrumentation):
        schedule.step()
        recorded = list(recorder.calls)
        forwards = stage.forwards
        schedule.eval()
        assert stage.forwards == 2 * forwards  # the eval did run
        assert recorder.calls == recorded and instrumentation.iteration == 0
        assert instrumentation.installed and schedule._has_backward
        schedule.step()
    assert instrumentation.iteration == 1
    # the second step reports what the first did (the same messages, sizes and steps)
    assert recorder.calls[len(recorded) :] == recorded


class FailingStage(FakeStage):
    def forward_one_chunk(self, chunk_id, *args, **kwargs):
        raise RuntimeError("boom in a forward")


@pytest.mark.parametrize("where", ["in a step", "between steps"])
def test_an_exception_leaving_the_recording_block_is_recorded_once(where):
    """A data loader's error between steps is recorded as a step's is (without it the log
    just stops, read as a process killed from outside); a step's own is not recorded twice."""
    stage = (FailingStage if where == "in a step" else FakeStage)(0, 2, (2, 3))
    with (
        _instrumented(stage, "Schedule1F1B") as (schedule, _, recorder, instrumentation),
        pytest.raises(RuntimeError),
        Recording(instrumentation, recorder),
    ):
        schedule.step()
        raise RuntimeError("boom in the data loader")
    failures = [call for call in recorder.calls if call[0] == "exception"]
    boom = "boom in a forward" if where == "in a step" else "boom in the data loader"
    assert failures == [("exception", boom)]


def test_a_rank_waiting_in_the_adapters_wait_shows_as_a_p2p_wait():
    """gloo's ``work.wait()`` is C: the innermost Python frame of a rank stuck there is the
    adapter's own, which the watchdog's stall must show as a P2P wait (else the analyzer
    calls a rank waiting on its recv hung in its own code)."""
    import functools
    import threading
    import time

    from pipetrace.recorder.watchdog import main_thread_waits, thread_stacks

    work = SimpleNamespace(wait=functools.partial(time.sleep, 0.5))  # no Python frame
    seen: list[bool | None] = []
    look = threading.Timer(0.2, lambda: seen.append(main_thread_waits(thread_stacks())))
    look.start()
    MessageLog(NullRecorder(), None).waited([work])
    look.join()
    assert seen == [True]
