"""The event writer's guarantees: bounded memory by backpressure, and no lost events."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("compiled", [False, True])
def test_a_full_disk_loses_events_but_never_the_run(tmp_path, compiled, capfd):
    """Writes fail (/dev/full: ENOSPC) from the 100th event to the 300th: each flush and each
    backpressure write goes on (the training would), the user is told once, memory stays
    bounded, and once writes succeed again the log goes on after one cut line."""
    path = tmp_path / "log.ndjson"
    queue = queue_module.new_queue(int, compiled=compiled, step_token=None, close_token=None)
    writer = EventWriter(path, {"h": 1}, queue, flush_interval=3600)
    _open(queue, writer, capacity=50)
    kept = os.dup(writer._fd)
    full = os.open("/dev/full", os.O_WRONLY)
    for n in range(400):
        if n == 100:
            writer.flush()
            os.dup2(full, writer._fd)
        if n == 300:
            os.dup2(kept, writer._fd)
        queue.append((n,))
        assert writer.pending < 50
        if n % 30 == 0:
            writer.flush()
    writer.close()
    os.close(full)
    os.close(kept)
    told = capfd.readouterr().err
    assert told.count("events are lost until it can write again") == 1
    assert "No space left on device" in told
    lines = path.read_bytes().splitlines()
    written = [orjson.loads(line)["n"] for line in lines[1:] if line]
    assert written[:100] == list(range(100)) and written[-99:] == list(range(301, 400))
    assert set(range(100, 300)) - set(written)  # lost, not kept in memory


@pytest.mark.parametrize("compiled", [False, True])
def test_a_process_that_exits_without_closing_writes_what_waits(tmp_path, compiled):
    """A script that ends without closing its recording: the flush thread is a daemon and
    dies with the interpreter, so what waits is written at exit instead."""
    path = tmp_path / "log.ndjson"
    script = f"""
import sys
sys.path[:0] = {[str(Path(__file__).parent), *sys.path]!r}
from test_writer import EventWriter, _open, queue_module
queue = queue_module.new_queue(int, compiled={compiled}, step_token=None, close_token=None)
writer = EventWriter({str(path)!r}, {{"h": 1}}, queue, flush_interval=3600)
_open(queue, writer, capacity=1000)
for n in range(250):
    queue.append((n,))
sys.exit(0)
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    lines = path.read_bytes().splitlines()
    assert [orjson.loads(line)["n"] for line in lines[1:]] == list(range(250))
