"""Receives posted ahead of their steps, where the transport matches messages by tag (gloo).

A gloo send completes only once the peer has posted the matching recv. A plan that posts
each recv at its own RECV step therefore makes every send a rendezvous: a rank that sends
to a peer busy computing waits for that peer. Posting each recv one message ahead, the way
torch.distributed.pipelining posts its recvs, lets the send complete as soon as the data is
on the wire, and the RECV step still waits for its own message (plain mode: each message
finishes at its own step; overlap mode: the consumer waits, as before). The recorder is
told of each recv when its RECV step takes it (`P2PBookkeeping.received_early`), so the
trace reads as before: the post time of a recv is its step's, its buffer was posted earlier.

Per (peer, channel), the recv of the next message in plan order is posted when the RECV
step of the previous one runs (the first at the start of the iteration), so each
(peer, channel) holds at most two receive buffers at a time. A recv whose stream's shape is
not known yet (the first iteration) is posted at its step. Only over a transport that
matches messages by tag (`P2PBookkeeping.tag_matched`: gloo); NCCL and MindSpore's mccl
match in posting order, and a run with injected faults posts every recv at its step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipetrace.schedule.ir import Step, StepKind

if TYPE_CHECKING:
    from pipetrace.runtime.p2p_common import EarlyRecv

Recv = tuple[int, Step, int, str, int]  # (plan position, RECV step, peer, channel, sending stage)


@dataclass
class RecvAhead:
    """Which recv to post ahead at each RECV step, and the recvs posted so far."""

    first: list[Recv]
    """The first recv of each (peer, channel) of the plan, posted as an iteration begins."""
    following: dict[int, Recv]
    """Plan position of a RECV step -> the next recv of the same (peer, channel)."""
    posted: dict[int, EarlyRecv] = field(default_factory=dict)
    """Plan position -> its recv, posted ahead and not yet taken by its step."""

    @classmethod
    def of(cls, steps: list[Step], placement: tuple[int, ...]) -> RecvAhead:
        first: list[Recv] = []
        following: dict[int, Recv] = {}
        last: dict[tuple[int, str], int] = {}  # (peer, channel) -> position of its last RECV
        for position, step in enumerate(steps):
            if step.kind is StepKind.RECV_F:
                recv = (position, step, placement[step.stage - 1], "F", step.stage - 1)
            elif step.kind is StepKind.RECV_B:
                recv = (position, step, placement[step.stage + 1], "B", step.stage + 1)
            else:
                continue
            previous = last.get(recv[2:4])
            if previous is None:
                first.append(recv)
            else:
                following[previous] = recv
            last[recv[2:4]] = position
        return cls(first, following)

    def begin_iteration(self, p2p: Any) -> None:
        for recv in self.first:
            self._post(recv, p2p)

    def take(self, position: int, p2p: Any) -> EarlyRecv | None:
        """The recv of the RECV step at ``position`` if it was posted ahead, else None (then
        the step posts it itself, and calls `posted_at_step`)."""
        pending = self.posted.pop(position, None)
        if pending is not None:
            self.posted_at_step(position, p2p)
        return pending

    def posted_at_step(self, position: int, p2p: Any) -> None:
        """The RECV step at ``position`` has posted its recv: post the next one of its
        (peer, channel), after it."""
        following = self.following.get(position)
        if following is not None:
            self._post(following, p2p)

    def _post(self, recv: Recv, p2p: Any) -> None:
        position, step, peer, channel, src_stage = recv
        pending = p2p.recv_early(step, peer=peer, channel=channel, src_stage=src_stage)
        if pending is not None:
            self.posted[position] = pending
