"""Recvs posted ahead (`pipetrace.runtime.recv_ahead`): which recv is posted when."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pipetrace.runtime.config import DemoConfig
from pipetrace.runtime.demo import build_demo_model, demo_batch
from pipetrace.runtime.executor import Executor
from pipetrace.runtime.recv_ahead import RecvAhead
from pipetrace.runtime.stage import PipelineStage
from pipetrace.runtime.torch_backend import split_sequential
from pipetrace.schedule.builders import build_plan
from pipetrace.schedule.ir import StepKind, format_step

RECVS = (StepKind.RECV_F, StepKind.RECV_B)


class PostingLog:
    """The P2P side of `RecvAhead`: notes each recv posted ahead as (peer, channel, step)."""

    def __init__(self) -> None:
        self.posted: list[tuple[int, str, object]] = []

    def recv_early(self, step, *, peer, channel, src_stage):
        self.posted.append((peer, channel, step))
        return self.posted[-1]


@pytest.mark.parametrize(
    ("schedule", "v"), [("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2), ("dualpipev", 2)]
)
def test_each_recv_is_posted_one_message_ahead_in_plan_order(schedule, v):
    plan = build_plan(schedule, num_ranks=4, num_microbatches=8, stages_per_rank=v, comms=True)
    for rank in range(4):
        steps = plan.steps(rank)
        recvs = [step for step in steps if step.kind in RECVS]
        ahead = RecvAhead.of(steps, plan.placement)
        log = PostingLog()
        for _iteration in range(2):
            log.posted.clear()
            ahead.begin_iteration(log)
            for position, step in enumerate(steps):
                if step.kind not in RECVS:
                    continue
                early = ahead.take(position, log)
                assert early is not None and early[2] is step  # posted before its step ran
                waiting = Counter(posted[:2] for posted in ahead.posted.values())
                assert max(waiting.values(), default=0) <= 1  # + the one taken: 2 buffers
            assert not ahead.posted  # nothing left over for the next iteration
            assert sorted(map(id, (p[2] for p in log.posted))) == sorted(map(id, recvs))
        order = {id(step): i for i, step in enumerate(steps)}
        for key in {posted[:2] for posted in log.posted}:  # per (peer, channel): plan order
            positions = [order[id(p[2])] for p in log.posted if p[:2] == key]
            assert positions == sorted(positions)


class RecvLog:
    """A gloo-like P2P for one rank that notes how each recv was posted."""

    tag_matched = True
    overlap = False

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad
        self.calls: list[tuple[str, str]] = []

    def begin_iteration(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def send(self, step, tensor, *, peer, channel):
        self.calls.append(("send", format_step(step)))

    def recv(self, step, *, peer, channel, src_stage):
        self.calls.append(("at its step", format_step(step)))
        return self.grad.clone()

    def recv_early(self, step, *, peer, channel, src_stage):
        self.calls.append(("ahead", format_step(step)))
        return step

    def received_early(self, early, step, peer, channel):
        assert early is step
        return self.grad.clone()


@pytest.mark.parametrize("custom_recv", [False, True])
def test_the_executor_posts_recvs_ahead_unless_a_custom_function_receives(custom_recv):
    demo = DemoConfig(width=16, microbatch_size=4)
    plan = build_plan("1f1b", num_ranks=2, num_microbatches=2, comms=True)
    chunks = split_sequential(build_demo_model(2, demo, seed=0), 2)
    inputs, _ = demo_batch(0, 2 * demo.microbatch_size, demo, seed=0)
    log = RecvLog(torch.ones_like(chunks[0](inputs[:4])).detach())
    stage = PipelineStage(chunks[0], stage_index=0, num_stages=2)
    executor = Executor(plan=plan, rank=0, stages={0: stage}, p2p=log)
    if custom_recv:
        executor.register_custom_function("RECV_B", lambda step, context: context.default(step))
    executor.run_iteration(inputs.split(demo.microbatch_size), None)
    executor.close()
    how = {how for how, _ in log.calls if how != "send"}
    assert how == ({"at its step"} if custom_recv else {"ahead"})
    recvs = [text for how, text in log.calls if how != "send"]
    assert recvs == [format_step(s) for s in plan.steps(0) if s.kind in RECVS]
