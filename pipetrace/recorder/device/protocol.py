"""What the device timer needs from an accelerator: events, streams, and one device sync.

`torch.cuda.Event` and `torch.cuda.Stream` satisfy these protocols as they are (see
`pipetrace.recorder.device.cuda`); the CPU tests drive a fake device through the same
methods, which is how the timing logic is proven without a GPU.
"""

from __future__ import annotations

from typing import Any, Protocol


class DeviceEvent(Protocol):
    """A timing event: marks a point in a stream's work, completes when the device gets there."""

    def record(self, stream: Any) -> None:
        """Enqueue the event on ``stream`` (returns at once; the device reaches it later)."""

    def query(self) -> bool:
        """Whether the device has reached the event (never blocks)."""

    def synchronize(self) -> None:
        """Block the calling thread until the device reaches this event (this event only)."""

    def elapsed_time(self, end: Any) -> float:
        """Milliseconds from this event to ``end`` on the device; both must have completed."""


class DeviceBackend(Protocol):
    """Makes events and streams for one device."""

    name: str
    """Short device kind for the trace, e.g. ``"cuda"``."""

    def new_event(self) -> DeviceEvent:
        """A fresh timing-enabled event (the timer pools them)."""

    def current_stream(self) -> Any:
        """The stream the calling thread enqueues work on now."""

    def new_stream(self) -> Any:
        """A stream of the timer's own, idle except for the anchor events recorded on it."""

    def synchronize(self) -> None:
        """Wait for all work on the device: called once, when the timer starts."""
