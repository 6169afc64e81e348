"""Small recorded runs for the TUI tests, made by driving the real Recorder.

`record_plan` walks every rank's plan in one thread with eager sends (a recv waits until its
message was sent), one `Recorder` per rank, so the logs are exactly what the recorder writes.
A plan whose ranks wait on each other leaves them blocked in their recvs (a deadlock); a
``crash_at`` rank raises at that step and records the exception.
"""

from __future__ import annotations

import time
from pathlib import Path

from pipetrace.recorder.recorder import Recorder
from pipetrace.recorder.setup import RecordSettings
from pipetrace.schedule.builders import build_plan
from pipetrace.schedule.ir import RECV_KINDS, SEND_KINDS, Plan, StepKind, parse_step

_PEER_STAGE = {StepKind.SEND_F: 1, StepKind.RECV_F: -1, StepKind.SEND_B: -1, StepKind.RECV_B: 1}


def _message(step) -> tuple[str, int, int]:
    """(channel, sending stage, micro-batch) of a SEND or RECV step."""
    ch = step.kind.value[-1]
    sender = step.stage if step.kind in SEND_KINDS else step.stage + _PEER_STAGE[step.kind]
    return ch, sender, step.microbatch


def record_plan(
    run_dir: Path,
    plan: Plan,
    *,
    iterations: int = 1,
    compute_s: float = 0.002,
    crash_at: tuple[int, int] | None = None,
    config: dict | None = None,
    stall_s: float = 0.2,
) -> Path:
    """Record ``plan``; ranks left blocked get a watchdog ``stall`` after ``stall_s``."""
    world = plan.num_ranks
    recorders = [
        Recorder(
            RecordSettings(run_dir, stall_timeout=stall_s, abort_timeout=0, flush_interval=0.05),
            framework="none",
            framework_version="0",
        )
        for _ in range(world)
    ]
    for rank, rec in enumerate(recorders):
        rec.begin_run(rank=rank, world_size=world, plan=plan, config=config or {"test": "tui"})
    steps = [plan.steps(r) for r in range(world)]
    dead = set()
    for it in range(iterations):
        for rec in recorders:
            rec.begin_iteration(it)
        sent: set[tuple[str, int, int]] = set()
        seqs: dict[tuple[int, str, int, str], int] = {}
        pos = [0] * world
        waiting: dict[int, tuple] = {}
        while True:
            progressed = False
            for rank in range(world):
                if rank in dead:
                    continue
                rec = recorders[rank]
                while pos[rank] < len(steps[rank]):
                    k = pos[rank]
                    step = steps[rank][k]
                    if crash_at == (rank, k):
                        token = rec.begin_step(k, step)
                        try:
                            raise RuntimeError(f"injected failure in {step}")
                        except RuntimeError as exc:
                            rec.exception(exc)
                        dead.add(rank)
                        break
                    if step.kind in RECV_KINDS:
                        if rank not in waiting:
                            token = rec.begin_step(k, step)
                            ticket = _post(rec, plan, step, "recv", seqs, rank)
                            waiting[rank] = (token, ticket)
                        if _message(step) not in sent:
                            break
                        token, ticket = waiting.pop(rank)
                        rec.p2p_completed(ticket)
                        rec.end_step(token)
                    elif step.kind in SEND_KINDS:
                        token = rec.begin_step(k, step)
                        ticket = _post(rec, plan, step, "send", seqs, rank)
                        sent.add(_message(step))
                        rec.p2p_completed(ticket)
                        rec.end_step(token)
                    elif step.sub_steps:
                        token = rec.begin_step(k, step)
                        forward, backward = step.sub_steps
                        t_f = rec.begin_step(k, forward)
                        t_b = rec.begin_step(k, backward, thread="overlap")
                        time.sleep(compute_s)
                        rec.end_step(t_f)
                        time.sleep(compute_s)
                        rec.end_step(t_b)
                        rec.end_step(token)
                    else:
                        token = rec.begin_step(k, step)
                        time.sleep(compute_s * (2 if step.kind is StepKind.B else 1))
                        rec.end_step(token)
                    pos[rank] += 1
                    progressed = True
            if all(pos[r] == len(steps[r]) or r in dead for r in range(world)) or not progressed:
                break
        stuck = [r for r in range(world) if pos[r] < len(steps[r])]
        if stuck:
            break
        for rank, rec in enumerate(recorders):
            rec.end_iteration(it, 0.5 if rank == plan.placement[-1] else None)
    if stuck:
        time.sleep(stall_s * 2.5)  # the watchdogs see no progress and record a stall
    for rank, rec in enumerate(recorders):
        if stuck or rank in dead:
            rec.close()  # no run_end: the log just stops, as when the job is killed
        else:
            rec.end_run()
    return run_dir


def _post(rec: Recorder, plan: Plan, step, op: str, seqs: dict, rank: int) -> object:
    peer = plan.placement[step.stage + _PEER_STAGE[step.kind]]
    ch = step.kind.value[-1]
    key = (rank, op, peer, ch)
    seq = seqs.get(key, 0)
    seqs[key] = seq + 1
    return rec.p2p_posted(
        op=op,
        step=step,
        peer=peer,
        channel=ch,
        seq=seq,
        nbytes=4096,
        shape=(32, 32),
        dtype="float32",
    )


def deadlock_plan() -> Plan:
    """Two ranks that each wait to receive before sending what the other needs."""
    rows = [
        ["0F0", "0SEND_F0", "0RECV_B0", "0F1", "0SEND_F1", "0B0", "0RECV_B1", "0B1"],
        ["1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"],
    ]
    return Plan(2, (0, 1), [[parse_step(t) for t in row] for row in rows], name="1f1b-misordered")


def clean_plan(schedule: str = "1f1b", ranks: int = 4, microbatches: int = 4, **kw) -> Plan:
    return build_plan(schedule, num_ranks=ranks, num_microbatches=microbatches, comms=True, **kw)
