"""The `DeviceBackend` for CUDA through torch (imported here, lazily: only when asked for)."""

from __future__ import annotations

from typing import Any


class CudaBackend:
    """Events and streams of one CUDA device; `torch.cuda.Event` is a `DeviceEvent` as is."""

    name = "cuda"

    def __init__(self, device: Any = None) -> None:
        import torch

        self._cuda = torch.cuda
        self.device = torch.device("cuda") if device is None else torch.device(device)

    def new_event(self) -> Any:
        return self._cuda.Event(enable_timing=True)

    def current_stream(self) -> Any:
        return self._cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        # High priority, so that an anchor event is not queued behind other streams' work.
        return self._cuda.Stream(self.device, priority=-1)

    def synchronize(self) -> None:
        self._cuda.synchronize(self.device)


def cuda_backend(device: Any = None) -> CudaBackend | None:
    """The CUDA backend for ``device``, or None when torch or a CUDA device is missing (on
    CPU, host times are already device times and no timer is needed)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    if device is not None and torch.device(device).type != "cuda":
        return None
    return CudaBackend(device)
