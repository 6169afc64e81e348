"""Exposed communication is time, like the P2P wait beside it: sends drained together at an
iteration's end (torch.distributed.pipelining waits all of a step's sends at once) overlap,
and their overlap counts once, so a rank's exposed time never exceeds its P2P wait."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from pipetrace.analyze.load import load_run
from pipetrace.analyze.metrics import Metrics, _union_per_bin, compute_metrics
from pipetrace.analyze.model import OP_SEND, OPEN, Run
from tests.analyze.test_damage_inputs import RANK, edit_log

SAMPLE = Path(__file__).resolve().parents[2] / "sample_traces" / "clean-dualpipev"
"""Recorded in overlap mode: each iteration's sends are drained after its last step."""
DRAIN_NS = 5_000_000
"""How long the edited sends take to drain, past the iteration's last step end."""


def union_length(intervals: list[tuple[int, int]]) -> int:
    """The time covered by ``intervals`` (merged one by one, in start order)."""
    total, reach = 0, None
    for lo, hi in sorted(intervals):
        if reach is None or lo > reach:
            total, reach = total + hi - lo, hi
        elif hi > reach:
            total, reach = total + hi - reach, hi
    return total


def drain_intervals(run: Run, it: int) -> list[tuple[int, int]]:
    """RANK's exposed drain intervals in iteration ``it``: each send completed after the
    iteration's last step end, from when both it was drained and its peer had posted."""
    rank = run.ranks[RANK]
    steps, p2p = rank.steps, rank.p2p
    last_end = int(steps.end[(steps.it == it) & (steps.end != OPEN)].max())
    out = []
    for row in np.flatnonzero((p2p.it == it) & (p2p.op == OP_SEND) & (p2p.done > last_end)):
        peer = run.ranks[int(p2p.match_rank[row])].p2p.post[p2p.match_index[row]]
        lo, hi = max(last_end, int(p2p.post[row]), int(peer)), int(p2p.done[row])
        if hi > lo:
            out.append((lo, hi))
    return out


def drain_late(events: list[dict], it: int, dones) -> list[dict]:
    """Rank events with iteration ``it``'s drained sends completing at ``dones(k, end)``
    (k: the k-th drained send, end: the last step end) and what follows them delayed to
    keep the log in time order."""
    sends = {
        e["id"] for e in events if e["e"] == "p2p_post" and e["it"] == it and e["op"] == "send"
    }
    iteration = next(i for i, e in enumerate(events) if e["e"] == "iter_begin" and e["it"] == it)
    stop = next(i for i, e in enumerate(events) if e["e"] == "iter_end" and e["it"] == it)
    end = max(e["t"] for e in events[iteration:stop] if e["e"] == "step_end")
    drained = [
        i
        for i, e in enumerate(events)
        if i > iteration and e["e"] == "p2p_done" and e["id"] in sends and e["t"] > end
    ]
    assert len(drained) >= 4, "the sample's iteration drains its sends"
    out = [dict(e) for e in events]
    for k, i in enumerate(drained):
        out[i]["t"] = dones(k, end)
    shift = max(out[i]["t"] for i in drained) - events[drained[-1]]["t"]
    for e in out[drained[-1] + 1 :]:
        e["t"] += shift
    return out


def edited_run(tmp_path: Path, dones) -> tuple[Run, Metrics]:
    run_dir = tmp_path / "run"
    shutil.copytree(SAMPLE, run_dir)
    edit_log(run_dir, lambda events: drain_late(events, 1, dones))
    run = load_run(run_dir, workers=0)
    return run, compute_metrics(run)


@pytest.fixture(scope="module")
def original() -> tuple[Run, Metrics]:
    run = load_run(SAMPLE, workers=0)
    return run, compute_metrics(run)


def assert_within_wait(metrics: Metrics) -> None:
    for rank, m in metrics.per_rank.items():
        ok = np.isnan(m.exposed) | (m.exposed <= m.p2p_wait)
        assert ok.all(), (rank, m.exposed.tolist(), m.p2p_wait.tolist())
        assert (np.isnan(m.exposed) | (m.exposed <= metrics.iteration_time)).all()


@pytest.mark.parametrize(
    "dones",
    [
        # all at one moment, as torch's runtime waits a step's sends together
        lambda k, end: end + DRAIN_NS,
        # staggered, each overlapping the ones before it
        lambda k, end: end + DRAIN_NS * (k + 1) // 4,
    ],
    ids=["together", "staggered"],
)
def test_drained_sends_count_their_union(tmp_path, original, dones):
    base_run, base = original
    run, metrics = edited_run(tmp_path, dones)
    assert metrics.overlap_mode
    it = metrics.iterations.index(1)
    intervals = drain_intervals(run, 1)
    assert len(intervals) >= 4
    union = union_length(intervals)
    assert sum(hi - lo for lo, hi in intervals) > union + DRAIN_NS  # they overlap
    # the edit moved only the drains: the rest of the exposed time (late recvs) is unchanged
    before = base.per_rank[RANK].exposed[it] - union_length(drain_intervals(base_run, 1))
    assert metrics.per_rank[RANK].exposed[it] == pytest.approx(before + union, abs=1)
    assert_within_wait(metrics)


def test_drains_within_p2p_wait(tmp_path):
    """The drain the P2P wait counts (last step end to last completion) bounds the exposed
    drains: however many sends drain together, exposed time stays within the wait."""
    _, metrics = edited_run(tmp_path, lambda k, end: end + DRAIN_NS)
    it = metrics.iterations.index(1)
    m = metrics.per_rank[RANK]
    assert m.p2p_wait[it] >= DRAIN_NS
    assert m.exposed[it] >= DRAIN_NS * 0.9  # the drain is exposed (the peer posted early)
    assert_within_wait(metrics)


def test_sample_traces_within_p2p_wait():
    """Every recorded sample: per rank and iteration, exposed <= P2P wait."""
    root = SAMPLE.parent
    for run_dir in sorted(p for p in root.iterdir() if (p / "meta.json").exists()):
        assert_within_wait(compute_metrics(load_run(run_dir, workers=0)))


def test_union_per_bin_is_time_covered():
    """Bins apart in time get their own union; bins overlapping in time split the union
    between them, each within its own."""
    rng = np.random.default_rng(7)
    n, k, apart = 6, 400, 100_000
    index = rng.integers(0, n - 1, k)  # the last bin stays empty
    lo = index * apart + rng.integers(0, 10_000, k)
    hi = lo + rng.integers(1, 800, k)
    hi[::7] = index[::7] * apart + 11_000  # some end at one moment (a step's drained sends)

    def own(lo, hi):
        return [
            union_length(list(zip(lo[index == b].tolist(), hi[index == b].tolist())))
            for b in range(n)
        ]

    assert _union_per_bin(index, lo, hi, n).tolist() == own(lo, hi)
    lo, hi = lo - index * apart, hi - index * apart  # every bin on one span
    mixed = _union_per_bin(index, lo, hi, n)
    assert mixed.sum() == union_length(list(zip(lo.tolist(), hi.tolist())))
    assert (mixed <= np.array(own(lo, hi))).all()
    assert mixed[n - 1] == 0
    assert _union_per_bin(index[:0], lo[:0], hi[:0], n).tolist() == [0] * n
