"""A fake accelerator with controlled times, for proving the device timer on CPU.

Times are driven by a `FakeClock` that the test advances. The device's own clock runs at
``1 + drift_ppm * 1e-6`` device ns per host ns from an arbitrary origin, so only the timer's
anchoring can put it on the host clock. Work is launched on a `FakeStream` with a duration;
an event recorded on a stream completes when the stream has drained the work before it, and
`elapsed_time` returns float32 milliseconds as CUDA does. Every synchronize (device-wide or of
one event) is logged with the calling thread's name.
"""

from __future__ import annotations

import math
import struct
import threading

NEVER = math.inf


class FakeClock:
    """Host clock in epoch ns; each reading costs ``tick_ns`` (a round trip is never free)."""

    def __init__(self, start_ns: int = 1_750_000_000_000_000_000, tick_ns: int = 1_000) -> None:
        self.t = start_ns
        self.tick_ns = tick_ns
        self._lock = threading.Lock()

    def now_ns(self) -> int:
        with self._lock:
            self.t += self.tick_ns
            return self.t

    def advance(self, ns: int) -> None:
        with self._lock:
            self.t += ns

    def shifted(self, offset_ns: int) -> ShiftedClock:
        """Another rank's clock: the same passing time, read ``offset_ns`` ahead."""
        return ShiftedClock(self, offset_ns)


class ShiftedClock:
    def __init__(self, base: FakeClock, offset_ns: int) -> None:
        self.base = base
        self.offset_ns = offset_ns

    @property
    def t(self) -> int:
        return self.base.t + self.offset_ns

    def now_ns(self) -> int:
        return self.base.now_ns() + self.offset_ns

    def advance(self, ns: int) -> None:
        self.base.advance(ns)


class FakeDevice:
    """The `DeviceBackend` of a fake device whose clock drifts against ``clock``."""

    name = "fake"
    description = "a fake device with controlled times"

    def __init__(self, clock: FakeClock | ShiftedClock, *, drift_ppm: float = 0.0) -> None:
        self.clock = clock
        self.rate = 1.0 + drift_ppm * 1e-6
        self._host_origin = clock.t
        self._device_origin = 123_456_789
        self.syncs: list[str] = []
        """Name of the thread of every synchronize call, device-wide or of an event."""
        self.streams: list[FakeStream] = []

    def device_now(self) -> float:
        return self._device_origin + (self.clock.t - self._host_origin) * self.rate

    def device_time_of(self, host_ns: int) -> float:
        """The device clock's reading at host time ``host_ns``."""
        return self._device_origin + (host_ns - self._host_origin) * self.rate

    def host_time_of(self, device_ns: float) -> float:
        """The true host time at which the device clock reads ``device_ns`` (NEVER: never)."""
        if device_ns == NEVER:
            return NEVER
        return round(self._host_origin + (device_ns - self._device_origin) / self.rate)

    def new_event(self) -> FakeEvent:
        return FakeEvent(self)

    def current_stream(self) -> FakeStream:
        return self.streams[0] if self.streams else self.new_stream()

    def new_stream(self) -> FakeStream:
        stream = FakeStream(self)
        self.streams.append(stream)
        return stream

    def synchronize(self) -> None:
        self.syncs.append(threading.current_thread().name)
        finish = max((s.busy_until for s in self.streams), default=0.0)
        self.wait_until(finish)

    def wait_until(self, device_ns: float) -> None:
        if device_ns == NEVER:
            raise RuntimeError("the fake device is hung: synchronize would never return")
        behind = device_ns - self.device_now()
        if behind > 0:
            self.clock.advance(math.ceil(behind / self.rate))


class FakeStream:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.busy_until = 0.0

    def launch(self, duration_ns: float) -> None:
        """Enqueue work taking ``duration_ns`` of device time (NEVER: it hangs)."""
        start = max(self.busy_until, self.device.device_now())
        self.busy_until = start + duration_ns


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.at: float | None = None
        """Device time at which the device reaches the event (None before any record)."""

    def record(self, stream: FakeStream) -> None:
        self.at = max(stream.busy_until, self.device.device_now())

    def query(self) -> bool:
        return self.at is not None and self.device.device_now() >= self.at

    def synchronize(self) -> None:
        self.device.syncs.append(threading.current_thread().name)
        self.device.wait_until(self.at)

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("elapsed_time on an event that has not completed")
        ms = (end.at - self.at) / 1e6
        return struct.unpack("f", struct.pack("f", ms))[0]  # CUDA reports float32
