"""Runs of the real torch runtime (gloo on local rank processes), recorded: for the tests
that need real processes. Every other export test records with the fake cluster
(`pipetrace.testing.cluster`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TorchRecording:
    """Recorder factory for `pipetrace.runtime.launch`: the real torch recorder writing into
    ``run_dir`` (picklable: each rank process unpickles it)."""

    run_dir: str

    def __call__(self, rank: int, world_size: int):
        from pipetrace.recorder.setup import RecordSettings, torch_recorder

        return torch_recorder(RecordSettings(run_dir=self.run_dir, flush_interval=0.05))


def record_torch_run(
    run_dir: Path,
    *,
    schedule: str,
    ranks: int = 2,
    microbatches: int = 4,
    steps: int = 1,
    overlap_p2p: bool = False,
):
    """A run of the real torch runtime (gloo on local rank processes), recorded."""
    from pipetrace.runtime.config import RunConfig
    from pipetrace.runtime.launch import launch

    config = RunConfig(
        schedule,
        ranks=ranks,
        microbatches=microbatches,
        steps=steps,
        overlap_p2p=overlap_p2p,
        timeout=30.0,
        out=str(run_dir),
    )
    return launch([config], make_recorder=TorchRecording(str(run_dir)), kill_grace=2.0)
