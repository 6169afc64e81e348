"""Can this run use the MindSpore backend? Answered in the parent, before any process starts.

Pure Python: MindSpore is looked up (``importlib`` metadata), never imported, so a refusal
costs milliseconds and says exactly what to install or which flag to drop.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import TYPE_CHECKING

from pipetrace.errors import PipetraceError

if TYPE_CHECKING:
    from pipetrace.runtime.config import RunConfig

INSTALL_HINT = "pip install 'pipetrace[mindspore]'"

# MindSpore releases whose C extension is built against the numpy 1 C API: with numpy 2 they
# print "A module that was compiled using NumPy 1.x cannot be run in NumPy 2" and then fail
# inside ordinary ops (Tensor.T raises SystemError on 2.10.0). Newer releases are let through.
_NUMPY1_ONLY_UP_TO = (2, 10)


def _version(package: str) -> tuple[int, ...] | None:
    try:
        text = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _mindspore_installed() -> bool:
    return importlib.util.find_spec("mindspore") is not None


def installed_problem() -> str | None:
    """Why MindSpore cannot run in this environment (with the fix), or None."""
    if not _mindspore_installed():
        return f"the MindSpore backend needs MindSpore, which is not installed: {INSTALL_HINT}"
    mindspore = _version("mindspore")
    numpy = _version("numpy")
    if mindspore and numpy and numpy[0] >= 2 and mindspore[:2] <= _NUMPY1_ONLY_UP_TO:
        return (
            f"MindSpore {'.'.join(map(str, mindspore))} needs numpy<2, but numpy "
            f"{'.'.join(map(str, numpy))} is installed: {INSTALL_HINT} (it pins numpy<2)"
        )
    return None


def check_run(config: RunConfig) -> None:
    """Raise PipetraceError (exit 2) if ``config`` cannot run on the MindSpore backend."""
    problem = installed_problem()
    if problem is not None:
        raise PipetraceError(problem)
    unsupported = []
    if config.data_parallel > 1 or config.fsdp:
        unsupported.append("--data-parallel/--fsdp (torch FSDP2 only)")
    if config.tie_weights:
        unsupported.append("--tie-weights (its TIED_REDUCE exchange is written for torch)")
    if config.torch_profiler:
        unsupported.append("--torch-profiler (use MindSpore's own profiler in your script)")
    if unsupported:
        raise PipetraceError("the MindSpore backend does not support " + "; ".join(unsupported))
