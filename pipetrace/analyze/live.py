"""Ranks whose process still runs on this host: the run is still being recorded.

A log without its end reads as a rank that was killed or hung; while the job runs, every log
looks like that (and a recv still waiting looks stuck). The headers name each rank's process
(``pid``, ``host``, ``t0``): one still alive here, started before it wrote its header (not a
later process that took over the pid), means the analysis is of a run in progress.
"""

from __future__ import annotations

import os
import socket
import sys

from pipetrace.analyze.model import InputProblem, RankState, Run

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def still_recording(run: Run) -> list[InputProblem]:
    """One warning per rank whose log has no end and whose process still runs here."""
    if not sys.platform.startswith("linux"):
        return []
    host = socket.gethostname()
    problems = []
    for rank in run.present_ranks:
        header = rank.header
        if rank.status.state != RankState.ENDED or header.get("host") != host:
            continue
        pid, t0 = header.get("pid"), header.get("t0")
        if isinstance(pid, int) and isinstance(t0, int) and _alive_since(pid, t0):
            problems.append(
                InputProblem(
                    "warning",
                    f"rank {rank.rank} (pid {pid}) is still running: the run is still being "
                    "recorded, so what looks hung or cut short may be in progress (analyze "
                    "it again once the job has ended)",
                    rank.rank,
                )
            )
    return problems


def _alive_since(pid: int, t0_ns: int) -> bool:
    """Whether process ``pid`` runs and started before ``t0_ns`` (epoch ns) or about then."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
        with open("/proc/stat", "rb") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith(b"btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    fields = stat.rsplit(b")", 1)[-1].split()  # the name, in parentheses, may hold spaces
    if len(fields) < 20 or fields[0] == b"Z":  # a zombie has ended
        return False
    started_s = boot + int(fields[19]) / _TICKS
    return started_s <= t0_ns / 1e9 + 2  # btime and the ticks are coarse: a margin
