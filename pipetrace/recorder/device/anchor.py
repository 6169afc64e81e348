"""Putting device event times on the host clock: anchors and the drift model.

A CUDA event has no absolute time: the device only says how many milliseconds lie between two
completed events (``elapsed_time``). An *anchor* ties one event to the host clock: the timer
notes the host time ``t0``, records the event on a stream of its own that nothing else uses
(so the device reaches it at once), waits for that one event (``event.synchronize()``, never a
device-wide sync) and notes ``t1``. The device reached the event somewhere in ``[t0, t1]``,
so its host time is the midpoint with uncertainty ``(t1 - t0) / 2``; of several rounds the
one with the shortest wait wins (as the ping-pong of `pipetrace.recorder.clock`). A device
time is then ``anchor.host_ns + rate * elapsed(anchor.event, event)``.

Drift model. The device clock runs at a constant rate relative to the host clock between two
anchors (crystal drift: tens of ppm, slowly varying with temperature). ``rate`` (host ns per
device ns) is measured from the previous anchor to this one; the first anchor assumes 1. An
event timed from anchor k at host time t is off by at most

    uncertainty_k + |true rate - rate_k| * (t - host_ns_k) + 2**-24 * (t - host_ns_k)

the last term being the float32 resolution of ``elapsed_time``. The rate error has two
parts: the measurement, at most ``(uncertainty_k-1 + uncertainty_k) / I`` over the interval I
between the two anchors, and the change of the true rate since it was measured. The timer
re-anchors every R = ``reanchor_s`` seconds (10 s by default) and times each event from the
newest anchor, so ``t - host_ns_k`` stays under R; a rate is measured only over an interval of
at least R / 2 (an earlier anchor, taken by hand, keeps the previous rate). So the error stays
under ``uncertainty_k + 2 * (uncertainty_k-1 + uncertainty_k) + (rate change) * R + 0.6 µs``
(three anchor uncertainties when anchors are R apart, as the poller takes them): a few tens
of µs at most, plus well under 1 µs for a crystal whose drift changes slowly. Until the first
re-anchor the rate is taken as 1, so that first interval adds ``|drift| * R`` (0.5 ms for
50 ppm over 10 s); without re-anchoring the error grows as ``|drift| * t``. A rate further
than `MAX_DRIFT` from 1 is a bad measurement (an anchor event delayed behind other device
work), and the previous rate is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipetrace.recorder.device.protocol import DeviceBackend, DeviceEvent

MAX_DRIFT = 1e-3
"""Largest believable |rate - 1| (1000 ppm); crystal oscillators stay within ~100 ppm."""

_NS_PER_MS = 1_000_000


@dataclass(frozen=True, slots=True)
class Anchor:
    """One device event whose host time is known, and the device rate measured up to it."""

    event: DeviceEvent
    host_ns: int
    """Host time (the timer's clock) at which the device reached ``event``: a midpoint."""
    uncertainty_ns: int
    """Half the shortest wait: the true host time lies within ``host_ns`` ± this."""
    rate: float
    """Host ns per device ns, measured from the previous anchor (1.0 for the first)."""
    index: int
    """0 for the anchor taken at start, then 1, 2, ... per re-anchor."""

    def to_host(self, event: DeviceEvent) -> int:
        """Host time of a completed ``event`` recorded after this anchor."""
        return self.host_ns + round(self.event.elapsed_time(event) * _NS_PER_MS * self.rate)


def take_anchor(
    backend: DeviceBackend,
    stream: Any,
    now_ns: Callable[[], int],
    *,
    rounds: int,
    previous: Anchor | None,
    min_rate_interval_ns: int,
) -> Anchor:
    """Best of ``rounds`` anchor measurements on ``stream`` (the timer's idle stream); its
    rate is measured from ``previous`` when at least ``min_rate_interval_ns`` separate them.

    Blocks the calling thread until each anchor event completes: the timer calls it once at
    start and then from its poller thread, never from the training thread.
    """
    best: tuple[int, int, DeviceEvent] | None = None  # (wait, midpoint, event)
    for _ in range(rounds):
        event = backend.new_event()
        t0 = now_ns()
        event.record(stream)
        event.synchronize()
        t1 = now_ns()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, (t0 + t1) // 2, event)
    assert best is not None, "rounds must be at least 1"
    wait, host_ns, event = best
    rate = 1.0 if previous is None else _rate(previous, event, host_ns, min_rate_interval_ns)
    index = 0 if previous is None else previous.index + 1
    return Anchor(event, host_ns, wait // 2, rate, index)


def _rate(previous: Anchor, event: DeviceEvent, host_ns: int, min_interval_ns: int) -> float:
    """Host ns per device ns since ``previous``, or the previous rate (see the docstring)."""
    device_ns = previous.event.elapsed_time(event) * _NS_PER_MS
    if device_ns < max(min_interval_ns, 1):
        return previous.rate
    rate = (host_ns - previous.host_ns) / device_ns
    return rate if abs(rate - 1.0) <= MAX_DRIFT else previous.rate
