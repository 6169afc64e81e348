"""``python -m pipetrace.runtime.mindspore.worker --schedule ...``: one rank of the demo run
as a MindSpore worker (msrun or your own MS_* setup). The same as
``python -m pipetrace.runtime.worker --backend mindspore ...`` (`pipetrace.runtime.worker`,
the one demo worker for every backend); kept so that msrun command lines need no flag.
"""

from __future__ import annotations

import sys

from pipetrace.runtime.rank_cli import entry
from pipetrace.runtime.worker import main

if __name__ == "__main__":
    entry(
        main,
        "python -m pipetrace.runtime.mindspore.worker",
        ["--backend", "mindspore", *sys.argv[1:]],
    )
