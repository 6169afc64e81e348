"""Launch-bound or device-bound: did the device run a step as it was enqueued, or long after?

On a GPU the host returns from a step once its kernels are queued. If the device finishes the
step's work about when the host finishes enqueuing it, the device was waiting for the host's
launches: the step is *launch-bound*, and speeding up the device would not help. If the device
finishes long after, the host ran ahead and the device is what the step waits on: it is
*device-bound*, and its host times say nothing about how long it ran.

"Long after" means a lag (device end minus host end) beyond both an absolute floor (launch
latency and timer noise, 50 µs by default) and a multiple of the host's own enqueue time, plus
the span's clock uncertainty so that clock error alone never makes a step device-bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pipetrace.recorder.device.spans import DeviceSpan


class Boundness(str, Enum):
    LAUNCH = "launch-bound"
    DEVICE = "device-bound"


@dataclass(frozen=True, slots=True)
class BoundnessRule:
    min_lag_ns: int = 50_000
    """A lag under this is launch latency, not a device backlog."""
    lag_ratio: float = 1.0
    """A lag under this multiple of the host enqueue time is not a device backlog either."""


def classify(span: DeviceSpan, rule: BoundnessRule = BoundnessRule()) -> Boundness:
    threshold = max(rule.min_lag_ns, rule.lag_ratio * span.host_ns) + span.uncertainty_ns
    return Boundness.DEVICE if span.lag_ns > threshold else Boundness.LAUNCH
