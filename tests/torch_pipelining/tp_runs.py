"""Helpers for the torch.distributed.pipelining tests: run and analyze through the CLI (the
public interface) and read the logs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def pipetrace(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``pipetrace ARGS...`` in a fresh process (its exit code, stdout and stderr)."""
    return subprocess.run(
        [sys.executable, "-m", "pipetrace", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def analyze_json(run_dir: Path) -> tuple[int, dict[str, Any]]:
    """``pipetrace analyze --json``'s exit code and output."""
    done = pipetrace("analyze", "--json", str(run_dir), timeout=120)
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


def errors(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["severity"] == "error"]


def events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    lines = (run_dir / f"rank-{rank:05d}.ndjson").read_text().splitlines()
    return [json.loads(line) for line in lines[1:]]


def meta(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "meta.json").read_text())
