"""Make a freshly recorded run look settled to the cache.

The cache (`pipetrace.analyze.cache`) never keeps a log written in the last seconds: it may
still be growing. A test that records a run and wants it cached dates its logs back.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipetrace.recorder import format as fmt


def age_logs(run_dir: Path) -> None:
    """Date every rank log of ``run_dir`` a minute before its meta.json."""
    past = os.stat(run_dir / fmt.META_FILE).st_mtime_ns - 60 * 10**9
    for log in run_dir.glob("rank-*.ndjson"):
        os.utime(log, ns=(past, past))
