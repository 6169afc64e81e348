"""Record runs through the real Recorder (real writer, real files) with injectable faults.

Each rank is a thread that walks its plan like the runtime's executor does: begin_step,
the step's work, end_step; SEND/RECV steps post P2P ops over an in-process tagged transport
(like gloo: a message is matched by its tag, which names channel, sending stage and
micro-batch) and report them with the runtime's sequence numbering (per (op, peer, channel)
from 0 each iteration). Compute steps sleep. Clocks are aligned over queues with the real
`align_clocks`. A rank that would wait forever instead gives up after `timeout` seconds and
closes its log without run_end, as a hung process killed from outside would leave it.

Faults (``Fault`` records, matched by rank, and by step text where given):

- ``drop_recv``: the RECV step posts nothing.
- ``extra_send``: send the message twice.
- ``wrong_shape``: the send declares another shape.
- ``swap_sends``: post this SEND after the next one.
- ``slow``: compute steps of the rank sleep ``factor`` times longer.
- ``raise``: the step raises RuntimeError.
- ``block``: the step never returns.
- ``plan``: the rank runs a plan whose steps at ``positions`` are swapped.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipetrace.recorder.recorder import Recorder
from pipetrace.recorder.setup import RecordSettings
from pipetrace.schedule.builders import build_plan
from pipetrace.schedule.ir import Plan, Step, StepKind, format_step


class _GiveUp(Exception):
    """A wait that would never end (the test's stand-in for a hung process)."""


@dataclass
class Fault:
    kind: str
    rank: int
    step: str | None = None
    factor: float = 1.0
    positions: tuple[int, int] = (0, 1)


@dataclass
class Transport:
    rendezvous: bool
    timeout: float
    boxes: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _box(self, key) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault(key, queue.Queue())

    def send(self, src: int, dst: int, tag: tuple) -> None:
        picked = threading.Event()
        self._box((src, dst, tag)).put(picked)
        if self.rendezvous and not picked.wait(self.timeout):
            raise _GiveUp

    def recv(self, src: int, dst: int, tag: tuple) -> None:
        try:
            picked = self._box((src, dst, tag)).get(timeout=self.timeout)
        except queue.Empty:
            raise _GiveUp from None
        picked.set()


def _exchange(inboxes: dict[int, queue.Queue], me: int, error_ns: int):
    def send_ints(peer: int, values: list[int]) -> None:
        inboxes[peer].put((me, values))

    def recv_ints(peer: int, count: int) -> list[int]:
        sender, values = inboxes[me].get(timeout=20)
        assert sender == peer and len(values) == count
        if count == 2:  # the offset rank 0 computed for us: make it wrong on purpose
            values = [values[0] + error_ns, values[1]]
        return values

    return send_ints, recv_ints


_COMM = {
    StepKind.SEND_F: ("send", "F", 1),
    StepKind.SEND_B: ("send", "B", -1),
    StepKind.RECV_F: ("recv", "F", -1),
    StepKind.RECV_B: ("recv", "B", 1),
}


def _rank_plan(plan: Plan, rank: int, faults: list[Fault]) -> Plan:
    for f in faults:
        if f.kind == "plan" and f.rank == rank:
            rows = [list(r) for r in plan.ranks]
            steps = [s for s in rows[rank] if s is not None]
            a, b = f.positions
            steps[a], steps[b] = steps[b], steps[a]
            rows[rank] = steps
            return Plan(plan.num_microbatches, plan.placement, rows, plan.name, dict(plan.params))
    return plan


def record_run(
    run_dir: str | Path,
    *,
    schedule: str = "1f1b",
    ranks: int = 4,
    microbatches: int = 4,
    stages_per_rank: int | None = None,
    iterations: int = 2,
    compute_s: float = 0.0005,
    faults: list[Fault] | None = None,
    rendezvous: bool = False,
    timeout: float = 1.0,
    stall_timeout: float = 0.0,
    clock_skew_ns: list[int] | None = None,
    clock_error_ns: list[int] | None = None,
) -> Plan:
    faults = faults or []
    plan = build_plan(
        schedule,
        num_ranks=ranks,
        num_microbatches=microbatches,
        stages_per_rank=stages_per_rank,
        comms=True,
    )
    transport = Transport(rendezvous, timeout)
    inboxes = {r: queue.Queue() for r in range(ranks)}
    config = {"schedule": schedule, "p2p": "plain", "test": True}
    threads = [
        threading.Thread(
            target=_rank,
            daemon=True,
            args=(
                Path(run_dir),
                r,
                plan,
                config,
                iterations,
                compute_s,
                faults,
                transport,
                inboxes,
                stall_timeout,
                (clock_skew_ns or [0] * ranks)[r],
                (clock_error_ns or [0] * ranks)[r],
            ),
        )
        for r in range(ranks)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return plan


def _rank(
    run_dir,
    rank,
    plan,
    config,
    iterations,
    compute_s,
    faults,
    transport,
    inboxes,
    stall_timeout,
    skew,
    error,
) -> None:
    mine = [f for f in faults if f.rank == rank]
    recorder = Recorder(
        RecordSettings(run_dir, stall_timeout=stall_timeout, abort_timeout=0, flush_interval=0.05),
        framework="test",
        framework_version="0",
        clock_exchange=_exchange(inboxes, rank, error),
    )
    recorder._epoch_anchor += skew  # this rank's wall clock is off by `skew`
    my_plan = _rank_plan(plan, rank, mine)
    recorder.begin_run(rank=rank, world_size=plan.num_ranks, plan=my_plan, config=config)
    slow = next((f.factor for f in mine if f.kind == "slow"), 1.0)
    try:
        for it in range(iterations):
            recorder.begin_iteration(it)
            seqs: dict[tuple[str, int, str], int] = {}
            steps = my_plan.steps(rank)
            deferred: tuple[int, Step] | None = None
            for pos, step in enumerate(steps):
                text = format_step(step)
                hit = {
                    f.kind
                    for f in mine
                    if f.step in (None, text) and f.kind not in ("slow", "plan")
                }
                token = recorder.begin_step(pos, step)
                if "raise" in hit:
                    raise RuntimeError(f"injected failure in {text}")
                if "block" in hit:
                    time.sleep(transport.timeout)
                    raise _GiveUp
                if step.kind in _COMM:
                    if "swap_sends" in hit:
                        deferred = (pos, step)
                    else:
                        _comm(recorder, transport, plan, rank, step, seqs, hit)
                        if deferred is not None:
                            _comm(recorder, transport, plan, rank, deferred[1], seqs, set())
                            deferred = None
                elif step.sub_steps:  # a composite: one span per sub-step, like the runtime
                    for sub, thread in zip(step.sub_steps, ("main", "overlap")):
                        sub_token = recorder.begin_step(pos, sub, thread)
                        time.sleep(compute_s * slow * (2 if sub.kind is StepKind.B else 1))
                        recorder.end_step(sub_token)
                elif step.is_compute:
                    time.sleep(compute_s * slow * (2 if step.kind is StepKind.B else 1))
                recorder.end_step(token)
            recorder.end_iteration(it, 0.5 if rank == plan.placement[-1] else None)
    except _GiveUp:
        recorder.close()  # hung: the log ends with open steps and ops, no run_end
        return
    except RuntimeError as exc:
        recorder.exception(exc)
        recorder.close()
        return
    recorder.end_run()


def _comm(recorder, transport, plan, rank, step, seqs, hit) -> None:
    op, ch, direction = _COMM[step.kind]
    if op == "recv" and "drop_recv" in hit:
        return
    peer = plan.placement[step.stage + direction]
    src_stage = step.stage if op == "send" else step.stage + direction
    tag = (ch, src_stage, step.microbatch)
    copies = 2 if (op == "send" and "extra_send" in hit) else 1
    for _ in range(copies):
        key = (op, peer, ch)
        seq = seqs.get(key, 0)
        seqs[key] = seq + 1
        shape = (8, 8) if (op == "send" and "wrong_shape" in hit) else (4, 4)
        ticket = recorder.p2p_posted(
            op=op,
            step=step,
            peer=peer,
            channel=ch,
            seq=seq,
            nbytes=4 * shape[0] * shape[1],
            shape=shape,
            dtype="float32",
        )
        if op == "send":
            transport.send(rank, peer, tag)
        else:
            transport.recv(peer, rank, tag)
        recorder.p2p_completed(ticket)
