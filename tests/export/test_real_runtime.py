"""The export of a run of the real torch runtime (gloo on local rank processes)."""

from __future__ import annotations

import pytest

from .checks import check_chrome_json, check_perfetto
from .conftest import export
from .torch_runs import record_torch_run

pytestmark = pytest.mark.multiproc


def test_real_overlapped_run_exports(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "run"
    result = record_torch_run(
        path, schedule="dualpipev", ranks=2, microbatches=4, steps=1, overlap_p2p=True
    )
    assert not result.failures
    e = export(path)
    check_perfetto(e.run, e.trace)
    check_chrome_json(e.run, e.json)
    names = {e.trace.track_name(u) for u in e.trace.tracks}
    assert {"compute", "overlap (backward)", "bubbles"} <= names
    assert e.trace.flows and e.trace.counters
