"""The Perfetto export of a run with device timing: a device track per rank beside the host
tracks, device-bound steps apart (recorded through fake devices on CPU)."""

from __future__ import annotations

import io

import pytest

from pipetrace.analyze.load import load_run
from pipetrace.export.layout import build_layout
from pipetrace.export.perfetto import write_perfetto
from pipetrace.testing.device_replay import quick, record_device_run, slow_forward_on_rank_1
from pipetrace.testing.fake_device import NEVER

from .decode import decode_perfetto

MS = 1_000_000


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("device-export")
    record_device_run(run_dir, slow_forward_on_rank_1)
    run = load_run(run_dir, workers=0)
    out = io.BytesIO()
    write_perfetto(build_layout(run), out)
    return run, decode_perfetto(out.getvalue())


def test_each_rank_has_device_tracks_beside_its_host_tracks(exported):
    run, dec = exported
    for rank in run.ranks:
        device = dec.on(rank.rank, "device (launch-bound)") + dec.on(
            rank.rank, "device (device-bound)"
        )
        ended = int((rank.steps.end != -1).sum())
        assert len(device) == ended  # every step the device ran, once
        assert len(dec.on(rank.rank, "compute")) >= ended  # the host track stays
        assert dec.on(rank.rank, "device p2p 0")


def test_device_slices_are_at_device_times(exported):
    _, dec = exported
    forwards = [s for s in dec.on(1, "device (device-bound)") if s.name.startswith("1F")]
    assert forwards and all(s.end - s.begin >= 3 * MS - 1_000 for s in forwards)
    host = [s for s in dec.on(1, "compute") if s.name.startswith("1F")]
    assert all(s.end - s.begin < 2 * MS for s in host)
    assert dec.on(0, "device (device-bound)") == []


def test_work_the_device_never_completed_is_drawn_unfinished(tmp_path):
    """Rank 1's device never finishes 1B1 of iteration 1 (everything after it waits behind
    it): the step is drawn from its enqueue to the end of the trace on a track of its own,
    which is what a device hang looks like; no other rank has that track."""

    def hangs_in_1b1(rank: int, iteration: int, text: str) -> float:
        return NEVER if (rank, iteration, text) == (1, 1, "1B1") else quick(rank, iteration, text)

    record_device_run(tmp_path, hangs_in_1b1)
    run = load_run(tmp_path, workers=0)
    out = io.BytesIO()
    write_perfetto(build_layout(run), out)
    dec = decode_perfetto(out.getvalue())
    (never,) = dec.on(1, "device (never completed)")
    assert never.name == "1B1" and never.args.get("unfinished") is True
    (host,) = [s for s in dec.on(1, "compute") if s.name == "1B1" and s.args["iteration"] == 1]
    assert never.begin == host.begin and never.end >= max(s.end for s in dec.on(1, "compute"))
    assert dec.on(0, "device (never completed)") == []
