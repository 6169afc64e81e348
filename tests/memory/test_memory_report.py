"""The memory timeline without real ranks: what a torch stage counts as saved for backward,
the samples the fake cluster records as the runtime does, and the peaks `pipetrace analyze`
reports from them against the plan's in-flight count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.load import load_run
from pipetrace.cli import cli
from pipetrace.runtime.config import DemoConfig
from pipetrace.runtime.demo import build_demo_model, demo_loss
from pipetrace.runtime.executor import Executor
from pipetrace.runtime.stage import PipelineStage
from pipetrace.runtime.torch_backend import split_sequential
from pipetrace.schedule.builders import build_plan
from pipetrace.schedule.simulate import peak_inflight_by_stage
from pipetrace.testing.cluster import FakeCluster

ACTIVATION = 1 << 20
RANKS, MICROBATCHES = 4, 8


def recorded(path, schedule: str, **options):
    FakeCluster.of(
        schedule,
        ranks=RANKS,
        microbatches=MICROBATCHES,
        iterations=2,
        activation_bytes=ACTIVATION,
        **options,
    ).record(path)
    return analyze(load_run(path, workers=0))


def stage_row(analysis, stage: int):
    return next(s for s in analysis.summary.memory.stages if s.stage == stage)


def test_a_torch_stage_counts_each_saved_activation_once_until_its_backward():
    demo = DemoConfig(width=16, microbatch_size=4)
    first = split_sequential(build_demo_model(2, demo, seed=0), 2)[0]
    stage = PipelineStage(first, stage_index=0, num_stages=2)
    stage.count_saved = True
    batch = torch.randn(2 * demo.microbatch_size, demo.width, dtype=torch.float64)
    micro = batch[: demo.microbatch_size]  # a view: counted by its own size, not the batch's
    out = stage.forward(0, micro)
    one = demo.microbatch_size * demo.width * 8
    # input of block 0, tanh output of block 0 (also block 1's input), tanh output of block 1
    assert stage.saved_bytes() == 3 * one
    stage.forward(1, batch[demo.microbatch_size :])
    assert stage.saved_bytes() == 6 * one
    stage.backward(0, torch.ones_like(out))
    assert stage.saved_bytes() == 3 * one


def test_a_stage_fed_over_p2p_measures_what_it_saves_once(monkeypatch):
    """A stage whose input arrives over P2P (a stream's shape is exchanged once) measures
    its saved bytes at its first forward and takes them as they are after, without a
    lookup by shape; the executor says which stages are fed so."""
    demo = DemoConfig(width=16, microbatch_size=4)
    plan = build_plan("zbv", num_ranks=2, num_microbatches=2, comms=True)
    assert plan.placement == (0, 1, 1, 0)
    chunks = split_sequential(build_demo_model(4, demo, seed=0), 4)
    fixed = {}
    for rank in range(2):
        stages = {
            s: PipelineStage(chunks[s], stage_index=s, num_stages=4, loss_fn=demo_loss)
            for s in plan.stages_of(rank)
        }
        Executor(plan=plan, rank=rank, stages=stages, p2p=SimpleNamespace())
        fixed |= {s: stage.input_fixed for s, stage in stages.items()}
    assert fixed == {0: False, 1: True, 2: False, 3: True}  # 2 is fed by 1 on its own rank

    stage = PipelineStage(chunks[1], stage_index=1, num_stages=4)
    stage.count_saved = stage.input_fixed = True
    x = torch.randn(demo.microbatch_size, demo.width, dtype=torch.float64)
    stage.forward(0, x)
    measured = stage.held_bytes[0]
    assert measured > 0
    monkeypatch.setattr(stage, "_saved_in_graph", lambda output: pytest.fail("measured again"))
    stage._saved_per_input.clear()  # nor looked up by the input's shape
    stage.forward(1, x.clone())
    assert stage.held_bytes[1] == measured


def test_gpipe_holds_every_microbatch_and_1f1b_as_many_as_ranks(tmp_path):
    gpipe = recorded(tmp_path / "gpipe", "gpipe")
    one_f_one_b = recorded(tmp_path / "1f1b", "1f1b")
    assert stage_row(gpipe, 0).peak_microbatches == MICROBATCHES
    assert stage_row(gpipe, 0).expected_microbatches == MICROBATCHES
    for stage in range(RANKS):
        row = stage_row(one_f_one_b, stage)
        assert row.saved_bytes == (RANKS - stage) * ACTIVATION
        assert row.peak_microbatches == row.expected_microbatches == RANKS - stage
        assert row.microbatch_bytes == ACTIVATION
        assert row.swap_would_save_bytes == (RANKS - stage - 1) * ACTIVATION
    peak = stage_row(one_f_one_b, 0).peak_step
    assert peak is not None and peak.rank == 0 and peak.iteration == 0


def test_in_flight_bytes_count_received_messages_until_consumed(tmp_path):
    analysis = recorded(tmp_path / "run", "1f1b")
    rank1 = analysis.run.ranks[1].memory
    assert rank1.inflight.max() > 0 and rank1.inflight[-1].tolist() == [0]
    assert rank1.saved[-1].tolist() == [0]  # every backward done: nothing held


def test_the_plan_count_follows_each_stage_of_a_v_placement():
    plan = build_plan("zbv", num_ranks=2, num_microbatches=4, comms=True)
    peaks = peak_inflight_by_stage(plan)
    assert sorted(peaks) == [0, 1, 2, 3]
    assert peaks[0] == 4 and peaks[3] < peaks[0]


def test_report_and_json_show_memory_only_when_sampled(tmp_path):
    recorded(tmp_path / "with", "1f1b")
    FakeCluster.of("1f1b", ranks=2, microbatches=2, iterations=1).record(tmp_path / "without")
    runner = CliRunner()
    text = runner.invoke(cli, ["analyze", str(tmp_path / "with")]).output
    assert "peak activation memory per stage" in text
    assert "3.00 MiB" in text  # stage 0's swap saving: 3 of its 4 micro-batches
    with_json = runner.invoke(cli, ["analyze", "--json", str(tmp_path / "with")]).output
    assert '"swap_would_save_bytes": 3145728' in with_json
    plain = runner.invoke(cli, ["analyze", str(tmp_path / "without")]).output
    assert "peak activation memory" not in plain
    without = runner.invoke(cli, ["analyze", "--json", str(tmp_path / "without")]).output
    assert '"memory": null' in without


def test_a_sample_with_the_wrong_number_of_stages_is_dropped_and_counted(tmp_path):
    run = tmp_path / "run"
    FakeCluster.of("1f1b", ranks=2, microbatches=2, iterations=1, activation_bytes=64).record(run)
    log = run / "rank-00001.ndjson"
    lines = log.read_text().splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if '"e":"memory"' in line)
    lines[index] = lines[index].replace('"saved":[', '"saved":[1,')
    log.write_text("".join(lines))
    loaded = load_run(run, workers=0)
    assert len(loaded.ranks[1].memory) == sum('"e":"memory"' in line for line in lines) - 1
    assert any(
        p.rank == 1 and "1 event(s) with a value outside its documented set" in p.message
        for p in loaded.problems
    )


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_each_stage_of_a_multi_stage_rank_has_its_own_peak(tmp_path, schedule):
    analysis = recorded(tmp_path / "run", schedule, stages_per_rank=2)
    rows = analysis.summary.memory.stages
    assert len(rows) == 2 * RANKS
    assert all(r.peak_microbatches == r.expected_microbatches for r in rows)


def test_the_memory_json_is_the_documented_one(tmp_path):
    from tests.analyze.test_json_doc import mismatches, skeleton

    document = recorded(tmp_path / "run", "1f1b").to_json()
    assert document["metrics"]["memory"]["stages"]
    assert mismatches(skeleton(), document) == []


def test_cuda_allocator_bytes_are_recorded_and_reported(tmp_path):
    from pipetrace.recorder.recorder import Recorder
    from pipetrace.recorder.setup import RecordSettings

    plan = build_plan("gpipe", num_ranks=1, num_microbatches=2, comms=True)
    recorder = Recorder(RecordSettings(tmp_path, stall_timeout=0))
    recorder.begin_run(rank=0, world_size=1, plan=plan, config={})
    recorder.begin_iteration(0)
    for position, step in enumerate(plan.steps(0)):
        token = recorder.begin_step(position, step)
        recorder.end_step(token)
        held = 4096 * (position + 1)
        recorder.memory_sample(token, [held], [0], (held + 100, 1 << 20))
        recorder.memory_sample(token, [held], [0], (held + 100, 1 << 20))  # unchanged: dropped
    recorder.end_iteration(0, 0.5)
    recorder.end_run()
    run = load_run(tmp_path, workers=0)
    memory = run.ranks[0].memory
    assert len(memory) == len(plan.steps(0))
    assert memory.reserved.tolist() == [1 << 20] * len(memory)
    report = analyze(run).summary.memory
    assert report.ranks[0].peak_allocated_bytes == 4096 * len(memory) + 100
    assert report.ranks[0].peak_reserved_bytes == 1 << 20


def test_memory_samples_read_back_the_same_from_the_cache(tmp_path, monkeypatch):
    """The columnar cache keeps the memory columns (a cached reopen reports the same peaks)."""
    from pipetrace.testing.aging import age_logs
    from tests.cache.test_cache import _from_cache_only

    run = tmp_path / "run"
    FakeCluster.of("zbv", ranks=2, microbatches=4, activation_bytes=ACTIVATION).record(run)
    age_logs(run)
    parsed = analyze(load_run(run, workers=0)).to_json()["metrics"]["memory"]
    _from_cache_only(monkeypatch)
    cached = load_run(run, workers=0)
    assert cached.ranks[0].memory.saved.shape[1] == 2  # both stages of a V placement
    assert analyze(cached).to_json()["metrics"]["memory"] == parsed
