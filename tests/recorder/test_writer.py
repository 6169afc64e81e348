"""The event writer's guarantees: bounded memory by backpressure, and no lost events."""

from __future__ import annotations

import orjson

from pipetrace.recorder.writer import EventWriter


def test_a_full_buffer_is_written_by_the_appending_thread(tmp_path):
    path = tmp_path / "log.ndjson"
    # the background thread never runs in this test (hour-long interval): only backpressure writes
    writer = EventWriter(
        path,
        {"h": 1},
        lambda recs: b"".join(b'{"n":%d}\n' % rec[0] for rec in recs),
        flush_interval=3600,
        capacity=100,
    )
    for n in range(250):
        writer.append((n,))
        assert writer.pending < 100  # never more than the bound waits in memory
    assert writer.events_written == 200
    writer.close()
    lines = path.read_bytes().splitlines()
    assert [orjson.loads(line)["n"] for line in lines[1:]] == list(range(250))
