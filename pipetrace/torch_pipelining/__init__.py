"""Record any torch.distributed.pipelining job into a pipetrace run directory.

``record(schedule)`` instruments an existing schedule object (see `api`); the analyzers, the
TUI and the Perfetto export then work on the run unchanged. Importing this package does not
import torch.
"""

from pipetrace.torch_pipelining.api import Recording, record
from pipetrace.torch_pipelining.version import SUPPORTED_TORCH_VERSIONS

__all__ = ["SUPPORTED_TORCH_VERSIONS", "Recording", "record"]
