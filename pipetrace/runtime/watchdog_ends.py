"""What a rank's watchdog found when it ended the rank: the launcher's headline after a hang.

A rank ended by its watchdog (`WATCHDOG_EXIT_CODE`) reports nothing over its pipe: it is
stuck, and the watchdog ends the process from its own thread. Its `stall` event in the run
directory says where it was. Every rank of a hung pipeline stalls, most of them waiting in a
send or recv for a peer; the one stuck elsewhere (inside a compute step, between steps) is
the hang, and the launcher names it first, with its step, whether its watchdog ended it or
the launcher killed it after a peer's end.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import orjson

from pipetrace.recorder import format as fmt
from pipetrace.recorder.watchdog import main_thread_waits
from pipetrace.schedule.ir import ScheduleError, StepKind, parse_step

TAIL_BYTES = 4 << 20
"""How much of the end of a rank log is searched for its last stall (a stall with every
thread's stack is a few KiB)."""

WAITING = "waiting for "
"""How the description of a rank that stalled waiting on peers begins: it follows the hang."""


@dataclass(frozen=True)
class Stuck:
    """Where a rank's watchdog last found it stalled."""

    step: str | None
    """The innermost open step, None between steps."""
    iteration: int | None
    peer: int | None
    """The rank it waits for (its open step's P2P op in flight), None when it waits for none."""
    idle_s: float
    waiting_in: str | None
    """A collective outside iterations (the end-of-run clock exchange), if it waits in one."""

    def describe(self, ended: str) -> str:
        """The launcher's description of the rank's end; ``ended`` says what ended it."""
        where = f" in step {self.step}" if self.step else ""
        if self.step and self.iteration is not None:
            where += f" (iteration {self.iteration})"
        idle = f"no progress for {self.idle_s:.0f} s"
        if self.peer is not None:
            return f"{WAITING}rank {self.peer}{where}, {idle} ({ended})"
        if self.waiting_in:
            return f"{WAITING}its peers in {self.waiting_in}, {idle} ({ended})"
        return f"hung{where or ' between steps'}: {idle} ({ended}; stall and stacks in the trace)"


def last_stall(run_dir: str | Path, rank: int) -> Stuck | None:
    """The last `stall` event in the rank's log under ``run_dir``; None without one."""
    try:
        with open(fmt.rank_log_path(run_dir, rank), "rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(0, size - TAIL_BYTES))
            tail = log.read()
    except OSError:
        return None
    marker = b'{"e":"%s"' % fmt.STALL.encode()
    for line in reversed(tail.splitlines()):
        if line.startswith(marker):
            try:
                return _stuck(orjson.loads(line))
            except (orjson.JSONDecodeError, TypeError, ValueError, KeyError):
                return None
    return None


def _stuck(stall: dict) -> Stuck:
    open_steps = [s for s in stall.get("open_steps") or [] if isinstance(s, dict)]
    step = open_steps[-1] if open_steps else {}
    text = step.get("step") if isinstance(step.get("step"), str) else None
    inflight = [
        op
        for op in stall.get("inflight") or []
        if isinstance(op, dict) and isinstance(op.get("peer"), int)
    ]
    peers = [op["peer"] for op in inflight if op.get("step") == text]
    waiting_in = stall.get("waiting_in")
    if text is not None and not peers and main_thread_waits(stall.get("stacks")):
        peers = _feeding_peers(text, inflight)
        if not peers and _joins_replicas(text):
            waiting_in = f"{text}, a collective over the replicas"
    iteration = step.get("it")
    return Stuck(
        text,
        iteration if isinstance(iteration, int) else None,
        peers[0] if text is not None and peers else None,
        float(stall.get("idle_s") or 0.0),
        waiting_in if isinstance(waiting_in, str) else None,
    )


def _feeding_peers(text: str, inflight: list[dict]) -> list[int]:
    """The peers of the recvs in flight for the stage and micro-batch of the compute step
    ``text``: overlap mode waits a step's recv inside the step."""
    wanted = _stage_and_microbatch(text)
    return [
        op["peer"]
        for op in inflight
        if wanted is not None
        and op.get("op") == "recv"
        and _stage_and_microbatch(str(op.get("step"))) == wanted
    ]


def _joins_replicas(text: str) -> bool:
    """FSDP's gradient reduce-scatter and parameter all-gather wait for every replica."""
    try:
        step = parse_step(text)
    except ScheduleError:
        return False
    return step is not None and step.kind in (StepKind.REDUCE_GRAD, StepKind.UNSHARD)


def _stage_and_microbatch(text: str) -> tuple[int, int] | None:
    try:
        step = parse_step(text)
    except ScheduleError:
        return None
    if step is None or step.stage is None or step.microbatch is None:
        return None
    return step.stage, step.microbatch
