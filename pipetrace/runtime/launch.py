"""Start local ranks, collect what they report, and make sure none outlives the run.

Each rank is a fresh Python process (``subprocess``, not ``multiprocessing``: no helper
processes are left behind and the caller's ``__main__`` is not re-imported), joined to a gloo
group on 127.0.0.1 through torch's env:// rendezvous. Nothing of a local run listens beyond
the loopback interface: the rendezvous store's socket is bound to 127.0.0.1 here and handed
to rank 0 (torch's own store would listen on every interface), and gloo is told to use the
loopback interface (``GLOO_SOCKET_IFNAME=lo``). A rank
reads its `WorkerSpec` (pickled) from stdin and reports over a pipe of its own: losses as
they happen, then its results or its error. This process never imports torch.

Failure handling: when a rank fails, its peers usually fail within a second (gloo reports
"connection closed" to anyone waiting on it); a peer blocked elsewhere fails at the
process-group timeout at the latest. The launcher gives survivors ``kill_grace`` seconds
after the first failure to exit on their own (so their recorders can log the error), then
terminates and kills them. Ranks also ask Linux to kill them if the launcher dies. A rank
its watchdog ended is described by its last stall in the run directory (`watchdog_ends`), so
the rank stuck in a step heads the failures, not the first that waited for it.

Ctrl-C: the ranks get the interrupt (from the terminal, and passed on from here), record
where they were and end within `INTERRUPT_GRACE` seconds, or are terminated; the result then
says how many were still running (`LaunchResult.interrupted`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import cast

from pipetrace.recorder import run_dir
from pipetrace.recorder.watchdog import WATCHDOG_EXIT_CODE
from pipetrace.runtime.config import (
    CustomFunction,
    LossCallback,
    RecorderFactory,
    RunConfig,
    WorkerSpec,
)
from pipetrace.runtime.results import LaunchResult, RankFailure, describe_error
from pipetrace.runtime.watchdog_ends import WAITING, last_stall
from pipetrace.schedule.ir import StepKind

_POLL_SECONDS = 0.1
_REPORT_FD_ENV = "PIPETRACE_REPORT_FD"
STORE_FD_ENV = "PIPETRACE_STORE_FD"
"""Rank 0's inherited listening socket for the rendezvous store, -1 on the other ranks
(`torch_backend.init_distributed`)."""
LOOPBACK = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"
_SYS_PATH_ENV = "PIPETRACE_SYS_PATH"


def bootstrap(module: str, function: str) -> list[str]:
    """The command line of a process that runs ``module.function()``. It starts with the
    launcher's sys.path (as multiprocessing does), so that recorder factories and custom
    functions defined next to the caller can be unpickled."""
    code = (
        f"import os, sys; sys.path[:0] = os.environ.pop({_SYS_PATH_ENV!r}).split(os.pathsep); "
        f"from {module} import {function}; {function}()"
    )
    return [sys.executable, "-c", code]


def launcher_env() -> dict[str, str]:
    """This process's environment, plus what `bootstrap` needs and the run id its ranks
    claim their run directory with (`pipetrace.recorder.run_dir`)."""
    return {
        **os.environ,
        _SYS_PATH_ENV: os.pathsep.join(sys.path),
        run_dir.RUN_ID_ENV: run_dir.process_run_id(os.getpid()),
    }


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (rank 0 binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def loopback_listener() -> socket.socket:
    """A listening TCP socket on 127.0.0.1 and a free port, for rank 0's rendezvous store:
    bound here, so that no other interface ever sees the store, and no other process can
    take the port between picking and binding it."""
    return socket.create_server((LOOPBACK, 0), backlog=128)


def launch(
    cases: Sequence[RunConfig],
    *,
    make_recorder: RecorderFactory | None = None,
    custom_functions: Sequence[tuple[StepKind | str, CustomFunction]] = (),
    on_loss: LossCallback | None = None,
    kill_grace: float = 5.0,
) -> LaunchResult:
    """Run ``cases`` one after the other on ``cases[0].world_size`` local ranks of their
    backend: torch ranks in a gloo group, or MindSpore workers with their scheduler
    (`pipetrace.runtime.mindspore.cluster`; ``result.pids`` then also lists the scheduler).

    ``make_recorder`` and ``custom_functions`` go to every rank (see `WorkerSpec`; they
    must be picklable). ``on_loss`` is called here as the reporting rank finishes each step.
    """
    backend = cases[0].backend
    if any(case.backend != backend for case in cases):
        raise ValueError(f"cases in one launch share one backend: {[c.backend for c in cases]}")
    cases[0].check_local_processes()
    world_size, payload = worker_payload(cases, make_recorder, custom_functions)
    result = LaunchResult(world_size)
    if backend == "mindspore":
        from pipetrace.runtime.mindspore.cluster import run_workers

        run_workers(cases, payload, result, on_loss, kill_grace)
    else:
        _run_ranks(payload, result, on_loss, kill_grace)
    _name_the_hang(result, {case.out for case in cases if case.out and case.record != "off"})
    return result


def _name_the_hang(result: LaunchResult, run_dirs: set[str]) -> None:
    """Describe each rank that its watchdog ended, or that was killed still running, by where
    its last stall found it (in the recording in ``run_dirs``), so that the rank stuck in a
    step comes first and those that waited for a peer follow it."""
    watchdog_end = describe_exit(WATCHDOG_EXIT_CODE)
    for i, failure in enumerate(result.failures):
        if failure.error == watchdog_end:
            ended = "its watchdog ended it"
        elif failure.error.startswith(_KILLED):
            ended = f"then {failure.error}"
        else:
            continue
        stalls = (last_stall(d, failure.rank) for d in sorted(run_dirs))
        stuck = next(filter(None, stalls), None)
        if stuck is not None:
            result.failures[i] = dataclasses.replace(failure, error=stuck.describe(ended))
    _order(result.failures)


def _run_ranks(
    payload: bytes, result: LaunchResult, on_loss: LossCallback | None, kill_grace: float
) -> None:
    """Start torch ranks joined through env:// on 127.0.0.1 only, and supervise them."""
    store = loopback_listener()
    env = dict(launcher_env(), MASTER_ADDR=LOOPBACK, MASTER_PORT=str(store.getsockname()[1]))
    env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    command = bootstrap("pipetrace.runtime.launch", "rank_main")
    world_size = result.world_size
    ranks: list[RankProcess] = []
    try:
        for rank in range(world_size):
            rank_env = dict(env, **_torch_rank_env(rank, world_size))
            inherited = (store.fileno(),) if rank == 0 else ()
            rank_env[STORE_FD_ENV] = str(inherited[0] if inherited else -1)
            ranks.append(RankProcess.start(rank, command, rank_env, inherited))
            result.pids.append(ranks[-1].process.pid)
            ranks[-1].send_spec(payload)
        store.close()  # rank 0 holds it now
        supervise(ranks, result, on_loss, kill_grace)
    finally:
        store.close()
        stop(ranks)


def _torch_rank_env(rank: int, world_size: int) -> dict[str, str]:
    """torch's env:// variables of one local rank (MASTER_* are the launch's)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


# Errors a rank gets because a peer died: they say little about the cause, so a rank that
# failed any other way is named first even if its failure was noticed a moment later. So are
# ranks killed while still running. A rank stalled waiting for a peer (how its error begins)
# comes between: in a hang its watchdog ended it first, and the others lost it.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer")
_KILLED = "killed: still running"


def _consequence(failure: RankFailure) -> int:
    """0: a failure of its own; 1: stalled waiting for a peer; 2: lost its peer, or killed."""
    if failure.error.startswith(_KILLED) or any(m in failure.error for m in _PEER_LOST):
        return 2
    return 1 if failure.error.startswith(WAITING) else 0


class RankProcess:
    """One rank's process and the read end of its report pipe."""

    def __init__(self, rank: int, process: subprocess.Popen, reports: Connection) -> None:
        self.rank = rank
        self.process = process
        self.reports = reports

    @classmethod
    def start(
        cls, rank: int, command: list[str], env: dict[str, str], inherited: tuple[int, ...] = ()
    ) -> RankProcess:
        """Start ``command`` as rank ``rank`` with a report pipe (see `run_reported`) and
        the ``inherited`` file descriptors."""
        read_fd, write_fd = os.pipe()
        try:
            process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                env=dict(env, **{_REPORT_FD_ENV: str(write_fd)}),
                pass_fds=(write_fd, *inherited),
            )
        finally:
            os.close(write_fd)
        return cls(rank, process, Connection(read_fd, writable=False))

    def send_spec(self, payload: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(payload)
        self.process.stdin.close()


INTERRUPT_GRACE = 3.0
"""Seconds ranks get after a Ctrl-C to record where they were and end on their own, before
they are terminated."""


class _Supervisor:
    """The reports and exits of a launch's ranks, collected as they come (`supervise`)."""

    def __init__(self, ranks: list[RankProcess], on_loss: LossCallback | None) -> None:
        self.ranks = ranks
        self.on_loss = on_loss
        self.results: dict[int, list] = {}
        self.failed: dict[int, RankFailure] = {}
        self.open_pipes = {rank.reports: rank for rank in ranks}

    def running(self) -> list[RankProcess]:
        return [rank for rank in self.ranks if rank.process.poll() is None]

    def watch(self, kill_grace: float) -> None:
        """Until every rank has ended; ``kill_grace`` seconds after the first failure, stop
        the rest."""
        first_failure_at: float | None = None
        while self.open_pipes or self.running():
            self.read_reports()
            self.note_exits()
            if self.failed and first_failure_at is None:
                first_failure_at = time.monotonic()
            if first_failure_at is not None and time.monotonic() - first_failure_at > kill_grace:
                self.stop_survivors(kill_grace)

    def read_reports(self) -> None:
        """What the ranks said in the last poll interval."""
        if not self.open_pipes:
            time.sleep(_POLL_SECONDS)
            return
        for pipe in cast("list[Connection]", wait(list(self.open_pipes), timeout=_POLL_SECONDS)):
            rank = self.open_pipes[pipe]
            try:
                kind, payload = pipe.recv()
            except (EOFError, OSError):  # the rank closed its pipe: it has said all it will
                del self.open_pipes[pipe]
                pipe.close()
                continue
            if kind == "loss":
                if self.on_loss is not None:
                    self.on_loss(*payload)
            elif kind == "done":
                self.results[rank.rank] = payload
            elif kind == "error":
                self.failed[rank.rank] = payload

    def note_exits(self) -> None:
        """A rank that ended badly without reporting why fails with its exit status."""
        now = time.time()
        for rank in self.ranks:
            code = rank.process.poll()
            silent = rank.rank not in self.failed and rank.reports not in self.open_pipes
            if code not in (None, 0) and silent:
                self.failed[rank.rank] = RankFailure(rank.rank, describe_exit(code), at=now)

    def stop_survivors(self, kill_grace: float) -> None:
        first = min(self.failed.values(), key=lambda f: f.at)
        now = time.time()
        for rank in self.running():
            if rank.rank not in self.failed:
                self.failed[rank.rank] = RankFailure(
                    rank.rank,
                    f"{_KILLED} {kill_grace:g} s after rank {first.rank} failed",
                    at=now,
                )
        self.close()

    def wind_down(self, grace: float, signum: int = signal.SIGINT) -> int:
        """After a Ctrl-C (or a SIGTERM, ``signum``): pass it on to the ranks still running
        (those in this process group had it too; a rank takes the first Ctrl-C and ignores
        repeats), give them ``grace`` seconds to record where they were and end, then stop
        the rest. A second Ctrl-C stops them at once. Returns how many ranks were running."""
        running = self.running()
        for rank in running:
            rank.process.send_signal(signum)
        deadline = time.monotonic() + grace
        try:
            while self.running() and time.monotonic() < deadline:
                time.sleep(_POLL_SECONDS)
        except KeyboardInterrupt:
            pass
        self.close()
        return len(running)

    def close(self) -> None:
        """Stop every rank still running, then stop listening (a rank never writes to a
        closed pipe: it is gone first)."""
        stop(self.ranks)
        for pipe in self.open_pipes:
            pipe.close()
        self.open_pipes.clear()


def supervise(
    ranks: list[RankProcess], result: LaunchResult, on_loss: LossCallback | None, kill_grace: float
) -> None:
    """Collect the ranks' reports into ``result`` until every rank has ended; ``kill_grace``
    seconds after the first failure, stop the rest. Failures end up earliest first, those
    caused by a lost peer last. A Ctrl-C (KeyboardInterrupt here) winds the ranks down and
    sets ``result.interrupted``."""
    supervisor = _Supervisor(ranks, on_loss)
    try:
        with _sigterm_raises():
            supervisor.watch(kill_grace)
    except KeyboardInterrupt:
        result.interrupted = supervisor.wind_down(INTERRUPT_GRACE)
    except _Terminated:
        result.interrupted = supervisor.wind_down(INTERRUPT_GRACE, signal.SIGTERM)
        result.interrupted_by = "SIGTERM"
    result.results.update(supervisor.results)
    result.failures.extend(supervisor.failed.values())
    _order(result.failures)


class _Terminated(BaseException):
    """SIGTERM reached the launcher (a scheduler's time limit, `timeout`): like a Ctrl-C, it
    winds the ranks down so that each records where it was, instead of the launcher dying at
    once and the kernel killing its ranks (PR_SET_PDEATHSIG) before they record anything."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Inside, SIGTERM raises `_Terminated` in the main thread (elsewhere: left as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _order(failures: list[RankFailure]) -> None:
    """Earliest first; a stalled rank after those, the ranks that lost a peer last."""
    failures.sort(key=lambda failure: (_consequence(failure), failure.at))


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == WATCHDOG_EXIT_CODE:
        return "ended by its watchdog: no progress (its stall and stacks are in the trace)"
    return f"exited with code {code} without reporting an error"


def stop(ranks: list[RankProcess], grace: float = 2.0) -> None:
    """SIGTERM every live rank, SIGKILL what is left after ``grace`` seconds, reap all."""
    for rank in ranks:
        if rank.process.poll() is None:
            rank.process.terminate()
    deadline = time.monotonic() + grace
    for rank in ranks:
        try:
            rank.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank.process.kill()
            rank.process.wait()


def worker_payload(
    cases: Sequence[RunConfig],
    make_recorder: RecorderFactory | None,
    custom_functions: Sequence[tuple[StepKind | str, CustomFunction]],
) -> tuple[int, bytes]:
    """The world size of ``cases`` (one for all: they share one process group) and the
    pickled `WorkerSpec` every rank reads from its stdin."""
    world_size = cases[0].world_size
    if any(case.world_size != world_size for case in cases):
        raise ValueError(
            f"cases in one launch share one process group: {[c.world_size for c in cases]} "
            "processes"
        )
    spec = WorkerSpec(
        tuple(cases),
        make_recorder,
        tuple((StepKind(kind), fn) for kind, fn in custom_functions),
        threads_per_rank=max(1, (os.cpu_count() or 1) // world_size),
    )
    return world_size, pickle.dumps(spec)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the launcher) dies."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os._exit(1)


def rank_main() -> None:
    """Entry point of a rank process started by `launch`."""
    die_with_parent()
    if not run_reported(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])):
        # Leave at once: the failure is recorded and reported, and the interpreter's
        # finalisation would wait for P2P work that no peer will complete (a rank
        # interrupted inside a send stays alive until it is killed).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _interrupt_once(signum: int, frame: object) -> None:
    """A rank's SIGINT handler: the first Ctrl-C interrupts it (KeyboardInterrupt, which its
    recorder logs where it stopped); the launcher passes the same Ctrl-C on, and that repeat
    must not interrupt the rank's report of the first."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def run_reported(rank: int, world_size: int) -> bool:
    """Run this process's rank of the launcher's cases (the `WorkerSpec` on stdin) with the
    demo worker (`pipetrace.runtime.worker`), and report over the launcher's pipe: each loss,
    then the results or the failure. Returns whether the rank succeeded."""
    reports = Connection(int(os.environ.pop(_REPORT_FD_ENV)), readable=False)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # as its launcher was started
        signal.signal(signal.SIGINT, _interrupt_once)
    try:
        spec: WorkerSpec = pickle.loads(sys.stdin.buffer.read())
        from pipetrace.runtime.worker import run_rank

        results = run_rank(rank, world_size, spec, lambda *loss: reports.send(("loss", loss)))
    except BaseException as exc:
        failure = RankFailure(rank, describe_error(exc), traceback.format_exc(), time.time())
        with contextlib.suppress(OSError):  # the launcher is gone: nobody to tell
            reports.send(("error", failure))
        return False
    else:
        reports.send(("done", results))
        return True
    finally:
        reports.close()
