"""SVG snapshots of the TUI at fixed terminal sizes (pytest-textual-snapshot).

Only deterministic runs are snapshotted: the synthetic run (fixed clock and costs) and the
recorded runs committed under sample_traces/. Update with ``pytest tests/tui --snapshot-update``
and look at the SVGs under tests/tui/__snapshots__ before committing them.
"""

from __future__ import annotations

import pytest

from pipetrace.tui.app import PipetraceApp

from .conftest import SAMPLES, wait_loaded


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_clean_run_on_open(snap_compare, synthetic_run, size):
    assert snap_compare(PipetraceApp(synthetic_run), terminal_size=size, run_before=wait_loaded)


def test_plan_vs_actual_zoomed_on_a_step(snap_compare, synthetic_run):
    keys = ["p", "right_square_bracket", "down", "down", "down", "right", "right"]
    assert snap_compare(
        PipetraceApp(synthetic_run), press=keys, terminal_size=(120, 40), run_before=wait_loaded
    )


def test_stats_panel(snap_compare, synthetic_run):
    assert snap_compare(
        PipetraceApp(synthetic_run), press=["s"], terminal_size=(80, 24), run_before=wait_loaded
    )


def test_help_screen(snap_compare, synthetic_run):
    assert snap_compare(
        PipetraceApp(synthetic_run),
        press=["question_mark"],
        terminal_size=(80, 24),
        run_before=wait_loaded,
    )


def _samples() -> list[str]:
    if not SAMPLES.is_dir():
        return []
    return sorted(p.name for p in SAMPLES.iterdir() if (p / "meta.json").exists())


# every sample at 80x24; these also at 120x40 (the others look alike there, and each
# snapshot costs about a second)
WIDE = ("clean-1f1b", "clean-dualpipev", "fault-crash", "fault-deadlock", "fault-hang")
_CASES = [pytest.param(name, (80, 24), id=f"{name}-80x24") for name in _samples()]
_CASES += [
    pytest.param(name, (120, 40), id=f"{name}-120x40") for name in _samples() if name in WIDE
]


@pytest.mark.skipif(not _CASES, reason="no sample_traces/")
@pytest.mark.parametrize("name, size", _CASES or [pytest.param("none", (80, 24), id="none")])
def test_sample_trace_on_open(snap_compare, name, size):
    """Each recorded sample as it opens: clean runs on their steady iterations, faulty ones on
    their most severe finding with its steps highlighted."""
    assert snap_compare(PipetraceApp(SAMPLES / name), terminal_size=size, run_before=wait_loaded)
