"""Test runs recorded through the real Recorder: real log files through the real writer.

Ranks run as threads of the test process and exchange messages through an in-process
fabric that behaves like isend/irecv: a send completes at once (buffered), a recv completes
once the matching send was posted. Scenarios:

- ``clean``: every rank runs its plan;
- ``deadlock``: in the last iteration rank 0 runs its ``SEND_F`` of micro-batch 1 without
  posting it, so rank 1 blocks in that recv and rank 0 later blocks in a recv of its own;
- ``stuck``: in the last iteration rank 1 never ends its first backward step (a step that
  never returns); rank 0 blocks waiting for its gradient;
- ``crash``: in the last iteration rank 1 raises in its first backward step.

A recv of the faulty iteration that waits ``wait_s`` seconds in vain leaves its rank hung
(the step and the op stay open, the log ends without run_end); other recvs wait long.

``overlap`` posts every recv at the start of the iteration and waits for it where it is
consumed, and drains sends at the iteration end (several ops in flight at once); composite
``OVERLAP_F_B`` steps record their forward on ``main`` and their backward on ``overlap``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pipetrace.recorder.recorder import Recorder
from pipetrace.recorder.setup import RecordSettings
from pipetrace.schedule.builders import build_plan
from pipetrace.schedule.ir import COMM_KINDS, RECV_KINDS, SEND_KINDS, Plan, Step, StepKind

_DIRECTION = {
    StepKind.SEND_F: ("send", "F", 1),
    StepKind.SEND_B: ("send", "B", -1),
    StepKind.RECV_F: ("recv", "F", -1),
    StepKind.RECV_B: ("recv", "B", 1),
}


class _Fabric:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._sent: set[tuple] = set()

    def send(self, key: tuple) -> None:
        with self._cond:
            self._sent.add(key)
            self._cond.notify_all()

    def wait(self, key: tuple, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: key in self._sent, timeout)


class _Hang(Exception):
    """This rank stops here, leaving its open step and ops open (its log just ends)."""


def record_run(
    run_dir: Path,
    *,
    schedule: str = "1f1b",
    ranks: int = 2,
    microbatches: int = 4,
    iterations: int = 2,
    scenario: str = "clean",
    overlap: bool = False,
    step_s: float = 0.0003,
    wait_s: float = 0.4,
) -> Plan:
    plan = build_plan(schedule, num_ranks=ranks, num_microbatches=microbatches, comms=True)
    fabric = _Fabric()
    config = {"scenario": scenario, "p2p": "overlap" if overlap else "plain", "schedule": schedule}
    recorders = [
        Recorder(
            RecordSettings(run_dir, stall_timeout=0, flush_interval=0.05),
            framework="none",
            framework_version="0",
        )
        for _ in range(ranks)
    ]
    recorders[0].begin_run(
        rank=0, world_size=ranks, plan=plan, config=config
    )  # writes meta.json first
    for r in range(1, ranks):
        recorders[r].begin_run(rank=r, world_size=ranks, plan=plan, config=config)
    threads = [
        threading.Thread(
            target=_rank,
            args=(recorders[r], plan, r, fabric, scenario, overlap, iterations, step_s, wait_s),
        )
        for r in range(ranks)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return plan


def _rank(
    rec: Recorder,
    plan: Plan,
    rank: int,
    fabric: _Fabric,
    scenario: str,
    overlap: bool,
    iterations: int,
    step_s: float,
    wait_s: float,
) -> None:
    steps = plan.steps(rank)
    last_stage = len(plan.placement) - 1
    try:
        for it in range(iterations):
            faulty = it == iterations - 1
            rec.begin_iteration(it)
            keys = _message_keys(plan, rank, steps, it)
            tickets = {}
            if overlap:
                for pos, step in enumerate(steps):
                    if step.kind in RECV_KINDS:
                        tickets[pos] = _post(rec, step, keys[pos])
            drain = []
            first_backward = True
            for pos, step in enumerate(steps):
                token = rec.begin_step(pos, step)
                if step.kind in SEND_KINDS:
                    if (
                        scenario == "deadlock"
                        and faulty
                        and rank == 0
                        and step.kind is StepKind.SEND_F
                        and step.microbatch == 1
                    ):
                        pass  # the bug: the send is never posted
                    else:
                        ticket = _post(rec, step, keys[pos])
                        fabric.send(keys[pos][3])
                        if overlap:
                            drain.append(ticket)
                        else:
                            rec.p2p_completed(ticket)
                elif step.kind in RECV_KINDS:
                    ticket = tickets[pos] if overlap else _post(rec, step, keys[pos])
                    # only the faulty iteration of a faulty scenario can wait in vain:
                    # elsewhere, wait long
                    patient = scenario == "clean" or not faulty
                    if not fabric.wait(keys[pos][3], 30.0 if patient else wait_s):
                        raise _Hang
                    rec.p2p_completed(ticket)
                elif step.sub_steps:
                    subs = [
                        rec.begin_step(pos, sub, "main" if sub.kind is StepKind.F else "overlap")
                        for sub in step.sub_steps
                    ]
                    time.sleep(step_s)
                    for sub in subs:
                        rec.end_step(sub)
                else:
                    if (
                        faulty
                        and rank == 1
                        and step.kind in (StepKind.B, StepKind.I)
                        and first_backward
                    ):
                        first_backward = False
                        if scenario == "stuck":
                            time.sleep(step_s)
                            raise _Hang
                        if scenario == "crash":
                            try:
                                raise RuntimeError("injected failure in the backward")
                            except RuntimeError as exc:
                                rec.exception(exc)
                            raise _Hang from None
                    time.sleep(step_s)
                rec.end_step(token)
            for ticket in drain:
                rec.p2p_completed(ticket)
            rec.end_iteration(it, 0.5 if last_stage in plan.stages_of(rank) else None)
        rec.end_run()
    except _Hang:
        pass
    finally:
        rec.close()


def _message_keys(plan: Plan, rank: int, steps: list[Step], it: int) -> dict[int, tuple]:
    """Per comm position: (op, peer, channel, fabric key, seq)."""
    seqs: dict[tuple, int] = {}
    out = {}
    for pos, step in enumerate(steps):
        if step.kind not in COMM_KINDS:
            continue
        op, ch, direction = _DIRECTION[step.kind]
        peer = plan.placement[step.stage + direction]
        seq = seqs.get((op, peer, ch), 0)
        seqs[(op, peer, ch)] = seq + 1
        src, dst = (rank, peer) if op == "send" else (peer, rank)
        out[pos] = (op, peer, ch, (src, dst, it, ch, seq), seq)
    return out


def _post(rec: Recorder, step: Step, key: tuple):
    op, peer, ch, _, seq = key
    return rec.p2p_posted(
        op=op,
        step=step,
        peer=peer,
        channel=ch,
        seq=seq,
        nbytes=4 * 64,
        shape=(4, 16),
        dtype="float32",
    )


@dataclass(frozen=True)
class TorchRecording:
    """Recorder factory for `pipetrace.runtime.launch`: the real torch recorder writing into
    ``run_dir`` (picklable: each rank process unpickles it)."""

    run_dir: str

    def __call__(self, rank: int, world_size: int):
        from pipetrace.recorder.setup import RecordSettings, torch_recorder

        return torch_recorder(RecordSettings(run_dir=self.run_dir, flush_interval=0.05))


def record_torch_run(
    run_dir: Path,
    *,
    schedule: str,
    ranks: int = 2,
    microbatches: int = 4,
    steps: int = 1,
    overlap_p2p: bool = False,
):
    """A run of the real torch runtime (gloo on local rank processes), recorded."""
    from pipetrace.runtime.config import RunConfig
    from pipetrace.runtime.launch import launch

    config = RunConfig(
        schedule,
        ranks=ranks,
        microbatches=microbatches,
        steps=steps,
        overlap_p2p=overlap_p2p,
        timeout=30.0,
        out=str(run_dir),
    )
    return launch([config], make_recorder=TorchRecording(str(run_dir)), kill_grace=2.0)
