"""Another revision's pipetrace, for the benchmarks that compare against it in one invocation
(``--baseline REV``): the machines are noisy, so a ratio is only meaningful between sides
measured in the same minutes."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout(revision: str) -> Path:
    """``revision``'s pipetrace package in a new temporary directory (the caller removes it):
    put that directory on a child's PYTHONPATH to run the revision's code."""
    root = Path(tempfile.mkdtemp(prefix="pipetrace-baseline-"))
    archive = subprocess.run(
        ["git", "archive", revision, "pipetrace"], check=True, capture_output=True, cwd=ROOT
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root
