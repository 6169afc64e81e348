"""Every verb that reads a run, through its command line, on damaged runs: an exit code of
0, 1 or 2 (a refusal in one line), never a traceback, never a hang.

`tests/analyze/test_damage_property.py` holds the rule for what damage must be reported and
runs the verbs' library paths on many mutations; this test runs the commands themselves
(`analyze`, `analyze --json`, `export`, `diff`, `merge`, and the TUI app headless, as
`pipetrace tui` runs it, which needs a terminal) on a few, derandomized so the suite stays
fast and stable.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
from pathlib import Path

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipetrace.cli import main
from pipetrace.recorder import format as fmt
from pipetrace.tui.app import PipetraceApp

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
SECONDS_PER_VERB = 30


def _alarm(*_: object) -> None:
    raise AssertionError(f"a verb ran for more than {SECONDS_PER_VERB} s")


def run_verb(capsys, *args: str) -> int:
    """The command's exit code; no traceback, and a refusal (exit 2) is one line."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS_PER_VERB)
    try:
        code = main(list(args))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capsys.readouterr()
    assert code in (0, 1, 2), (args, code, err)
    assert "Traceback" not in err, (args, err)
    assert code != 2 or err.count("\n") == 1, (args, err)
    if "--json" in args and code != 2:
        orjson.loads(out)
    return code


async def tui_exit_code(run_dir: Path) -> int:
    """Load the run in the TUI headless, draw it, quit: the code `pipetrace tui` exits with."""
    app = PipetraceApp(run_dir)
    async with app.run_test(size=(100, 30)) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        await pilot.press("q")
    assert app.return_code in (0, 2)
    assert app.return_code == 0 or "\n" not in (app.load_error or "\n")
    return app.return_code


@settings(
    max_examples=4,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    sample=st.sampled_from(["clean-1f1b", "clean-zbv", "fault-hang"]),
    rank=st.integers(0, 1),
    where=st.floats(0, 1),
    byte=st.integers(0, 255),
)
def test_every_verb_survives_a_damaged_run(tmp_path_factory, capsys, sample, rank, where, byte):
    run = tmp_path_factory.mktemp("damaged") / sample
    shutil.copytree(SAMPLES / sample, run)
    log = fmt.rank_log_path(run, rank)
    data = log.read_bytes()
    start = data.index(b"\n") + 1  # the header stays: a foreign header is another test's
    i = start + int(where * (len(data) - start - 1))
    log.write_bytes(data[:i] + bytes([byte]) + data[i + 1 :])

    analyzed = run_verb(capsys, "analyze", str(run))
    assert run_verb(capsys, "analyze", str(run), "--json") == analyzed
    run_verb(capsys, "export", str(run), "-o", str(run.parent / "run.pftrace"))
    run_verb(capsys, "diff", str(SAMPLES / sample), str(run))
    run_verb(capsys, "merge", str(run), "-o", str(run.parent / "merged"))
    assert asyncio.run(asyncio.wait_for(tui_exit_code(run), SECONDS_PER_VERB)) in (0, 2)
