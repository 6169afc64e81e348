"""The same runtime under torchrun: the example user script with its own model, and the
demo worker module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipetrace
from pipetrace.runtime.launch import free_port

pytestmark = pytest.mark.multiproc

REPO = Path(pipetrace.__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")


def torchrun(*args: str, ranks: int = 2) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    command = [
        str(TORCHRUN),
        "--nproc-per-node",
        str(ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=REPO)


def test_example_user_script_trains_with_exact_gradients():
    done = torchrun(
        "examples/train_torchrun.py",
        "--schedule",
        "zbv",
        "--microbatches",
        "4",
        "--steps",
        "3",
        "--check",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert (
        "rank 0: stages [0, 3]: 17 checked, match" in out
        and "rank 1: stages [1, 2]: 20 checked, match" in out
    )
    assert [line.split()[3] for line in out.splitlines() if " loss " in line] == ["1", "2", "3"]


def test_worker_module_runs_the_demo_with_parity():
    done = torchrun(
        "-m",
        "pipetrace.runtime.worker",
        "--schedule",
        "interleaved-1f1b",
        "--microbatches",
        "4",
        "--steps",
        "2",
        "--overlap-p2p",
        "--check-parity",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("parity ok") == 2
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("step ")] == [
        "1",
        "2",
    ]


@pytest.mark.parametrize("schedule, ranks", [("1f1b", 2), ("interleaved-1f1b", 2), ("1f1b", 1)])
def test_tied_weights_accumulate_over_steps_as_one_process_does(schedule, ranks):
    """The tied gradient's exchange is of this iteration's part only: with the accumulated
    gradient exchanged, a second step without zeroing counted the first one twice. On one
    rank the one stage holds both names of the parameter (it was refused)."""
    done = torchrun("tests/runtime/scripts/tied_accumulation.py", schedule, ranks=ranks)
    assert done.returncode == 0, done.stdout + done.stderr
    verdicts = [line for line in done.stdout.splitlines() if "weight:" in line]
    assert len(verdicts) == ranks and all(line.endswith(": match") for line in verdicts)
