"""Real ranks: the recorded memory timeline of GPipe and 1F1B on 4 ranks shows the textbook
difference (stage 0 holds M against P micro-batches of activations), activation swap lowers
the measured peak by the bytes it offloaded, and tied weights keep parity with a
single-process run of the tied model on 2 and 4 ranks. One launch per rank count: starting
ranks costs seconds."""

from __future__ import annotations

import numpy as np
import pytest

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.load import load_run
from pipetrace.runtime.config import RunConfig
from pipetrace.runtime.launch import launch
from pipetrace.testing.cases import parity_case

pytestmark = pytest.mark.multiproc

TIED = [("gpipe", None), ("1f1b", None), ("interleaved-1f1b", 2), ("zbv", 2)]


def tied_cases(ranks: int) -> list[RunConfig]:
    return [parity_case(name, ranks, v, tie_weights=True) for name, v in TIED]


def assert_parity(result, cases, ranks, first=0):
    """Cases ``first``... of the launch passed their parity check on every rank."""
    assert result.ok, [(f.rank, f.error, f.traceback) for f in result.failures]
    for index, case in enumerate(cases, first):
        reports = [result.results[rank][index].parity for rank in range(ranks)]
        assert all(r is not None and r.ok for r in reports), (case.schedule, reports)


def test_recorded_peaks_of_gpipe_and_1f1b_and_tied_parity_on_4_ranks(tmp_path):
    ranks, microbatches = 4, 8
    recorded = [
        RunConfig(
            schedule=name,
            ranks=ranks,
            microbatches=microbatches,
            steps=2,
            out=str(tmp_path / name),
            timeout=60,
        )
        for name in ("gpipe", "1f1b")
    ]
    tied = tied_cases(ranks)
    result = launch(recorded + tied)
    assert_parity(result, tied, ranks, first=len(recorded))
    for name, expected in (("gpipe", microbatches), ("1f1b", ranks)):
        memory = analyze(load_run(tmp_path / name, workers=0)).summary.memory
        assert memory is not None, name
        stage0 = next(s for s in memory.stages if s.stage == 0)
        assert stage0.expected_microbatches == expected, name
        assert stage0.peak_microbatches == pytest.approx(expected, abs=0.01), name
        assert stage0.saved_bytes == expected * stage0.microbatch_bytes, name


def test_swap_lowers_the_peak_and_tied_weights_match_on_2_ranks(tmp_path):
    recorded = [
        RunConfig(
            schedule="gpipe",
            ranks=2,
            microbatches=4,
            steps=1,
            swap=swap,
            out=str(tmp_path / name),
            timeout=60,
        )
        for name, swap in (("plain", None), ("swap", "stage=0"))
    ]
    tied = tied_cases(2)
    assert_parity(launch(recorded + tied), tied, 2, first=len(recorded))
    plain = load_run(tmp_path / "plain", workers=0).ranks[0].memory
    swapped = load_run(tmp_path / "swap", workers=0).ranks[0].memory
    held = int(plain.saved[:, 0].max())  # stage 0 of GPipe: all 4 micro-batches at once
    assert held == 4 * int(plain.saved[0, 0])
    total = swapped.saved[:, 0] + swapped.swapped[:, 0]
    at = int(np.argmax(total))
    assert int(total[at]) == held  # the same activations, some of them on the host
    assert int(swapped.swapped[at, 0]) > 0
    assert int(swapped.saved[:, 0].max()) < held  # the device peak is lower...
    assert int(swapped.saved[at, 0]) == held - int(swapped.swapped[at, 0])  # ...by what left
    assert int(swapped.swapped[-1, 0]) == 0  # every group loaded back by the end
