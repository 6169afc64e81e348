"""Ranks whose process still runs on this host: the run is still being recorded.

A log without its end reads as a rank that was killed or hung; while the job runs, every log
looks like that (and a recv still waiting looks stuck). The headers name each rank's process
(``pid``, ``host``, ``t0``): one still alive here (`run_dir.recording_here`) means the
analysis is of a run in progress.
"""

from __future__ import annotations

from pipetrace.analyze.model import InputProblem, RankState, Run
from pipetrace.recorder.run_dir import recording_here


def still_recording(run: Run) -> list[InputProblem]:
    """One warning per rank whose log has no end and whose process still runs here."""
    return [
        InputProblem(
            "warning",
            f"rank {rank.rank} (pid {rank.header['pid']}) is still running: the run is still "
            "being recorded, so what looks hung or cut short may be in progress (analyze it "
            "again once the job has ended)",
            rank.rank,
        )
        for rank in run.present_ranks
        if rank.status.state == RankState.ENDED and recording_here(rank.header)
    ]
