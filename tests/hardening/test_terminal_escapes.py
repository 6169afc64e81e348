"""A trace from someone else cannot drive the terminal of whoever reads it (docs/security.md):
escape sequences in its strings (an exception message here) print as ``\\xNN`` text."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest

from pipetrace.cli import main
from pipetrace.recorder import format as fmt

SAMPLE = Path(__file__).resolve().parents[2] / "sample_traces" / "fault-crash"
# OSC 52 (set the clipboard), an 8-bit CSI, a DCS and a right-to-left override
HOSTILE = "boom\x1b]52;c;cHduZWQ=\x1b\\ \x9b31m \x1bP1$r\x1b\\ \u202egnp.exe"


@pytest.fixture
def hostile_run(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run)
    for log in run.glob("rank-*.ndjson"):
        lines = log.read_bytes().splitlines()
        for i, line in enumerate(lines):
            event = orjson.loads(line)
            if event.get("e") == fmt.EXCEPTION:
                event["message"] = HOSTILE
                lines[i] = orjson.dumps(event)
        log.write_bytes(b"\n".join(lines) + b"\n")
    return run


def unsafe(text: str) -> list[str]:
    return [c for c in text if c in "\x1b\x9b\u202e"]


def test_analyze_prints_a_trace_s_escapes_as_text(hostile_run, capsys):
    for _ in range(2):  # the second prints the text kept beside the run's cache
        assert main(["analyze", str(hostile_run)]) == 1
        out = capsys.readouterr().out
        assert "boom\\x1b]52;c;cHduZWQ=" in out and "\\u202egnp.exe" in out
        assert unsafe(out) == []


def test_json_keeps_the_trace_s_text(hostile_run, capsys):
    main(["analyze", "--json", str(hostile_run)])
    assert HOSTILE in orjson.loads(capsys.readouterr().out)["findings"][0]["message"]


def test_the_tui_draws_the_trace_s_text_without_its_escapes(hostile_run):
    from pipetrace.tui.app import PipetraceApp
    from tests.tui.conftest import run_async, screen_text, wait_loaded

    @run_async
    async def findings_shown() -> str:
        app = PipetraceApp(hostile_run)
        async with app.run_test(size=(160, 40)) as pilot:
            await wait_loaded(pilot)
            await pilot.press("f")
            await wait_loaded(pilot)
            return screen_text(app)

    text = findings_shown()
    assert "raised RuntimeError: boom]52;c;cHduZWQ=" in text
    assert unsafe(text) == []
