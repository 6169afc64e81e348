"""The recorder's hot calls in C do what its Python methods do.

Two recorders on the same virtual clock, one with the C queue's hot calls (`recorder/_queue.c`)
and one without, are driven through the same random sequence of calls (steps with and
without a profiler range, swap launches' bytes, the executor's `next_step` between two
steps, P2P ops with their keywords in any order, repeated and changed memory samples, of
lists or of watched counts changed in place, wrong calls). They must return the same, keep the same
open steps, in-flight ops and progress time (what the watchdog and stall dumps read), and
write the same log.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipetrace.recorder import queue as queue_module
from pipetrace.recorder.clock import Clock
from pipetrace.recorder.recorder import Recorder
from pipetrace.recorder.setup import RecordSettings
from pipetrace.schedule.builders import build_plan

PLAN = build_plan("1f1b", num_ranks=2, num_microbatches=4, comms=True)
STEPS = PLAN.steps(0)
POST = {
    "op": "send",
    "peer": 1,
    "channel": "act",
    "seq": 3,
    "nbytes": 4096,
    "shape": (32, 32),
    "dtype": "float32",
}


class Profiler:
    """A profiler that wants ranges when told to, and lists what was opened and closed."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[str] = []

    def active(self) -> bool:
        return self.on

    def begin(self, name: str) -> str:
        self.calls.append("begin " + name)
        return name

    def end(self, handle: str) -> None:
        self.calls.append("end " + handle)


class Side:
    """One recorder and what was done to it."""

    def __init__(self, run_dir, compiled: bool) -> None:
        ticks = itertools.count(1_000, 7)
        clock = Clock(monotonic_ns=lambda: next(ticks), wall_ns=lambda: 10**18, host=lambda: "h")
        self.profiler = Profiler()
        self.recorder = Recorder(
            RecordSettings(run_dir, stall_timeout=0, flush_interval=3600),
            framework="none",
            profiler=self.profiler,
            clock=clock,
            compiled=compiled,
        )
        self.recorder.begin_run(rank=0, world_size=1, plan=PLAN, config={})
        self.recorder.begin_iteration(0)
        self.steps: list = []  # tokens of open steps
        self.ops: list = []  # ids of posted P2P ops
        self.seen: list = []
        self.held, self.act, self.grad = [{}, {}], [0, 0], [0, 0]
        self.sample = self.recorder.memory_watch(self.held, self.act, self.grad)

    def do(self, action: tuple) -> None:
        name, arg = action
        rec = self.recorder
        try:
            if name == "profiler":  # asked at an iteration's start
                self.profiler.on = arg
                result = rec.begin_iteration(0)
            elif name == "begin":
                position, with_thread = arg
                thread = ("dw-0",) if with_thread else ()
                result = rec.begin_step(position, STEPS[position % len(STEPS)], *thread)
                self.steps.append(result)
            elif name == "end":
                token = self.steps.pop(arg % len(self.steps)) if self.steps else 99
                result = rec.end_step(token, *((4096,) if arg % 3 == 0 else ()))
            elif name == "next":  # the executor's one call between two steps
                ending, sampled, position = arg
                token = self.steps.pop(ending % len(self.steps)) if self.steps and ending else None
                result = rec.next_step(token, sampled, position, STEPS[position % len(STEPS)])
                self.steps.append(result)
            elif name == "post":
                order, dropped = arg
                keys = sorted(POST, key=lambda k: (hash(k) * order) % 97)
                kwargs = {k: POST[k] for k in keys if k != dropped}
                result = rec.p2p_posted(step=STEPS[order % len(STEPS)], **kwargs)
                self.ops.append(result)
            elif name == "done":
                result = rec.p2p_completed(self.ops[arg % len(self.ops)] if self.ops else 7)
            elif name == "watched":  # the counts changed in place, then sampled
                stage, mb, held, act = arg
                self.held[stage][mb] = held
                self.act[stage] += act
                result = self.sample(self.steps[-1] if self.steps else 0)
            else:  # memory
                token = self.steps[0] if self.steps else 0
                result = rec.memory_sample(token, [arg, 1], [2], None, None if arg else [3])
        except TypeError as error:
            result = ("TypeError", "p2p_posted" in str(error) or "missing" in str(error))
        self.seen.append((result, rec.last_progress, dict(rec.open_steps), dict(rec.inflight)))


actions = st.lists(
    st.one_of(
        st.tuples(st.just("profiler"), st.booleans()),
        st.tuples(st.just("begin"), st.tuples(st.integers(0, 20), st.booleans())),
        st.tuples(st.just("end"), st.integers(0, 10)),
        st.tuples(st.just("next"), st.tuples(st.integers(0, 3), st.booleans(), st.integers(0, 20))),
        st.tuples(
            st.just("post"),
            st.tuples(st.integers(1, 50), st.sampled_from([None, None, None, "dtype", "peer"])),
        ),
        st.tuples(st.just("done"), st.integers(0, 10)),
        st.tuples(st.just("memory"), st.integers(0, 2)),
        st.tuples(
            st.just("watched"),
            st.tuples(
                st.integers(0, 1),
                st.integers(0, 2),
                st.one_of(st.integers(0, 99), st.sampled_from([2.5, True])),  # not an int
                st.integers(0, 1),
            ),
        ),
    ),
    max_size=40,
)


def test_the_compiled_hot_path_is_bound():
    """An install builds it, and a plain recorder (no device timer, no stacks) uses it."""
    assert queue_module.COMPILED
    recorder = Recorder(RecordSettings("unused", stall_timeout=0))
    assert type(recorder.begin_step).__name__ == "builtin_function_or_method"


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(calls=actions)
def test_the_compiled_hot_path_does_what_the_python_methods_do(tmp_path_factory, calls):
    sides = [Side(tmp_path_factory.mktemp("run"), compiled) for compiled in (True, False)]
    for action in calls:
        for side in sides:
            side.do(action)
    logs = []
    for side in sides:
        side.recorder.end_iteration(0, None)
        side.recorder.close()
        logs.append(side.recorder.config.run_dir.joinpath("rank-00000.ndjson").read_bytes())
    compiled, python = sides
    assert compiled.seen == python.seen
    assert compiled.profiler.calls == python.profiler.calls
    assert logs[0].splitlines()[1:] == logs[1].splitlines()[1:]  # the header has the pid


@pytest.mark.parametrize("compiled", [True, False])
def test_a_step_left_open_is_what_a_stall_dump_lists(tmp_path, compiled):
    side = Side(tmp_path, compiled)
    side.do(("begin", (2, True)))
    side.do(("post", (1, None)))
    assert [s["pos"] for s in side.recorder.describe_open_steps()] == [2]
    assert [op["op"] for op in side.recorder.describe_inflight()] == ["send"]
    side.recorder.close()


@pytest.mark.parametrize("compiled", [True, False])
def test_a_long_iteration_is_written_as_it_goes(tmp_path, compiled):
    """The writer's bound holds on either hot path: with no iteration end (no flush), the
    steps' events reach the log as the queue fills, all but the last few hundred."""
    recorder = Recorder(
        RecordSettings(tmp_path, stall_timeout=0, flush_interval=3600, buffer_events=50),
        framework="none",
        compiled=compiled,
    )
    recorder.begin_run(rank=0, world_size=1, plan=PLAN, config={})
    recorder.begin_iteration(0)
    for position in range(2_000):
        recorder.end_step(recorder.begin_step(position, STEPS[position % len(STEPS)]))
    lines = tmp_path.joinpath("rank-00000.ndjson").read_bytes().count(b"\n")
    assert 3_800 <= lines <= 4_003  # + the header, run_start and iter_begin
    recorder.close()
