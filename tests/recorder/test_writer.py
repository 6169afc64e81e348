"""The event writer's guarantees: bounded memory by backpressure, and no lost events."""

from __future__ import annotations

import orjson
import pytest

from pipetrace.errors import PipetraceError
from pipetrace.recorder.setup import RecordSettings
from pipetrace.recorder.writer import EventWriter


def test_a_full_buffer_is_written_by_the_appending_thread(tmp_path):
    path = tmp_path / "log.ndjson"
    # the background thread never runs in this test (hour-long interval): only backpressure writes
    writer = EventWriter(
        path, {"h": 1}, lambda rec: b'{"n":%d}\n' % rec[0], flush_interval=3600, capacity=100
    )
    for n in range(250):
        writer.append((n,))
        assert writer.pending < 100  # never more than the bound waits in memory
    assert writer.events_written == 200
    writer.close()
    lines = path.read_bytes().splitlines()
    assert [orjson.loads(line)["n"] for line in lines[1:]] == list(range(250))


def test_settings_come_from_the_environment():
    settings = RecordSettings.from_env(
        {
            "PIPETRACE_DIR": "run",
            "PIPETRACE_RECORD": "full",
            "PIPETRACE_STALL_TIMEOUT": "5",
            "PIPETRACE_BUFFER_EVENTS": "1000",
        }
    )
    assert settings.enabled and settings.mode == "full" and settings.stall_timeout == 5
    assert settings.buffer_events == 1000
    assert not RecordSettings.from_env({}).enabled
    with pytest.raises(PipetraceError, match="PIPETRACE_STALL_TIMEOUT"):
        RecordSettings.from_env({"PIPETRACE_STALL_TIMEOUT": "soon"})
