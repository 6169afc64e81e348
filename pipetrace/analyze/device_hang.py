"""device_hang: ranks that ended their run cleanly with device work never completed.

Such a rank's host finished every step and closed the recording (`run_end`), but its device
never got through what the host had enqueued: the recorder's drain gave up and listed it
(`device_pending`). No hang finding reads it (every rank finished); the job's exit, or its
next synchronization, waits on that device. A rank that stalled or failed instead is told
by `rank_stalled` / `rank_failed`, whose causes name its device work.
"""

from __future__ import annotations

from pipetrace.analyze import findings as fk
from pipetrace.analyze.device_times import pending_work
from pipetrace.analyze.findings import Finding, StepRef
from pipetrace.analyze.model import RankState, RankTimeline, Run
from pipetrace.recorder import format as fmt

NOTE = "never completed on the device"


def find_device_hangs(run: Run) -> list[Finding]:
    pending = [
        p
        for rank in run.present_ranks
        if rank.status.state == RankState.FINISHED
        and _listed_at_end(rank)
        and (p := pending_work(rank)) is not None
    ]
    if not pending:
        return []
    oldest = min(pending, key=lambda p: p.work.enqueued_ns)
    said = "; ".join(
        p.message + (f" ({p.behind} more after it)" if p.behind else "") for p in pending
    )
    return [
        Finding(
            fk.DEVICE_HANG,
            fk.ERROR,
            f"{'a rank' if len(pending) == 1 else f'{len(pending)} ranks'} ended the run with "
            f"device work never completed: {said}",
            "a kernel or transfer the device never finished (a device hang, or a transfer "
            "whose peer never ran its side): the job's exit or next synchronization waits "
            f"on it; start from rank {oldest.rank}'s {oldest.work.label}",
            ranks=[p.rank for p in pending],
            steps=[StepRef(p.rank, p.work.label, note=NOTE) for p in pending],
            details={"device_pending": [p.to_json() for p in pending]},
        )
    ]


def _listed_at_end(rank: RankTimeline) -> bool:
    """Is the rank's last listing of device work its `run_end`'s?"""
    listings = [ev for ev in rank.lifecycle if "device_pending" in ev.fields]
    return bool(listings) and listings[-1].e == fmt.RUN_END
