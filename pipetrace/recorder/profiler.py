"""Profiler ranges for each step, so a user's own profiler trace shows pipetrace's steps.

`torch.profiler.record_function` costs ~8.5 µs per call even with no profiler running (field
notes), far more than recording an event. So the recorder asks `active()` (~0.1 µs) first and
opens a range only while a profiler is collecting, through the fast C++ RecordFunction.
"""

from __future__ import annotations

from typing import Any


class TorchProfilerRanges:
    """Ranges named ``pipetrace/<step>`` through torch's profiler."""

    def __init__(self) -> None:
        import torch

        self.active = torch.autograd._profiler_enabled
        self._record = torch._C._profiler._RecordFunctionFast

    def begin(self, name: str) -> Any:
        handle = self._record(name)
        handle.__enter__()
        return handle

    def end(self, handle: Any) -> None:
        handle.__exit__(None, None, None)
