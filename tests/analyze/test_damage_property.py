"""One-byte mutations of clean sample logs: damage is always reported, no verb crashes.

The rule, for a mutation of one byte (replaced, deleted or inserted) in an event line of one
rank's log (the header line is left alone):

*Reported* means the loaded run carries an input problem of severity warning (so
`pipetrace analyze` exits non-zero and lists it in the report and the JSON), or one of the
two of severity info the format provides for: an event type this version does not know (newer
writers may add them) and a torn last line (what a kill mid-write leaves).

A mutation is *exempt* (it may pass unreported) exactly when the mutated log still has the
same lines (the last one terminated or not), the mutated line decodes to a JSON object with
the same keys, and each value that changed is one the recorder could have written:

- a number that is still a number of the same type (an int an int), in any field but ``t``
  and ``id``, and a list of ints still a list of ints (a ``shape``, ``stages``): a different
  count, size, rank, offset or shape is a different measurement (a send and recv that then
  disagree are a finding), not damage;
- ``t`` still a non-negative int, at least the line before's time (the header's ``t0`` for
  the first) minus `ORDER_TOLERANCE_NS`, and the line after's at least it minus that;
- a string that is still a string, in any field but ``e``, ``step``, ``op`` and ``phase``
  (free text such as a thread name or dtype; ``ch``, which readers keep when unknown);
- a ``step`` text that still parses (another step: a divergence from the plan is a finding);
- the same rules inside lists and objects (a run_start's ``plan`` holds step texts).

Everything else (a line that no longer decodes, a key renamed, a type changed, an ``id``
changed, which leaves a completion dangling or an id used twice, a time out of order, an
unparsable step text, an ``e``, ``op`` or clock ``phase`` outside its set, a line split or
merged) must be reported. Every mutation, exempt or not, must leave every verb that reads a
run (analyze and its JSON, export, diff, the TUI's loading and indexing) free of tracebacks
and hangs.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.diff import diff_runs
from pipetrace.analyze.load import load_run
from pipetrace.analyze.reader import ORDER_TOLERANCE_NS, TraceFormatError
from pipetrace.analyze.report import report_lines
from pipetrace.export import export_run
from pipetrace.recorder import format as fmt
from pipetrace.schedule.ir import ScheduleError, parse_step
from pipetrace.tui.session import open_session

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
CLEAN = sorted(p.name for p in SAMPLES.glob("clean-*"))
ENUMERATED = ("e", "op", "phase")
"""String fields whose values form a closed set (``op`` is checked by the format's type)."""
SECONDS_PER_EXAMPLE = 30


def _parses(text: Any) -> bool:
    try:
        return isinstance(text, str) and parse_step(text) is not None
    except (ScheduleError, ValueError):
        return False


def _same_kind(old: Any, new: Any, key: str) -> bool:
    """Is ``new`` a value the recorder could have written where it wrote ``old``?"""
    if type(old) is not type(new):
        return False
    if isinstance(old, dict):
        return old.keys() == new.keys() and all(
            _same_kind(old[k], new[k], k) for k in old if old[k] != new[k]
        )
    if isinstance(old, list):
        if all(type(x) is int for x in old + new):
            return True  # another shape or stage list: a different measurement
        return len(old) == len(new) and all(
            _same_kind(a, b, key) for a, b in zip(old, new) if a != b
        )
    if key in ("step", "plan"):
        return _parses(new)
    return key not in ENUMERATED and key != "id"  # another number, or free text


def _in_order(events: list[Any], index: int, t0: int) -> bool:
    """Is the mutated line's time non-negative and in order with its neighbours?"""
    times = [e.get("t") if isinstance(e, dict) else None for e in events]
    t = times[index]
    before = next((x for x in reversed(times[:index]) if isinstance(x, int)), t0)
    after = next((x for x in times[index + 1 :] if isinstance(x, int)), None)
    return (
        t >= 0
        and t >= before - ORDER_TOLERANCE_NS
        and (after is None or after >= t - ORDER_TOLERANCE_NS)
    )


def _lines(data: bytes) -> list[bytes]:
    """The lines of a log, whether or not its last one is terminated."""
    return data.removesuffix(b"\n").split(b"\n")


def exempt(original: bytes, mutated: bytes) -> bool:
    """The module docstring's rule."""
    old_lines, new_lines = _lines(original), _lines(mutated)
    if len(old_lines) != len(new_lines):
        return False
    changed = [i for i, (a, b) in enumerate(zip(old_lines, new_lines)) if a != b]
    if not changed:
        return True
    (index,) = changed
    try:
        old, new = orjson.loads(old_lines[index]), orjson.loads(new_lines[index])
    except orjson.JSONDecodeError:
        return False
    if old == new:
        return True  # e.g. a space between tokens
    if not isinstance(new, dict) or old.keys() != new.keys():
        return False
    for key in old:
        if old[key] == new[key]:
            continue
        if key == "t":
            if type(new["t"]) is not int:
                return False
            events = [orjson.loads(line) for line in new_lines[1:] if line]
            if not _in_order(events, index - 1, orjson.loads(new_lines[0])["t0"]):
                return False
        elif not _same_kind(old[key], new[key], key):
            return False
    return True


def mutate(data: bytes, op: str, where: float, byte: int) -> bytes:
    start = data.index(b"\n") + 1  # the header line stays as it is
    i = start + int(where * (len(data) - start - 1))
    if op == "replace":
        return data[:i] + bytes([byte]) + data[i + 1 :]
    if op == "delete":
        return data[:i] + data[i + 1 :]
    return data[:i] + bytes([byte]) + data[i:]


def reported(run) -> bool:
    return any(
        p.severity == "warning"
        or (p.severity == "info" and ("unknown type" in p.message or "torn" in p.message))
        for p in run.problems
    )


class _Hung(Exception):
    pass


def _alarm(*_: object) -> None:
    raise _Hung(f"a verb ran for more than {SECONDS_PER_EXAMPLE} s")


def every_verb(path: Path, reference, out: Path) -> Any:
    """Run each verb's reading path on ``path``; returns the loaded run (None if refused)."""
    try:
        run = load_run(path, workers=0)
    except TraceFormatError:
        return None
    result = analyze(run)
    result.to_json()
    report_lines(result)
    diff_runs(reference, result)
    export_run(run, out, findings=result.findings)
    export_run(run, out.with_suffix(".json"), fmt="chrome-json", findings=result.findings)
    open_session(path, workers=0)
    return run


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    sample=st.sampled_from(CLEAN),
    rank=st.integers(0, 1),
    op=st.sampled_from(["replace", "delete", "insert"]),
    where=st.floats(0, 1),
    byte=st.integers(0, 255),
)
def test_one_byte_mutations_are_reported_unless_exempt(
    tmp_path_factory, sample, rank, op, where, byte
):
    path = tmp_path_factory.mktemp("mutated") / sample
    shutil.copytree(SAMPLES / sample, path)
    log = fmt.rank_log_path(path, rank)
    original = log.read_bytes()
    mutated = mutate(original, op, where, byte)
    log.write_bytes(mutated)
    reference = analyze(load_run(SAMPLES / sample, workers=0))
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS_PER_EXAMPLE)
    try:
        run = every_verb(path, reference, path.parent / "trace.pftrace")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if run is not None and not exempt(original, mutated):
        assert reported(run), (op, where, byte, [p.message for p in run.problems])
