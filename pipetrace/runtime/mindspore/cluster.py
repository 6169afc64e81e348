"""Start a local MindSpore cluster (one scheduler, one worker per rank), collect what the
workers report, and make sure no process outlives the run.

MindSpore's CPU backend (mccl) needs a scheduler process that the workers register with;
``msrun`` would start it, but msrun starts workers with the ``python`` on PATH, not this
interpreter. So this module starts every process itself with ``sys.executable``, configured
by MindSpore's environment variables: ``MS_ROLE`` (MS_SCHED or MS_WORKER), ``MS_SCHED_HOST``
(127.0.0.1), ``MS_SCHED_PORT`` (a free port picked here), ``MS_WORKER_NUM`` and, per worker,
``MS_NODE_ID``/``RANK_ID``. ``MS_CPU_COMM_OP_TIMEOUT`` and ``MS_TOPO_TIMEOUT`` carry
``--timeout`` (a P2P wait on a peer, and joining the cluster, fail after about that many
seconds).

`pipetrace.runtime.launch.launch` starts MindSpore cases here (`run_workers`). Workers are
supervised exactly as torch ranks are (`pipetrace.runtime.launch`: the same
report pipe, the same grace after a first failure, then SIGTERM and SIGKILL; every process
asks Linux to kill it if the launcher dies). The scheduler is not a rank: it is stopped once
the workers are gone (it would otherwise wait for their unregistration), and if it dies while
they still run, the launch fails with its exit code and the tail of its log.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from pipetrace.errors import EXIT_PROBLEMS, PipetraceError
from pipetrace.runtime.config import LossCallback, RunConfig
from pipetrace.runtime.launch import (
    RankProcess,
    bootstrap,
    die_with_parent,
    free_port,
    launch,
    launcher_env,
    run_reported,
    stop,
    supervise,
)
from pipetrace.runtime.results import LaunchResult

# `launch` (from pipetrace.runtime.launch, which comes here for MindSpore cases) is what
# `pipetrace run --backend mindspore` calls.
__all__ = ["launch", "run_workers", "scheduler_main", "worker_main"]

# MindSpore logs every cluster-building retry as a WARNING; keep errors unless the user chose.
_QUIET_LOGS = {"GLOG_v": "3"}
_EXIT_DEADLINE = 60  # seconds a worker may take to leave the cluster after it reported


def run_workers(
    cases: Sequence[RunConfig],
    payload: bytes,
    result: LaunchResult,
    on_loss: LossCallback | None,
    kill_grace: float,
) -> None:
    """Start the scheduler and one worker per rank, and supervise them (for
    `pipetrace.runtime.launch.launch`). Raises PipetraceError (exit 1) if the scheduler fails
    while workers run."""
    world_size = result.world_size
    env = _cluster_env(world_size, free_port(), max(case.timeout for case in cases))
    ranks: list[RankProcess] = []
    with tempfile.TemporaryDirectory(prefix="pipetrace-ms-") as scratch:
        log_path = Path(scratch) / "scheduler.log"
        scheduler = _start_scheduler(env, log_path)
        result.pids.append(scheduler.pid)
        watch = _SchedulerWatch(scheduler, ranks)
        try:
            for rank in range(world_size):
                worker_env = dict(env, MS_ROLE="MS_WORKER", MS_NODE_ID=str(rank), RANK_ID=str(rank))
                command = bootstrap(__name__, "worker_main")
                ranks.append(RankProcess.start(rank, command, worker_env))
                result.pids.append(ranks[-1].process.pid)
                ranks[-1].send_spec(payload)
            watch.start()
            supervise(ranks, result, on_loss, kill_grace)
        finally:
            watch.stop()
            stop(ranks)
            _stop_process(scheduler)
        # a Ctrl-C or SIGTERM to the job's process group ends the scheduler too: that is the
        # interrupt, which the launch reports, not a failure of the scheduler
        if watch.failed_with is not None and result.interrupted is None:
            raise PipetraceError(
                f"MindSpore's scheduler exited with code {watch.failed_with} while workers were "
                f"running: {_tail(log_path)}",
                exit_code=EXIT_PROBLEMS,
            )


def _cluster_env(world_size: int, port: int, timeout: float) -> dict[str, str]:
    env = {**_QUIET_LOGS, **launcher_env()}
    env.update(
        MS_SCHED_HOST="127.0.0.1",
        MS_SCHED_PORT=str(port),
        MS_WORKER_NUM=str(world_size),
        MS_CPU_COMM_OP_TIMEOUT=str(max(1, math.ceil(timeout))),
        MS_TOPO_TIMEOUT=str(max(1, math.ceil(timeout))),  # joining the cluster
    )
    for name in ("MS_ROLE", "MS_NODE_ID", "RANK_ID", "RANK_SIZE"):
        env.pop(name, None)  # from an enclosing MindSpore job: they would confuse ours
    return env


def _start_scheduler(env: dict[str, str], log_path: Path) -> subprocess.Popen:
    # The scheduler's log is kept aside (it is noisy) and shown only if it fails.
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            bootstrap(__name__, "scheduler_main"),
            env=dict(env, MS_ROLE="MS_SCHED"),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


class _SchedulerWatch:
    """Notices the scheduler dying while workers run, and stops the workers then (without a
    scheduler they would wait for it until MindSpore's own, much longer, timeouts)."""

    def __init__(self, scheduler: subprocess.Popen, ranks: list[RankProcess]) -> None:
        self.scheduler = scheduler
        self.ranks = ranks
        self.failed_with: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="pipetrace-ms-scheduler", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(0.2):
            code = self.scheduler.poll()
            if code is None:
                continue
            if code != 0 and any(rank.process.poll() is None for rank in self.ranks):
                self.failed_with = code
                stop(self.ranks)
            return


def _stop_process(process: subprocess.Popen, grace: float = 2.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) if text else "(empty log)"


# -- inside the started processes ------------------------------------------------------------


def scheduler_main() -> None:
    """Entry point of the scheduler process: MindSpore's ``init()`` in the MS_SCHED role
    serves the cluster until the workers leave (or the launcher stops it)."""
    die_with_parent()
    from mindspore.communication import init

    init()


def worker_main() -> None:
    """Entry point of a worker process started by `launch`."""
    die_with_parent()
    rank, world_size = int(os.environ["MS_NODE_ID"]), int(os.environ["MS_WORKER_NUM"])
    if not run_reported(rank, world_size):
        # Leave at once: MindSpore's finalisation at exit would wait for peers that may be
        # stuck or gone; the launcher stops them and the scheduler.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # A clean exit runs MindSpore's finalisation, which unregisters this worker from the
    # scheduler and lets its last messages leave (with os._exit here, one run in a few lost
    # the other worker to a SIGTERM at the very end). Should it hang, SIGALRM ends it.
    # The rank has said all it will: the finalisation's log lines (INFO, whatever GLOG_v
    # says) are not shown.
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    signal.alarm(_EXIT_DEADLINE)
