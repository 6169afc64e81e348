"""A hung rank's P2P error is the hang's symptom, whichever rank's record came first.

When a rank in a deadlock gives up its wait, gloo closes its connections before the rank
records its own error: under load the peer's "connection closed" is recorded first. The
sample `fault-drop-send` (a real gloo run) is replayed with the aborts of ranks 0 and 2 moved
after rank 1's lost connection, the order such a race leaves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipetrace.analyze import findings as fk

from .conftest import analyzed

SAMPLE = Path(__file__).resolve().parents[2] / "sample_traces" / "fault-drop-send"


def _last_event(path: Path) -> dict:
    return json.loads(path.read_text().splitlines()[-1])


def _set_last_event(path: Path, event: dict) -> None:
    lines = path.read_text().splitlines()
    lines[-1] = json.dumps(event)
    path.write_text("\n".join(lines) + "\n")


def test_lost_connection_recorded_before_the_peer_gave_up_is_a_symptom(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run)
    closed = _last_event(run / "rank-00001.ndjson")
    assert "connection closed" in closed["message"].lower()
    for rank in (0, 2):
        log = run / f"rank-0000{rank}.ndjson"
        abort = _last_event(log)
        assert abort["e"] == "abort"
        _set_last_event(log, {**abort, "t": closed["t"] + 1_000_000})

    findings = analyzed(run).findings
    seen = [(f.severity, f.kind, f.ranks, f.cause) for f in findings]
    assert findings[0].kind == fk.DEADLOCK, seen
    lost = next(f for f in findings if f.kind == fk.RANK_FAILED and f.ranks == [1])
    assert lost.severity == fk.WARNING, seen
    assert "symptom of the hang" in lost.cause and "closed" in lost.cause
