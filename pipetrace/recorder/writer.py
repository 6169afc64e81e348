"""An append-only event log that a killed process leaves readable.

Events wait in a queue (`pipetrace.recorder.queue`: the hot path only appends to it). A
background thread writes everything pending every ``flush_interval`` seconds, and callers
flush at iteration ends and before the process dies (a signal, an exit without closing the
recording), so a SIGKILL loses at most one interval.
Writes go straight to the file descriptor (no userspace buffer), so what was flushed is in
the kernel's hands even if the interpreter dies a moment later. A write cut short by a kill
can leave a torn last line; readers tolerate it.

Memory is bounded: the queue calls `flush` on the appending thread when its capacity is
reached (backpressure), rather than dropping events or growing without limit.

The log is a new file (`create_new_file`): an existing file or a planted symbolic link at
its path is refused, never truncated or followed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from pathlib import Path
from typing import Any, Protocol

import orjson

from pipetrace.recorder.run_dir import create_new_file

_BATCH = 4096  # records written per call: bounds the lines held in memory (~0.4 MB)


class Queue(Protocol):
    """What the writer takes lines from (`pipetrace.recorder.queue`)."""

    def __len__(self) -> int: ...

    def write(self, fd: int, count: int) -> None: ...


class EventWriter:
    def __init__(
        self, path: str | Path, header: dict[str, Any], queue: Queue, *, flush_interval: float
    ) -> None:
        """``flush_interval``: `RecordSettings.flush_interval`, whose default is declared
        there."""
        self.path = Path(path)
        self._queue = queue
        self._lock = threading.Lock()  # serialises taking + writing, never the hot path
        self._fd: int | None = create_new_file(self.path)
        self.events_written = 0
        self.write_error: OSError | None = None  # the last flush's, until one succeeds
        self._told = False  # the user was told that events are being lost
        self._discard: int | None = None  # os.devnull, once records had to be dropped
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
        # A script that ends without closing its recording: what waits is written at exit
        # (the flush thread, a daemon, would die with it).
        atexit.register(self.flush)

    @property
    def pending(self) -> int:
        """Events appended but not written yet (at most the queue's capacity)."""
        return len(self._queue)

    def flush(self) -> None:
        """Write what waits. A write that fails (a full disk, a file size limit, the file
        system gone) loses the events it held and never stops the run: the training goes
        on, the user is told once, and the next flush tries again."""
        with self._lock:
            if self._fd is None:
                return
            queue = self._queue
            # What waits now, a batch per call: records appended meanwhile wait for the next
            # flush. Only this (under the lock) takes from the queue, so they are there.
            count = len(queue)
            fd = self._fd
            try:
                if self.write_error is not None:
                    self._write(b"\n")  # ends the line a failed write may have cut short
                    self.write_error = None
            except OSError as error:  # still failing: what waits now is lost too
                self._lose(error)
                fd = self._devnull()
            try:
                while count:
                    batch = min(_BATCH, count)
                    count -= batch
                    queue.write(fd, batch)  # taken from the queue even if it fails
                    if fd == self._fd:
                        self.events_written += batch
            except OSError as error:  # the batch is lost; what is left waits for the next
                self._lose(error)

    def _devnull(self) -> int:
        """Where the records go that cannot be written: taken from the queue all the same,
        so that its memory stays bounded."""
        if self._discard is None:
            self._discard = os.open(os.devnull, os.O_WRONLY)
        return self._discard

    def _lose(self, error: OSError) -> None:
        if self.write_error is None and not self._told:
            self._told = True
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(
                    f"pipetrace: cannot write {self.path}: {error.strerror or error}; events "
                    "are lost until it can write again (the training goes on)\n"
                )
                sys.stderr.flush()
        self.write_error = error

    def close(self) -> None:
        atexit.unregister(self.flush)
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.flush()
        with self._lock:
            for fd in (self._fd, self._discard):
                if fd is not None:
                    os.close(fd)
            self._fd = self._discard = None

    def _write(self, data: bytes | bytearray) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def _flush_periodically(self, interval: float) -> None:
        while not self._stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            self.flush()
