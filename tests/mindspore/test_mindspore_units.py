"""The MindSpore backend's pieces in one process (no cluster): stages and the shared executor
on a one-rank plan, the I/W split against the full backward, and the checks that run before
anything starts (MindSpore missing, unsupported flags, no MindSpore import for other verbs)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import pipetrace.runtime.mindspore.cluster
from pipetrace.cli import main
from pipetrace.runtime.config import DemoConfig, RunConfig
from pipetrace.runtime.mindspore import support
from pipetrace.schedule.ir import Plan
from tests.plans import MIXED_ROWS

DEMO = DemoConfig(width=16, microbatch_size=4)


@pytest.fixture(scope="module")
def ms():
    mindspore = pytest.importorskip("mindspore")
    from pipetrace.runtime.mindspore.backend import setup_mindspore

    setup_mindspore()
    return mindspore


def make_stages(num_stages: int):
    from pipetrace.runtime.mindspore.backend import split_sequential
    from pipetrace.runtime.mindspore.demo import build_demo_model, demo_loss
    from pipetrace.runtime.mindspore.stage import MindSporeStage

    chunks = split_sequential(build_demo_model(num_stages, DEMO, seed=0), num_stages)
    return {
        s: MindSporeStage(
            chunk,
            stage_index=s,
            num_stages=num_stages,
            loss_fn=demo_loss if s == num_stages - 1 else None,
        )
        for s, chunk in enumerate(chunks)
    }


def test_one_rank_plan_with_composite_matches_single_process(ms):
    """Local hand-offs, B, I/W, OVERLAP_F_B on two threads (with MindSpore's grad switch set
    on the overlap thread) and no-op FSDP steps give the single-process loss and gradients."""
    from mindspore import ops

    from pipetrace.runtime import parity
    from pipetrace.runtime.executor import Executor
    from pipetrace.runtime.mindspore.backend import MindSporeBackend
    from pipetrace.runtime.mindspore.demo import build_demo_model, demo_batch, demo_loss

    backend = MindSporeBackend()
    stages = make_stages(3)
    executor = Executor(
        plan=Plan(2, (0, 0, 0), MIXED_ROWS), rank=0, stages=stages, p2p=None, ops=backend
    )
    inputs, targets = demo_batch(0, 2 * DEMO.microbatch_size, DEMO, seed=0)
    loss = executor.run_iteration(
        ops.split(inputs, DEMO.microbatch_size), ops.split(targets, DEMO.microbatch_size)
    )
    executor.close()
    ref_loss, ref_grads = backend.reference_gradients(
        build_demo_model(3, DEMO, seed=0), inputs, targets, demo_loss
    )
    report = parity.compare(
        rank=0,
        gradients=backend.stage_gradients(stages),
        loss=loss,
        reference_loss=ref_loss,
        reference_grads=ref_grads,
        tolerance=1e-12,
    )
    assert report.ok, report.mismatches
    assert report.compared == 1 + 2 * 2 * 3  # loss + (weight, bias) x 2 blocks x 3 stages
    assert sorted(ref_grads) == sorted(p.name for st in stages.values() for p in st.params)


@pytest.mark.parametrize("stage_index", [0, 1, 2])
def test_split_backward_equals_full_backward_bit_for_bit(ms, stage_index):
    from mindspore import Tensor

    full, split = make_stages(3)[stage_index], make_stages(3)[stage_index]
    rng = np.random.default_rng(1)
    x = Tensor(rng.standard_normal((DEMO.microbatch_size, DEMO.width)))
    target = Tensor(rng.standard_normal((DEMO.microbatch_size, DEMO.width)))
    grad = (
        None
        if stage_index == 2
        else Tensor(rng.standard_normal((DEMO.microbatch_size, DEMO.width)))
    )
    for stage in (full, split):
        stage.forward(0, x, target if stage.is_last else None, 0.5)
    dx_full = full.backward(0, grad)
    dx_split = split.backward_input(0, grad)
    assert split.pending() == 1
    split.backward_weight(0)
    assert full.pending() == split.pending() == 0
    if stage_index == 0:
        assert dx_full is None and dx_split is None
    else:
        assert np.array_equal(dx_full.asnumpy(), dx_split.asnumpy())
    for a, b in zip(full.grads, split.grads, strict=True):
        assert np.array_equal(a.asnumpy(), b.asnumpy())


def test_missing_mindspore_says_how_to_install_before_starting_anything(capsys, monkeypatch):
    monkeypatch.setattr(support, "_mindspore_installed", lambda: False)

    def refuse(*args, **kwargs):
        raise AssertionError("processes were started")

    monkeypatch.setattr(pipetrace.runtime.mindspore.cluster, "launch", refuse)
    code = main(["run", "-s", "1f1b", "--backend", "mindspore"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err == (
        "pipetrace: error: the MindSpore backend needs MindSpore, which is not installed: "
        "pip install 'pipetrace[mindspore]'\n"
    )


def test_numpy_2_with_mindspore_2_10_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(support, "_mindspore_installed", lambda: True)
    versions = {"mindspore": (2, 10, 0), "numpy": (2, 4, 6)}
    monkeypatch.setattr(support, "_version", versions.get)
    assert support.installed_problem() == (
        "MindSpore 2.10.0 needs numpy<2, but numpy 2.4.6 is installed: "
        "pip install 'pipetrace[mindspore]' (it pins numpy<2)"
    )
    versions["numpy"] = (1, 26, 4)
    assert support.installed_problem() is None


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(data_parallel=2, fsdp=True), "does not support --data-parallel/--fsdp"),
        (dict(data_parallel=2), "does not support --data-parallel/--fsdp"),  # not "needs --fsdp"
        (dict(torch_profiler=True, out="x"), "does not support --torch-profiler"),
    ],
)
def test_torch_only_flags_are_refused(monkeypatch, fields, message):
    monkeypatch.setattr(support, "installed_problem", lambda: None)
    config = RunConfig(schedule="1f1b", backend="mindspore", **fields)
    with pytest.raises(Exception, match=message):
        config.check_backend()


def test_other_verbs_never_import_mindspore():
    code = (
        "import sys; from pipetrace.cli import main; "
        "codes = [main(['run', '--help']), "
        "main(['schedule', 'show', '1f1b', '-p', '2', '-m', '4'])]; "
        "assert 'mindspore' not in sys.modules, 'mindspore imported'; sys.exit(max(codes))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--backend [torch|mindspore]" in done.stdout


@pytest.mark.parametrize("name", ["float64", "bfloat16", "bool", "int8"])
def test_stream_header_round_trips_with_the_torch_codes(ms, name):
    """A MindSpore stream header says what the torch one would for the same dtype name."""
    import torch

    from pipetrace.runtime.mindspore.p2p import TensorMeta
    from pipetrace.runtime.p2p import TensorMeta as TorchMeta

    meta = TensorMeta((4, 7), TensorMeta.dtype_named(name))
    assert meta.dtype_name == name
    assert TensorMeta.from_header(meta.header()) == meta
    assert meta.header() == TorchMeta((4, 7), getattr(torch, name)).header()
