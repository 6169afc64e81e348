"""The event writer's guarantees: bounded memory by backpressure, and no lost events."""

from __future__ import annotations

import orjson
import pytest

from pipetrace.recorder import queue as queue_module
from pipetrace.recorder.queue import RecordQueue
from pipetrace.recorder.writer import EventWriter


def _line(record: tuple) -> bytes:
    return b'{"n":%d}\n' % record[0]


def _open(queue, writer: EventWriter, capacity: int) -> None:
    """Each queue writes ``(n,)`` as ``{"n": n}``: the Python one by its encoder, the C one
    by its fallback (no layout of its own fits such a record)."""
    if isinstance(queue, RecordQueue):
        queue.open(lambda records: b"".join(map(_line, records)), capacity, writer.flush)
    else:
        queue.open((), 0, {}, None, {}, None, _line, capacity, writer.flush)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_full_buffer_is_written_by_the_appending_thread(tmp_path, compiled):
    path = tmp_path / "log.ndjson"
    queue = queue_module.new_queue(int, compiled=compiled, step_token=None, close_token=None)
    # the background thread never runs in this test (hour-long interval): only backpressure writes
    writer = EventWriter(path, {"h": 1}, queue, flush_interval=3600)
    _open(queue, writer, capacity=100)
    for n in range(250):
        queue.append((n,))
        assert writer.pending < 100  # never more than the bound waits in memory
    assert writer.events_written == 200
    writer.close()
    lines = path.read_bytes().splitlines()
    assert [orjson.loads(line)["n"] for line in lines[1:]] == list(range(250))
