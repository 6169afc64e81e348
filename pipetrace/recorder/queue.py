"""Where a rank's events wait between the moment they happen and the writer's flush.

Two queues do the same: `_queue.EventQueue` (C, built with the package when a compiler is
found: `_queue.c`), which also takes the recorder's hot calls and writes lines itself, and
`RecordQueue` below, a deque of record tuples written by `LineEncoder`, used without a
compiler and when a recorder asks for Python only. Both keep records in the order they
came, write their lines to the log for the writer (`write`), and call ``on_full`` when
``capacity`` records wait, so that memory stays bounded (the writer then flushes on the
appending thread).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pipetrace.recorder.encoding import LAYOUTS, LineEncoder

try:
    from pipetrace.recorder import _queue
except ImportError:  # built without a C compiler: the Python queue and hot path
    _queue = None

COMPILED = _queue is not None
"""Whether the C queue is built (an install with a C compiler builds it)."""


class RecordQueue:
    """Records as tuples, written by a `LineEncoder` when taken."""

    def __init__(self) -> None:
        self._pending: deque[tuple] = deque()
        self.append_unchecked: Callable[[tuple], None] = self._pending.append
        """Append without the bound's check: for callers that check it every few records."""
        self._encode: Callable[[list[tuple]], bytes | bytearray] | None = None
        self._capacity = 0
        self._on_full: Callable[[], Any] = _nothing

    def open(
        self,
        encode: Callable[[list[tuple]], bytes | bytearray],
        capacity: int,
        on_full: Callable[[], Any] | None,
    ) -> None:
        """Lines from ``encode``; ``on_full()`` when ``capacity`` records wait (None: no
        bound)."""
        self._encode, self._capacity = encode, capacity
        self._on_full = _nothing if on_full is None else on_full

    def __len__(self) -> int:
        return len(self._pending)

    def append(self, record: tuple) -> None:
        pending = self._pending
        pending.append(record)
        if len(pending) >= self._capacity:
            self._on_full()

    def write(self, fd: int, count: int) -> None:
        """The first ``count`` records taken from the queue and written to ``fd`` as lines
        (taken even when writing fails: the error is raised)."""
        if self._encode is None:
            raise RuntimeError("write: the queue was not opened")
        popleft = self._pending.popleft
        view = memoryview(self._encode([popleft() for _ in range(count)]))
        while view:
            view = view[os.write(fd, view) :]


def _nothing() -> None:
    pass


def new_queue(
    monotonic_ns: Callable[[], int],
    *,
    compiled: bool,
    step_token: Callable[..., Any],
    close_token: Callable[..., Any],
) -> Any:
    """The C queue when it is built and ``compiled``, else a `RecordQueue`. The C queue
    reads the clock itself when it is the system's (`time.perf_counter_ns`); while its
    ``profiling`` is set (by the recorder, at each iteration's start) its hot calls open a
    profiler range for each step with ``step_token`` and close it with ``close_token`` (the
    recorder's own)."""
    if not compiled or _queue is None:
        return RecordQueue()
    clock = None if monotonic_ns is time.perf_counter_ns else monotonic_ns
    return _queue.EventQueue(clock, step_token, close_token)


def open_queue(
    queue: Any, encoder: LineEncoder, *, capacity: int, on_full: Callable[[], Any] | None
) -> None:
    """Ready ``queue`` to write the lines ``encoder`` writes, calling ``on_full`` when
    ``capacity`` records wait (None: no bound)."""
    if isinstance(queue, RecordQueue):
        queue.open(encoder.lines, capacity, on_full)
        return
    queue.open(
        LAYOUTS,
        encoder.offset,
        encoder.texts,
        encoder.text,
        encoder.literals,
        encoder.peers,
        encoder.line,
        capacity,
        on_full,
    )
