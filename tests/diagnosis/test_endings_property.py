"""Whatever way a rank's log ends, the findings tell it right: no negative duration, no
None/"(no step)" hole, one story per rank.

Property-based: a run (a sample trace, a synthetic run, or the handwritten one) has one rank's
log cut after a random event, perhaps with a torn fragment of the next line, as a kill or a
lost flush leaves it; the analysis of what remains must hold the invariants.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.load import load_run
from pipetrace.analyze.reader import TraceFormatError
from pipetrace.testing.synthetic import write_synthetic_run

from .handwritten import HandRun

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
SAMPLE_NAMES = sorted(p.name for p in SAMPLES.iterdir() if (p / "meta.json").is_file())
HOLE = re.compile(r"\bNone\b|\(no step\)|at least -")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Every run the property draws from, by name."""
    base = tmp_path_factory.mktemp("sources")
    found = {f"sample-{name}": SAMPLES / name for name in SAMPLE_NAMES}
    for schedule in ("1f1b", "zbv"):
        path = base / f"synthetic-{schedule}"
        write_synthetic_run(path, schedule=schedule, num_ranks=2, num_microbatches=2)
        found[path.name] = path
    found["handwritten"] = HandRun().write(base / "handwritten")
    return found


def stories(document: dict) -> dict[int, set[str]]:
    """What the findings say about how each rank ended: its terminal state as every
    rank_stalled chain that ends at it and its rank_failed finding tell it."""
    told: dict[int, set[str]] = {}
    for f in document["findings"]:
        details = f["details"]
        if f["kind"] == "rank_stalled" and details.get("terminal_state") != "transfer":
            told.setdefault(details["terminal_rank"], set()).add(details["terminal_state"])
        if f["kind"] == "rank_failed":  # one rank's, or several that ended alike
            for member in details.get("ended", [details]):
                told.setdefault(member.get("rank", f["ranks"][0]), set()).add(member["ending"])
    return told


def assert_told_right(document: dict) -> None:
    for f in document["findings"]:
        text = f"{f['message']} {f['cause']}"
        assert not HOLE.search(text), text
        assert all(isinstance(s["step"], str) for s in f["steps"]), f["steps"]
        if f["time_ns"] is not None:
            assert f["time_ns"][0] <= f["time_ns"][1], f
        if f["kind"] == "rank_stalled":
            assert "terminal_rank" in f["details"], f
    for rank, told in stories(document).items():
        assert len(told) == 1, (
            rank,
            told,
            [(f["kind"], f["message"]) for f in document["findings"]],
        )
        finished = document["ranks"][rank]["state"] == "finished"
        assert not finished or told == {"exited"}, (rank, told)


def cut_log(run: Path, rank: int, keep: float, torn: bool) -> None:
    """Keep the header and the first ``keep`` share of the rank's events (of the lines the
    file has now), and perhaps the first half of the next line without its newline."""
    log = run / f"rank-{rank:05d}.ndjson"
    lines = log.read_bytes().splitlines(keepends=True)
    n = 1 + round(keep * (len(lines) - 1))
    tail = lines[n][: len(lines[n]) // 2] if torn and n < len(lines) else b""
    log.write_bytes(b"".join(lines[:n]) + tail)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    name=st.sampled_from(
        [*(f"sample-{n}" for n in SAMPLE_NAMES), "synthetic-1f1b", "synthetic-zbv", "handwritten"]
    ),
    rank=st.integers(0, 2),
    keep=st.floats(0.0, 1.0),
    torn=st.booleans(),
    peer_keep=st.none() | st.floats(0.0, 1.0),
)
def test_every_ending_is_told_right(sources, tmp_path_factory, name, rank, keep, torn, peer_keep):
    """``peer_keep``: the next rank's log is cut too (the whole job killed)."""
    run = tmp_path_factory.mktemp("cut") / "run"
    shutil.copytree(sources[name], run)
    logs = len(list(run.glob("rank-*.ndjson")))
    cut_log(run, rank % logs, keep, torn)
    if peer_keep is not None:
        cut_log(run, (rank + 1) % logs, peer_keep, False)
    try:
        loaded = load_run(run, workers=0)
    except TraceFormatError as exc:  # every log cut to its header: an input error, said
        assert "no events after its header" in str(exc)
        return
    assert_told_right(analyze(loaded).to_json())


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_every_sample_is_told_right(name):
    assert_told_right(analyze(load_run(SAMPLES / name, workers=0)).to_json())
