"""Choosing and building a recorder: from `pipetrace run` flags or from the environment.

In a user's own script (under torchrun, or as a MindSpore worker), ``PIPETRACE_DIR=run/``
turns recording on with no code change beyond using pipetrace's runtime; the other
variables tune it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pipetrace.errors import PipetraceError
from pipetrace.recorder.hooks import NullRecorder, RecorderHooks
from pipetrace.recorder.recorder import RECORD_MODES, Recorder, RecorderConfig

ENV_DIR = "PIPETRACE_DIR"
ENV_MODE = "PIPETRACE_RECORD"
ENV_STALL = "PIPETRACE_STALL_TIMEOUT"
ENV_ABORT = "PIPETRACE_ABORT_TIMEOUT"
ENV_FLUSH = "PIPETRACE_FLUSH_INTERVAL"
ENV_BUFFER = "PIPETRACE_BUFFER_EVENTS"


@dataclass(frozen=True)
class RecordSettings:
    """What to record and where; picklable, so the launcher can hand it to each rank."""

    run_dir: str | None = None
    """None: record nothing."""
    mode: str = "steps"
    """One of RECORD_MODES; "off" records nothing."""
    stall_timeout: float = 30.0
    abort_timeout: float = 30.0
    flush_interval: float = 0.2
    buffer_events: int = 200_000
    """Pending events before the recording thread writes them itself (bounds memory)."""

    def __post_init__(self) -> None:
        if self.mode not in RECORD_MODES:
            raise PipetraceError(
                f"record mode must be one of {', '.join(RECORD_MODES)}; got {self.mode!r}"
            )
        for name in ("stall_timeout", "abort_timeout"):
            if getattr(self, name) < 0:
                raise PipetraceError(f"{name} must be >= 0 seconds (0 turns it off)")
        if self.flush_interval <= 0:
            raise PipetraceError("flush_interval must be > 0 seconds")
        if self.buffer_events < 1:
            raise PipetraceError("buffer_events must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.run_dir is not None and self.mode != "off"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RecordSettings:
        def number(name: str, default: float) -> float:
            raw = environ.get(name)
            if raw is None or raw == "":
                return default
            try:
                return float(raw)
            except ValueError:
                raise PipetraceError(f"{name}={raw!r} is not a number of seconds") from None

        return cls(
            run_dir=environ.get(ENV_DIR) or None,
            mode=environ.get(ENV_MODE, "steps"),
            stall_timeout=number(ENV_STALL, 30.0),
            abort_timeout=number(ENV_ABORT, 30.0),
            flush_interval=number(ENV_FLUSH, 0.2),
            buffer_events=int(number(ENV_BUFFER, 200_000)),
        )


def _recorder_config(settings: RecordSettings) -> RecorderConfig:
    return RecorderConfig(
        run_dir=Path(settings.run_dir),  # type: ignore[arg-type]
        mode=settings.mode,
        flush_interval=settings.flush_interval,
        stall_timeout=settings.stall_timeout,
        abort_timeout=settings.abort_timeout,
        capacity=settings.buffer_events,
    )


def torch_recorder(settings: RecordSettings) -> RecorderHooks:
    """The recorder for a torch rank: profiler ranges and clock alignment over torch.distributed."""
    if not settings.enabled:
        return NullRecorder()
    import torch

    from pipetrace.recorder.clock import torch_int_exchange
    from pipetrace.recorder.profiler import TorchProfilerRanges

    return Recorder(
        _recorder_config(settings),
        framework="torch",
        framework_version=torch.__version__,
        profiler=TorchProfilerRanges(),
        clock_exchange=torch_int_exchange(),
    )


def mindspore_recorder(settings: RecordSettings) -> RecorderHooks:
    """The recorder for a MindSpore rank: the same recorder and trace format (header
    framework "mindspore"), profiler ranges through MindSpore's RecordFunction, clock
    alignment over mindspore.communication (which must be initialised: the MindSpore runner
    makes its recorder after joining the cluster)."""
    if not settings.enabled:
        return NullRecorder()
    import mindspore

    from pipetrace.recorder.clock import mindspore_int_exchange
    from pipetrace.recorder.profiler import MindSporeProfilerRanges

    return Recorder(
        _recorder_config(settings),
        framework="mindspore",
        framework_version=mindspore.__version__,
        profiler=MindSporeProfilerRanges(),
        clock_exchange=mindspore_int_exchange(),
    )
