"""The device timer: true device begin/end times of steps and P2P ops, without slowing them.

Hot path (the training thread, and the overlap thread): `begin` takes a pair of pooled events,
records the first on the stream the work is enqueued on and notes the host time; `end` records
the second on the same stream and queues the pair. Neither waits for the device.

Resolution (`poll`): a background poller thread (`start_poller`), or the runtime at iteration
end, asks each queued end event whether the device has reached it (``query()``, which never
blocks). Events on one stream complete in the order they were recorded, so each stream's queue
is read from its head and stops at the first incomplete event. A completed pair is put on the
host clock through the anchor that was current when the work began (`anchor`), handed to
``on_span``, and its events go back to the pool.

Anchors: `start` synchronizes the device once (before training) and takes the first anchor;
the poller re-anchors every ``reanchor_s`` seconds, on a stream of the timer's own, waiting
only for its own anchor event on the poller thread. The drift model and error bound are in
`pipetrace.recorder.device.anchor`.

Stalls: `pending` lists the work the host has finished enqueuing and the device has not
completed, with its age and whether the device has reached its beginning, so a stall dump can
tell a hung transfer or kernel from a host thread stuck in Python.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipetrace.recorder.device.anchor import Anchor, take_anchor
from pipetrace.recorder.device.pool import EventPool
from pipetrace.recorder.device.protocol import DeviceBackend, DeviceEvent
from pipetrace.recorder.device.spans import DeviceSpan, PendingWork

SpanSink = Callable[[DeviceSpan], None]
AnchorSink = Callable[[Anchor], None]


@dataclass(slots=True)
class _Timing:
    """One step or P2P op between `begin` and its resolution (the token `begin` returns)."""

    key: int
    label: str
    stream_name: str
    stream: Any
    begin_event: DeviceEvent
    end_event: DeviceEvent
    anchor: Anchor
    host_begin_ns: int
    host_end_ns: int = -1


@dataclass(frozen=True, slots=True)
class TimerSettings:
    max_in_flight: int = 4096
    """Steps and P2P ops timed but not yet resolved; past this, new work goes untimed
    (counted in `DeviceTimer.untimed`) rather than growing the pool or waiting."""
    reanchor_s: float = 10.0
    """Seconds between anchors taken by the poller (bounds drift; see the anchor module)."""
    anchor_rounds: int = 8
    """Anchor measurements per anchor; the one with the shortest wait wins."""
    poll_interval_s: float = 0.005
    """Seconds between two polls of the poller thread."""


class DeviceTimer:
    """Device times for one rank's steps and P2P ops, on the host clock ``now_ns``.

    ``now_ns`` is the recorder's clock (epoch ns of the rank's monotonic clock), so the spans
    handed to ``on_span`` share the time base of the recorder's own events.
    """

    def __init__(
        self,
        backend: DeviceBackend,
        *,
        now_ns: Callable[[], int],
        on_span: SpanSink,
        on_anchor: AnchorSink | None = None,
        settings: TimerSettings = TimerSettings(),
    ) -> None:
        """Makes nothing on the device yet: `start` does, once, before training (its one
        device-wide sync must not fall inside an iteration)."""
        self.backend = backend
        self.settings = settings
        self._now_ns = now_ns
        self._on_span = on_span
        self._on_anchor = on_anchor
        self._pool = EventPool(backend.new_event, 2 * settings.max_in_flight)
        self._lock = threading.Lock()
        self._queued: dict[Any, deque[_Timing]] = {}  # stream -> ended timings, in record order
        self._anchor_stream: Any = None
        self._anchor: Anchor | None = None
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        self.untimed = 0
        """Work left untimed because `TimerSettings.max_in_flight` timings were unresolved."""

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Anchor:
        """Synchronize the device once and take the first anchor. Call before training."""
        self.backend.synchronize()
        self._anchor_stream = self.backend.new_stream()
        return self.reanchor()

    def reanchor(self) -> Anchor:
        """Take a new anchor (blocks the calling thread on its own anchor events only)."""
        anchor = take_anchor(
            self.backend,
            self._anchor_stream,
            self._now_ns,
            rounds=self.settings.anchor_rounds,
            previous=self._anchor,
            min_rate_interval_ns=int(self.settings.reanchor_s * 1e9 / 2),
        )
        self._anchor = anchor
        if self._on_anchor is not None:
            self._on_anchor(anchor)
        return anchor

    def start_poller(self) -> None:
        """Resolve and re-anchor on a daemon thread until `close`."""
        self._poller = threading.Thread(
            target=self._poll_loop, name="pipetrace-device", daemon=True
        )
        self._poller.start()

    def close(self) -> None:
        """Stop the poller and resolve what has completed; the rest stays `pending`."""
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=2)
            self._poller = None
        self.poll()

    def _poll_loop(self) -> None:
        interval = self.settings.poll_interval_s
        reanchor_ns = int(self.settings.reanchor_s * 1e9)
        while not self._stop.wait(interval):
            self.poll()
            if self._now_ns() - self._anchor.host_ns >= reanchor_ns:
                self.reanchor()

    # -- the hot path ----------------------------------------------------------------------

    def begin(self, key: int, label: str, stream: Any, stream_name: str = "compute") -> Any:
        """Work ``label`` (recorder id ``key``) is about to be enqueued on ``stream``.
        Returns a token for `end`; None when the work goes untimed."""
        anchor = self._anchor
        if anchor is None:
            raise RuntimeError("DeviceTimer.begin before start(): there is no anchor yet")
        host_ns = self._now_ns()
        with self._lock:
            pair = self._pool.acquire_pair()
            if pair is None:
                self.untimed += 1
                return None
            pair[0].record(stream)
        return _Timing(key, label, stream_name, stream, *pair, anchor, host_ns)

    def end(self, token: Any) -> None:
        """The work `begin` announced is enqueued: mark its end on the same stream."""
        if token is None:
            return
        with self._lock:
            token.end_event.record(token.stream)
            token.host_end_ns = self._now_ns()
            queue = self._queued.get(token.stream)
            if queue is None:
                queue = self._queued[token.stream] = deque()
            queue.append(token)

    # -- resolution ------------------------------------------------------------------------

    def poll(self) -> int:
        """Resolve every timing whose end the device has reached; never blocks on the device.
        Returns how many were resolved."""
        with self._lock:
            done = [timing for queue in self._queued.values() for timing in _completed(queue)]
        spans = [_resolve(timing) for timing in done]
        with self._lock:
            for timing in done:
                self._pool.release(timing.begin_event, timing.end_event)
        for span in spans:
            self._on_span(span)
        return len(spans)

    def pending(self) -> list[PendingWork]:
        """Work enqueued and not completed on the device, oldest first."""
        now = self._now_ns()
        with self._lock:
            pending = [
                PendingWork(
                    timing.key,
                    timing.label,
                    timing.stream_name,
                    timing.host_end_ns,
                    now - timing.host_end_ns,
                    timing.begin_event.query(),
                )
                for queue in self._queued.values()
                for timing in queue
                if not timing.end_event.query()
            ]
        return sorted(pending, key=lambda work: work.enqueued_ns)

    @property
    def events_created(self) -> int:
        """Events the pool has made so far (bounded by twice ``max_in_flight``)."""
        return self._pool.created


def _completed(queue: deque[_Timing]) -> list[_Timing]:
    """Pop the timings at the head of one stream's queue whose end event has completed."""
    done = []
    while queue and queue[0].end_event.query():
        done.append(queue.popleft())
    return done


def _resolve(timing: _Timing) -> DeviceSpan:
    anchor = timing.anchor
    return DeviceSpan(
        key=timing.key,
        label=timing.label,
        stream=timing.stream_name,
        host_begin_ns=timing.host_begin_ns,
        host_end_ns=timing.host_end_ns,
        device_begin_ns=anchor.to_host(timing.begin_event),
        device_end_ns=anchor.to_host(timing.end_event),
        uncertainty_ns=anchor.uncertainty_ns,
    )
