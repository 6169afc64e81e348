"""Recvs posted ahead (`pipetrace.runtime.recv_ahead`): which recv is posted when."""

from __future__ import annotations

from collections import Counter

import pytest

from pipetrace.runtime.recv_ahead import RecvAhead
from pipetrace.schedule.builders import build_plan
from pipetrace.schedule.ir import StepKind

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
