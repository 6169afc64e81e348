"""A bounded pool of reusable device events.

Creating a CUDA event costs a driver call; the timer needs two per step and per P2P op, so it
reuses completed ones. The pool is bounded: when every event is in flight (the device is far
behind, or hung) `acquire_pair` says no and the timer skips device timing for that work rather
than grow without limit or wait for the device.
"""

from __future__ import annotations

from collections.abc import Callable

from pipetrace.recorder.device.protocol import DeviceEvent


class EventPool:
    def __init__(self, factory: Callable[[], DeviceEvent], limit: int) -> None:
        if limit < 2:
            raise ValueError(f"an event pool needs room for a pair, got limit {limit}")
        self._factory = factory
        self._limit = limit
        self._free: list[DeviceEvent] = []
        self.created = 0
        """Events made so far: never more than ``limit``."""

    def acquire_pair(self) -> tuple[DeviceEvent, DeviceEvent] | None:
        """Two events for a begin/end pair, or None when the pool is exhausted."""
        free = self._free
        if len(free) >= 2:
            return free.pop(), free.pop()
        missing = 2 - len(free)
        if self.created + missing > self._limit:
            return None
        self.created += missing
        while len(free) < 2:
            free.append(self._factory())
        return free.pop(), free.pop()

    def release(self, *events: DeviceEvent) -> None:
        """Give back events the device has completed (their times have been read)."""
        self._free.extend(events)

    @property
    def free(self) -> int:
        return len(self._free)
