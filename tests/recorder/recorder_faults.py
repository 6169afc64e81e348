"""Custom step functions that misbehave on purpose; imported by the rank processes."""

from __future__ import annotations

import os
import signal
import time

from pipetrace.schedule.ir import Step


def sigkill_rank1_in_iteration1(step: Step, ctx) -> None:
    if ctx.rank == 1 and ctx.iteration == 1 and step.microbatch == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    ctx.default(step)


def sigkill_rank1_after_a_flush(step: Step, ctx) -> None:
    """As above, but only once the background flush (every 0.2 s) has written this step's
    begin: the log then stops inside an open step."""
    if ctx.rank == 1 and ctx.iteration == 1 and step.microbatch == 2:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    ctx.default(step)


def hang_rank2_in_iteration1(step: Step, ctx) -> None:
    if ctx.rank == 2 and ctx.iteration == 1 and step.microbatch == 1:
        while True:  # blocks forever inside a step: only the watchdog ends this
            time.sleep(0.5)
    ctx.default(step)
