"""pipetrace: trace-driven profiling and debugging for pipeline-parallel training."""

from __future__ import annotations

__version__ = "0.1.0"
