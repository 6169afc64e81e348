"""Profiler ranges for each step, so a user's own profiler trace shows pipetrace's steps
(torch's profiler, or MindSpore's).

`torch.profiler.record_function` costs ~8.5 µs per call even with no profiler running (field
notes), far more than recording an event. So the recorder asks `active()` (~0.1 µs) at each
iteration's start (profilers start and step between iterations) and opens a range for each
step of an iteration only while a profiler is collecting, through the fast C++ RecordFunction.
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


class MindSporeProfilerRanges:
    """Ranges named ``pipetrace/<step>`` through MindSpore's profiler (``RecordFunction``).

    A range (start and stop) costs ~3.5 µs, so it is opened only while a MindSpore profiler
    exists (``ProfilerInterface.is_initialized``: from the profiler's construction until its
    analysis clears it), which `active` reads in ~0.1 µs. On CPU, MindSpore 2.10 does not put
    these ranges in its trace_view.json (only ops); Ascend was not tried.
    """

    def __init__(self) -> None:
        from mindspore.profiler.common.record_function import RecordFunction

        self._record = RecordFunction
        try:
            from mindspore.profiler.profiler_interface import ProfilerInterface
        except ImportError:  # no way to tell: pay for the ranges always
            self.active = _always
        else:
            self.active = lambda: ProfilerInterface.is_initialized

    def begin(self, name: str) -> Any:
        handle = self._record(name)
        handle.start()
        return handle

    def end(self, handle: Any) -> None:
        handle.stop()


def _always() -> bool:
    return True
