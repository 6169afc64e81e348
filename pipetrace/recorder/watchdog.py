"""The per-rank watchdog: a hung rank still explains itself, and still ends.

A rank stuck inside a C call (a gloo recv, say) never returns to Python bytecode, so Python
signal handlers and in-thread checks cannot run there. The watchdog therefore lives on its own
thread and learns of signals through `signal.set_wakeup_fd`: CPython's C-level handler writes
the signal number to a socket this thread selects on, whatever the main thread is doing.

- No progress (no recorded event) for ``stall_timeout`` seconds inside an iteration: record a
  ``stall`` event with every thread's stack, the open steps and the P2P ops in flight, flush,
  and print one line to stderr.
- Still none ``abort_timeout`` seconds later: record ``abort``, flush and end the process
  with exit code `WATCHDOG_EXIT_CODE`.
- SIGUSR1: record a ``dump`` event (same content) and carry on.
- SIGTERM (only when the program left it at the default): record ``signal``, flush, exit 143.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from pipetrace.recorder import format as fmt

if TYPE_CHECKING:
    from pipetrace.recorder.recorder import Recorder

WATCHDOG_EXIT_CODE = 3


def thread_stacks() -> dict[str, list[str]]:
    """Every Python thread's stack, innermost frame last, keyed by 'name (ident)'."""
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks: dict[str, list[str]] = {}
    for ident, frame in sys._current_frames().items():
        frames = traceback.extract_stack(frame)
        key = f"{names.get(ident, 'thread')} ({ident})"
        stacks[key] = [
            f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}" for f in frames
        ]
    return stacks


P2P_WAIT_FRAME = re.compile(
    r"distributed_c10d\.py|/pipetrace/runtime/(mindspore/)?p2p\w*\.py"
    r"|/pipetrace/torch_pipelining/messages\.py|\bin (wait|_wait\w*|complete)\b"
)
"""A stack frame of a P2P wait: torch.distributed's, the pipetrace runtimes' P2P modules, the
torch_pipelining adapter's (its wrapper of torch's ``_wait_batch_p2p`` waits each work), or a
function named for waiting."""


UNSHARD_WAIT_FRAME = re.compile(r" in (wait_for_unshard|wait_unshard): ")
"""A frame of a wait for FSDP's parameter all-gather over the replicas (torch's own, or
pipetrace's runtime waiting it inside a forward or backward)."""


def _main_frames(stacks: object) -> list[Any] | None:
    """The main thread's frames in ``stacks`` (as `thread_stacks` records them in a
    `stall`), innermost last; None when they do not show the main thread."""
    if not isinstance(stacks, dict):
        return None
    main = next((v for k, v in stacks.items() if str(k).startswith("MainThread")), None)
    return main if isinstance(main, list) and main else None


def main_thread_in(stacks: object, frame: re.Pattern[str]) -> bool:
    """Whether any frame of the main thread in ``stacks`` matches ``frame``."""
    main = _main_frames(stacks) or []
    return any(isinstance(f, str) and frame.search(f) for f in main)


def main_thread_waits(stacks: object) -> bool | None:
    """Whether the main thread's innermost frame in ``stacks`` is a P2P wait; None when they
    do not show the main thread. A rank whose step waits its recv inside the step (overlap
    mode) is stuck in its own code, not in the transfer, when this is False."""
    main = _main_frames(stacks)
    if main is None or not isinstance(main[-1], str):
        return None
    return P2P_WAIT_FRAME.search(main[-1]) is not None


class Watchdog:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        config = recorder.config
        self.stall_timeout = config.stall_timeout
        self.abort_timeout = config.abort_timeout
        self.poll_interval = min(1.0, max(0.05, self.stall_timeout / 4))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipetrace-watchdog", daemon=True)
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._exiting = threading.Lock()

    def start(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._install_signal_handling()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self._uninstall_signal_handling()

    # -- signals ---------------------------------------------------------------------------

    def _install_signal_handling(self) -> None:
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        previous_fd = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        if previous_fd != -1:
            # Someone (asyncio, say) owns the wakeup fd: give it back and rely on Python-level
            # handlers, which run once the main thread is back in bytecode.
            signal.set_wakeup_fd(previous_fd)
            self._wake_r.close()
            self._wake_w.close()
            self._wake_r = self._wake_w = None
        self._previous_handlers[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_usr1)
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._previous_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_term)

    def _uninstall_signal_handling(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()
        if self._wake_w is not None:
            signal.set_wakeup_fd(-1)
            self._wake_r.close()
            self._wake_w.close()
            self._wake_r = self._wake_w = None

    def _on_usr1(self, signum: int, frame: Any) -> None:
        if self._wake_r is None:  # no wakeup fd: this handler does the work itself
            self.dump(fmt.DUMP, reason="SIGUSR1")

    def _on_term(self, signum: int, frame: Any) -> None:
        self._terminate(signum)

    def _terminate(self, signum: int) -> None:
        if not self._exiting.acquire(blocking=False):
            return
        self.recorder.record_event(
            fmt.SIGNAL,
            signal=signal.Signals(signum).name,
            open_steps=self.recorder.describe_open_steps(),
        )
        os._exit(128 + signum)

    # -- the watch loop --------------------------------------------------------------------

    def _run(self) -> None:
        stalled_at_progress: int | None = None
        stalled_since = 0.0
        while not self._stop.is_set():
            self._wait_for_signal_or_timeout()
            if self._stop.is_set():
                return
            recorder = self.recorder
            progress = recorder.last_progress
            idle = (recorder.clock.monotonic_ns() - progress) / 1e9  # progress's own clock
            if not recorder.watched or idle < self.stall_timeout:
                stalled_at_progress = None
                continue
            if stalled_at_progress != progress:
                stalled_at_progress = progress
                stalled_since = time.monotonic()
                self.dump(fmt.STALL, idle_s=round(idle, 3))
                self._say(
                    f"no progress for {idle:.0f} s{self._where()}; stacks recorded in "
                    f"{recorder.config.run_dir}"
                )
            elif self.abort_timeout > 0 and time.monotonic() - stalled_since >= self.abort_timeout:
                self._abort(idle)

    def _wait_for_signal_or_timeout(self) -> None:
        if self._wake_r is None:
            self._stop.wait(self.poll_interval)
            return
        ready, _, _ = select.select([self._wake_r], [], [], self.poll_interval)
        if not ready:
            return
        for signum in self._wake_r.recv(64):
            if signum == signal.SIGUSR1:
                self.dump(fmt.DUMP, reason="SIGUSR1")
            elif signum == signal.SIGTERM and signal.SIGTERM in self._previous_handlers:
                self._terminate(signum)
            elif signum == signal.SIGINT:
                self.recorder.record_event(
                    fmt.SIGNAL, signal="SIGINT", open_steps=self.recorder.describe_open_steps()
                )

    def dump(self, event: str, **fields: Any) -> None:
        recorder = self.recorder
        recorder.record_event(
            event,
            stacks=thread_stacks(),
            open_steps=recorder.describe_open_steps(),
            inflight=recorder.describe_inflight(),
            **self._waiting_in(),
            **fields,
            **recorder.describe_device_pending(),
        )

    def _waiting_in(self) -> dict[str, str]:
        waiting_in = self.recorder.waiting_in
        return {"waiting_in": waiting_in} if waiting_in else {}

    def _abort(self, idle: float) -> None:
        if not self._exiting.acquire(blocking=False):
            return
        message = (
            f"no progress for {idle:.0f} s{self._where()}: the watchdog ended the run "
            f"(abort timeout {self.abort_timeout:g} s)"
        )
        self.recorder.record_event(
            fmt.ABORT, idle_s=round(idle, 3), message=message, **self._waiting_in()
        )
        self._say(message)
        os._exit(WATCHDOG_EXIT_CODE)

    def _where(self) -> str:
        steps = self.recorder.describe_open_steps()
        if steps:
            return f" in step {steps[-1]['step']}"
        waiting_in = self.recorder.waiting_in
        if waiting_in:
            return f" in {waiting_in}"
        pending = self.recorder.oldest_device_pending()
        return f"; on the device: {pending.describe()}" if pending is not None else ""

    def _say(self, message: str) -> None:
        print(f"pipetrace: rank {self.recorder.rank}: {message}", file=sys.stderr, flush=True)
