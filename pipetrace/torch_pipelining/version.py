"""Which torch releases the adapter was verified against.

The adapter hooks private parts of ``torch.distributed.pipelining`` (``_batch_p2p``, the
``record_function`` call of ``_PipelineScheduleRuntime``, the stages' ``get_*_ops`` and
``*_one_chunk`` methods). Those change between releases, so an unverified release is refused
with one line rather than recorded wrongly.
"""

from __future__ import annotations

SUPPORTED_TORCH_VERSIONS = ("2.13.0",)


def release_of(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: local build tags do not change the pipelining code."""
    return version.split("+", 1)[0]


def unsupported_reason(version: str) -> str | None:
    """None when ``version`` was verified; otherwise the one line to tell the user."""
    if release_of(version) in SUPPORTED_TORCH_VERSIONS:
        return None
    return (
        f"pipetrace.torch_pipelining supports torch {', '.join(SUPPORTED_TORCH_VERSIONS)}; "
        f"torch {version} is installed, so this run is not recorded"
    )
