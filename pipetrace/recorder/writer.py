"""An append-only event log that a killed process leaves readable.

The hot path only appends a tuple to a deque (thread-safe without a lock). A background
thread encodes and writes everything pending every ``flush_interval`` seconds, and callers
flush at iteration ends and before the process dies, so a SIGKILL loses at most one interval.
Writes go straight to the file descriptor (no userspace buffer), so what was flushed is in
the kernel's hands even if the interpreter dies a moment later. A write cut short by a kill
can leave a torn last line; readers tolerate it.

Memory is bounded: when ``capacity`` events are pending, the appending thread flushes them
itself (backpressure) rather than dropping events or growing without limit.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

_WRITE_CHUNK = 1 << 20
Encoder = Callable[[tuple], bytes]  # one record -> one JSON line, newline included


class EventWriter:
    def __init__(
        self,
        path: str | Path,
        header: dict[str, Any],
        encode: Encoder,
        *,
        flush_interval: float = 0.2,
        capacity: int = 200_000,
    ) -> None:
        self.path = Path(path)
        self._encode = encode
        self._capacity = capacity
        self._pending: deque[tuple] = deque()
        self._lock = threading.Lock()  # serialises encoding + writing, never the hot path
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.events_written = 0
        self._write(orjson.dumps(header, option=orjson.OPT_APPEND_NEWLINE))
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(
            target=self._flush_periodically,
            args=(flush_interval,),
            name="pipetrace-flush",
            daemon=True,
        )
        self._thread.start()

    @property
    def pending(self) -> int:
        """Events appended but not written yet (at most ``capacity``)."""
        return len(self._pending)

    def append(self, record: tuple) -> None:
        pending = self._pending
        pending.append(record)
        if len(pending) >= self._capacity:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if self._fd is None:
                return
            pending = self._pending
            count = len(pending)
            if not count:
                return
            encode = self._encode
            popleft = pending.popleft
            # Append into one reused buffer: keeping many small bytes objects alive until a
            # join costs ~10x more (fresh memory for each), measured in bench/bench_recorder.py.
            chunk = bytearray()
            for _ in range(count):
                chunk += encode(popleft())
                if len(chunk) >= _WRITE_CHUNK:
                    self._write(chunk)
                    chunk.clear()
            self._write(chunk)
            self.events_written += count

    def request_flush(self) -> None:
        """Flush soon on the background thread, off the caller's critical path."""
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.flush()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _write(self, data: bytes | bytearray) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def _flush_periodically(self, interval: float) -> None:
        while not self._stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            # The disk is full or gone: keep the run alive, the next flush retries.
            with contextlib.suppress(OSError):
                self.flush()
