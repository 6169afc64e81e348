"""Another revision's pipetrace, for the benchmarks that compare against it in one invocation
(``--baseline REV``): the machines are noisy, so a ratio is only meaningful between sides
measured in the same minutes."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BUILD_FILES = ("setup.py", "pyproject.toml")
"""What building the revision's C extensions needs besides its package."""


def checkout(revision: str) -> Path:
    """``revision``'s pipetrace package in a new temporary directory (the caller removes it),
    its C extensions built in place as `make` builds this tree's: a side without them would
    run the pure-Python fallbacks and measure those. Put that directory on a child's
    PYTHONPATH to run the revision's code."""
    root = Path(tempfile.mkdtemp(prefix="pipetrace-baseline-"))
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", revision, "pipetrace", *_BUILD_FILES],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout.split()
    archive = subprocess.run(
        ["git", "archive", revision, *listed], check=True, capture_output=True, cwd=ROOT
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    if "setup.py" in listed:
        build = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
        built = subprocess.run(build, cwd=root, capture_output=True, text=True)
        if built.returncode != 0:
            print(f"baseline {revision}: its C extensions did not build; it runs without them")
    return root
