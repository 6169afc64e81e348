"""An append-only event log that a killed process leaves readable.

The hot path only appends a tuple to a deque (thread-safe without a lock). A background
thread encodes and writes everything pending every ``flush_interval`` seconds, and callers
flush at iteration ends and before the process dies, so a SIGKILL loses at most one interval.
Writes go straight to the file descriptor (no userspace buffer), so what was flushed is in
the kernel's hands even if the interpreter dies a moment later. A write cut short by a kill
can leave a torn last line; readers tolerate it.

Memory is bounded: when ``capacity`` events are pending, the appending thread flushes them
itself (backpressure) rather than dropping events or growing without limit. `append`
checks that; `append_unchecked` (the queue's own append, no Python frame: the recorder's
hottest calls) does not, so a caller using it also calls `append` every few events (the
recorder: at every step's end, or every 32nd in its C hot path), and the bound is exceeded by
at most those few.

The log is a new file (`create_new_file`): an existing file or a planted symbolic link at
its path is refused, never truncated or followed.
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

from pipetrace.recorder.run_dir import create_new_file

_BATCH = 4096  # records encoded per call: bounds the chunk held in memory (~0.4 MB)
Encoder = Callable[[list[tuple]], bytes | bytearray]  # records -> their JSON lines, in order


class EventWriter:
    def __init__(
        self,
        path: str | Path,
        header: dict[str, Any],
        encode: Encoder,
        *,
        flush_interval: float,
        capacity: int,
    ) -> None:
        """``flush_interval`` and ``capacity``: `RecordSettings.flush_interval` and
        ``buffer_events``, whose defaults are declared there."""
        self.path = Path(path)
        self._encode = encode
        self._capacity = capacity
        self._pending: deque[tuple] = deque()
        self.append_unchecked: Callable[[tuple], None] = self._pending.append
        self._lock = threading.Lock()  # serialises encoding + writing, never the hot path
        self._fd: int | None = create_new_file(self.path)
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
            # A batch per call, not a call per record: the encoder keeps its lookups in
            # locals across the batch (bench/bench_recorder.py). Records are popped only under
            # the lock and appended at the other end, so `count` of them are there to take.
            for start in range(0, count, _BATCH):
                batch = [popleft() for _ in range(min(_BATCH, count - start))]
                self._write(encode(batch))
            self.events_written += count

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
