"""Clock alignment: each rank's clock offset to rank 0, estimated by ping-pong.

Rank 0 exchanges ``rounds`` ping-pongs with each other rank in turn. In a round rank 0 notes
t0, the peer answers with its own clock reading tp, rank 0 notes t1; then
``offset = tp - (t0 + t1) / 2`` with uncertainty ``(t1 - t0) / 2`` (the peer's reading lies
somewhere inside the round trip). The round with the shortest round trip wins. Rank 0 sends
each peer its result so every rank records its own offset. Subtracting a rank's offset from
its times puts them on rank 0's clock.

The algorithm is backend-neutral: a backend supplies `send_ints` / `recv_ints`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

SendInts = Callable[[int, list[int]], None]  # (peer, values)
RecvInts = Callable[[int, int], list[int]]  # (peer, count) -> values


@dataclass(frozen=True)
class Clock:
    """Where a recorder reads time: a monotonic nanosecond reading for every event, and the
    wall clock once, to anchor those readings to the Unix epoch.

    Injectable so that a fake cluster (`pipetrace.testing.cluster`) can run real recorders on
    virtual time, with any per-rank clock offset and skew, on any fake host, without sleeping.
    """

    monotonic_ns: Callable[[], int] = time.perf_counter_ns
    wall_ns: Callable[[], int] = time.time_ns
    host: Callable[[], str] = socket.gethostname
    """The host these clocks belong to (the header's ``host``): the ranks of one host share
    its clocks, which is what the analyzer aligns hosts by."""


SYSTEM_CLOCK = Clock()
"""The process's own clocks: what every real run records with."""


@dataclass(frozen=True)
class ClockOffset:
    offset_ns: int
    """This rank's clock minus rank 0's clock."""
    uncertainty_ns: int
    """Half the best round trip: the true offset lies within offset +- uncertainty."""
    rounds: int


def align_clocks(
    *,
    rank: int,
    world_size: int,
    now_ns: Callable[[], int],
    send_ints: SendInts,
    recv_ints: RecvInts,
    rounds: int = 8,
) -> ClockOffset:
    """Collective: every rank of the group must call it. Returns this rank's offset."""
    if rank == 0:
        for peer in range(1, world_size):
            best: tuple[int, int] | None = None  # (round trip, offset)
            for _ in range(rounds):
                t0 = now_ns()
                send_ints(peer, [t0])
                (peer_time,) = recv_ints(peer, 1)
                t1 = now_ns()
                sample = (t1 - t0, peer_time - (t0 + t1) // 2)
                if best is None or sample[0] < best[0]:
                    best = sample
            send_ints(peer, [best[1], best[0] // 2])
        return ClockOffset(0, 0, rounds)
    for _ in range(rounds):
        recv_ints(0, 1)
        send_ints(0, [now_ns()])
    offset, uncertainty = recv_ints(0, 2)
    return ClockOffset(offset, uncertainty, rounds)


def torch_int_exchange() -> tuple[SendInts, RecvInts]:
    """send_ints / recv_ints over the default torch.distributed process group."""
    import torch
    import torch.distributed as dist

    def send_ints(peer: int, values: list[int]) -> None:
        dist.send(torch.tensor(values, dtype=torch.int64), dst=peer)

    def recv_ints(peer: int, count: int) -> list[int]:
        buffer = torch.empty(count, dtype=torch.int64)
        dist.recv(buffer, src=peer)
        return [int(v) for v in buffer.tolist()]

    return send_ints, recv_ints


def mindspore_int_exchange() -> tuple[SendInts, RecvInts]:
    """send_ints / recv_ints over MindSpore's world group (blocking send/recv of int64).

    Needs ``mindspore.communication.init()`` and, on CPU, the default-group fix
    (`pipetrace.runtime.mindspore.p2p.fix_default_group`) first; the MindSpore runner does
    both before it makes its recorder. mccl matches messages in posting order, so the
    exchange must not interleave with data messages: the recorder runs it at the start and
    the clean end of a run, when none are in flight.
    """
    import numpy as np
    from mindspore import Tensor
    from mindspore.ops import communication as comm

    try:
        from mindspore.graph.api import _pynative_executor
    except ImportError:  # MindSpore < 2.9
        from mindspore.common.api import _pynative_executor

    def send_ints(peer: int, values: list[int]) -> None:
        comm.send(Tensor(np.array(values, dtype=np.int64)), dst=peer)
        _pynative_executor.sync()  # ops run on a queue: return once the send has run

    def recv_ints(peer: int, count: int) -> list[int]:
        buffer = Tensor(np.zeros(count, dtype=np.int64))
        comm.recv(buffer, src=peer)
        return [int(v) for v in buffer.asnumpy().tolist()]  # asnumpy waits for the data

    return send_ints, recv_ints
