"""What the device timer reports: resolved spans, and work the device has not completed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipetrace import units


@dataclass(frozen=True, slots=True)
class DeviceSpan:
    """One step or P2P op with both its host enqueue times and its device times.

    All four times are on the timer's host clock (the recorder's epoch clock, ns), so the
    recorder's offset to rank 0 applies to them like to every other time of the rank.
    """

    key: int
    """The recorder's id of the step or P2P op (its step_begin / p2p_post id)."""
    label: str
    """What ran, e.g. ``2F0`` or ``3SEND_B5``."""
    stream: str
    """Which stream it ran on: ``"compute"`` or ``"p2p"``."""
    host_begin_ns: int
    host_end_ns: int
    """When the host started and finished enqueuing the work."""
    device_begin_ns: int
    device_end_ns: int
    """When the device started and finished it."""
    uncertainty_ns: int
    """The anchor's uncertainty: the device times lie within ± this (plus drift)."""

    @property
    def device_ns(self) -> int:
        return self.device_end_ns - self.device_begin_ns

    @property
    def host_ns(self) -> int:
        return self.host_end_ns - self.host_begin_ns

    @property
    def lag_ns(self) -> int:
        """How long after the host finished enqueuing the device finished the work."""
        return self.device_end_ns - self.host_end_ns


@dataclass(frozen=True, slots=True)
class PendingWork:
    """Work the host has enqueued and the device has not completed (for stall dumps)."""

    key: int
    label: str
    stream: str
    enqueued_ns: int
    """Host time at which the host finished enqueuing it."""
    age_ns: int
    """How long ago that was, when the snapshot was taken."""
    started: bool
    """Whether the device has reached its beginning (running, or stuck inside it) or not
    (queued behind other work)."""

    def to_json(self) -> dict[str, Any]:
        """The entry of a ``device_pending`` list in the trace (docs/trace-format.md)."""
        age_s = round(self.age_ns / 1e9, 3)
        names = ("id", "step", "stream", "enqueued_t", "age_s", "started")
        return dict(
            zip(names, (self.key, self.label, self.stream, self.enqueued_ns, age_s, self.started))
        )

    def describe(self) -> str:
        """``3SEND_B5 enqueued 41 s ago, never completed on the device``."""
        state = (
            "started on the device but never completed"
            if self.started
            else "never completed on the device"
        )
        # whole seconds for a hang's age; a crash lists work a moment old
        age = f"{self.age_ns / 1e9:.0f} s" if self.age_ns >= 1e9 else units.duration(self.age_ns)
        return f"{self.label} enqueued {age} ago, {state}"
