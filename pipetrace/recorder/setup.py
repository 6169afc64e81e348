"""Recording settings, and the recorder they build: from `pipetrace run` or the environment.

`RecordSettings` is the one definition of what a recorder is asked to do (its defaults, its
checks, its environment variables). In a user's own script (under torchrun, or as a
MindSpore worker), ``PIPETRACE_DIR=run/`` turns recording on with no code change beyond
using pipetrace's runtime; the other variables tune it (docs/recording.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrace.recorder.clock import RecvInts, SendInts
from pipetrace.recorder.device.cuda import cuda_backend
from pipetrace.recorder.device.protocol import DeviceBackend
from pipetrace.recorder.hooks import NullRecorder, RecorderHooks
from pipetrace.recorder.recorder import ProfilerRanges, Recorder
from pipetrace.settings import (
    Setting,
    at_least,
    check_settings,
    positive_seconds,
    read_environment,
    seconds,
    seconds_or_off,
    setting,
    whole_number,
)

RECORD_MODES = ("off", "steps", "full")

# Settings that `pipetrace.runtime.config.RunConfig` has too, under the same flags.
RECORD_MODE = Setting("steps", choices=RECORD_MODES, flag="--record", env="PIPETRACE_RECORD")
STALL_TIMEOUT = Setting(
    30.0,
    seconds_or_off,
    flag="--stall-timeout",
    env="PIPETRACE_STALL_TIMEOUT",
    parse=seconds,
)
ABORT_TIMEOUT = Setting(
    30.0,
    seconds_or_off,
    flag="--abort-timeout",
    env="PIPETRACE_ABORT_TIMEOUT",
    parse=seconds,
)


@dataclass(frozen=True)
class RecordSettings:
    """What to record and where; picklable, so the launcher can hand it to each rank."""

    run_dir: Path | None = setting(None, env="PIPETRACE_DIR")
    """Where meta.json and the per-rank logs go, created if missing (a str is turned into a
    Path); None: record nothing."""
    mode: str = RECORD_MODE.field()
    """"steps": steps, P2P ops and lifecycle; "full": also the Python stack of each P2P post;
    "off": nothing."""
    stall_timeout: float = STALL_TIMEOUT.field()
    """Seconds without progress inside an iteration before a stall event (0: no watchdog)."""
    abort_timeout: float = ABORT_TIMEOUT.field()
    """Further seconds after a stall before the watchdog ends the process (0: never)."""
    flush_interval: float = setting(
        0.2, positive_seconds, env="PIPETRACE_FLUSH_INTERVAL", parse=seconds
    )
    """Seconds between background flushes: the most a killed process can lose."""
    buffer_events: int = setting(
        200_000, at_least(1), env="PIPETRACE_BUFFER_EVENTS", parse=whole_number
    )
    """Pending events before the recording thread writes them itself (bounds memory)."""

    def __post_init__(self) -> None:
        check_settings(self)
        if self.run_dir is not None:
            object.__setattr__(self, "run_dir", Path(self.run_dir))

    @property
    def enabled(self) -> bool:
        return self.run_dir is not None and self.mode != "off"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RecordSettings:
        """The settings the PIPETRACE_* variables give (unset ones keep their default)."""
        return read_environment(cls, environ)


FrameworkParts = tuple[str, ProfilerRanges, tuple[SendInts, RecvInts]]
"""A framework's version, profiler ranges and clock exchange, imported only when recording."""


def torch_recorder(settings: RecordSettings, device: Any = None) -> RecorderHooks:
    """The recorder for a torch rank: profiler ranges and clock alignment over
    torch.distributed, and device timing when ``device`` (the rank's torch device) is a CUDA
    device (docs/device-timing.md): there a host time is only an enqueue time."""
    if not settings.enabled:
        return NullRecorder()
    timed = None if device is None else cuda_backend(device)
    return _framework_recorder(settings, "torch", _torch_parts, timed)


def mindspore_recorder(settings: RecordSettings) -> RecorderHooks:
    """The recorder for a MindSpore rank: the same recorder and trace format (header
    framework "mindspore"), profiler ranges through MindSpore's RecordFunction, clock
    alignment over mindspore.communication (which must be initialised: the MindSpore runner
    makes its recorder after joining the cluster)."""
    return _framework_recorder(settings, "mindspore", _mindspore_parts)


def _framework_recorder(
    settings: RecordSettings,
    framework: str,
    parts: Callable[[], FrameworkParts],
    device: DeviceBackend | None = None,
) -> RecorderHooks:
    if not settings.enabled:
        return NullRecorder()
    version, profiler, exchange = parts()
    return Recorder(
        settings,
        framework=framework,
        framework_version=version,
        profiler=profiler,
        clock_exchange=exchange,
        device=device,
    )


def _torch_parts() -> FrameworkParts:
    import torch

    from pipetrace.recorder.clock import torch_int_exchange
    from pipetrace.recorder.profiler import TorchProfilerRanges

    return torch.__version__, TorchProfilerRanges(), torch_int_exchange()


def _mindspore_parts() -> FrameworkParts:
    import mindspore

    from pipetrace.recorder.clock import mindspore_int_exchange
    from pipetrace.recorder.profiler import MindSporeProfilerRanges

    return mindspore.__version__, MindSporeProfilerRanges(), mindspore_int_exchange()
