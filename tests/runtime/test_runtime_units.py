"""The runtime's pieces in one process: stages, the executor on one-rank plans (local
hand-offs only, no process group), the custom function registry, FSDP steps on unsharded
stages, the recorder calls, parity comparison and run configuration checks."""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest
import torch
from runtime_helpers import ListRecorder

from pipetrace.errors import PipetraceError
from pipetrace.runtime import parity
from pipetrace.runtime.backend import backend_module
from pipetrace.runtime.config import DemoConfig, RunConfig
from pipetrace.runtime.demo import build_demo_model, demo_batch, demo_loss
from pipetrace.runtime.executor import Executor, StepContext
from pipetrace.runtime.p2p import TensorMeta
from pipetrace.runtime.split import stages_of_rank
from pipetrace.runtime.stage import PipelineStage
from pipetrace.runtime.torch_backend import TorchBackend, split_sequential
from pipetrace.schedule.ir import B, F, I, Plan, Step, StepKind, format_step
from tests.plans import MIXED_ROWS

DEMO = DemoConfig(width=16, microbatch_size=4)
TORCH = TorchBackend()


def make_stages(
    num_stages: int, seed: int = 0
) -> tuple[torch.nn.Sequential, dict[int, PipelineStage]]:
    model = build_demo_model(num_stages, DEMO, seed=seed)
    reference = copy.deepcopy(model)
    chunks = split_sequential(model, num_stages)
    stages = {
        s: PipelineStage(
            chunk,
            stage_index=s,
            num_stages=num_stages,
            loss_fn=demo_loss if s == num_stages - 1 else None,
        )
        for s, chunk in enumerate(chunks)
    }
    return reference, stages


def reference_step(
    model: torch.nn.Module, num_microbatches: int
) -> tuple[float, dict[str, np.ndarray]]:
    inputs, targets = demo_batch(0, num_microbatches * DEMO.microbatch_size, DEMO, seed=0)
    return TORCH.reference_gradients(model, inputs, targets, demo_loss)


def run_plan(
    rows: list[list[Step | None]], num_stages: int, num_microbatches: int, **kwargs
) -> tuple[Executor, float | None]:
    _, stages = make_stages(num_stages)
    plan = Plan(num_microbatches, (0,) * num_stages, rows)
    executor = Executor(plan=plan, rank=0, stages=stages, p2p=None, **kwargs)
    inputs, targets = demo_batch(0, num_microbatches * DEMO.microbatch_size, DEMO, seed=0)
    loss = executor.run_iteration(
        inputs.split(DEMO.microbatch_size), targets.split(DEMO.microbatch_size)
    )
    executor.close()
    return executor, loss


def assert_matches_reference(
    executor: Executor, loss: float | None, num_stages: int, num_microbatches: int
) -> None:
    reference, _ = make_stages(num_stages)
    ref_loss, ref_grads = reference_step(reference, num_microbatches)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    report = parity.compare(
        rank=0,
        gradients=TORCH.stage_gradients(executor.stages),
        loss=loss,
        reference_loss=ref_loss,
        reference_grads=ref_grads,
        tolerance=1e-12,
    )
    assert report.ok, report.mismatches
    assert report.compared == 1 + 2 * 2 * num_stages  # loss + (weight, bias) x 2 blocks per stage


def test_split_sequential_keeps_names_and_balances():
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(7)])
    chunks = split_sequential(model, 3)
    assert [len(c) for c in chunks] == [3, 2, 2]
    assert [name for name, _ in chunks[1].named_parameters()] == [
        "3.weight",
        "3.bias",
        "4.weight",
        "4.bias",
    ]
    plan = Plan(1, (0, 1, 0), [[F(0, 0)], [F(1, 0)]])
    assert list(stages_of_rank(chunks, plan, 0)) == [0, 2]
    with pytest.raises(ValueError, match="at least one module per stage"):
        split_sequential(model, 8)


@pytest.mark.parametrize("stage_index", [0, 1, 2], ids=["first", "middle", "last"])
def test_split_backward_equals_full_backward(stage_index):
    """I then W gives the same input and weight gradients as one full backward."""
    torch.manual_seed(stage_index)
    module = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8)
    ).double()
    twin = copy.deepcopy(module)
    x, target, grad = (torch.randn(4, 8, dtype=torch.float64) for _ in range(3))
    loss_fn = demo_loss if stage_index == 2 else None
    split = PipelineStage(module, stage_index=stage_index, num_stages=3, loss_fn=loss_fn)
    full = PipelineStage(twin, stage_index=stage_index, num_stages=3, loss_fn=loss_fn)
    for mb in range(2):  # two micro-batches in flight, so state is kept per micro-batch
        split.forward(mb, x + mb, target, 0.5)
        full.forward(mb, x + mb, target, 0.5)
    dx_split = [split.backward_input(mb, grad * (mb + 1)) for mb in range(2)]
    for mb in range(2):
        split.backward_weight(mb)
    dx_full = [full.backward(mb, grad * (mb + 1)) for mb in range(2)]
    for mine, theirs in zip(module.parameters(), twin.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-14)
    for a, b in zip(dx_split, dx_full):
        if stage_index == 0:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    assert split.pending() == full.pending() == 0


class _Tied(torch.nn.Module):
    """A weight used twice on the input's path, plus a parameter off that path."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6, dtype=torch.float64)
        self.offset = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(self.linear(x))) + 2 * self.offset


class _Constant(torch.nn.Module):
    """An output that does not depend on the input at all."""

    def __init__(self) -> None:
        super().__init__()
        self.value = torch.nn.Parameter(torch.randn(3, 6, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.value * 3


@pytest.mark.parametrize("module_class", [_Tied, _Constant])
def test_split_backward_handles_reuse_and_unused_input(module_class):
    torch.manual_seed(1)
    module = module_class()
    twin = copy.deepcopy(module)
    x, grad = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    stage = PipelineStage(module, stage_index=1, num_stages=3)
    stage.forward(0, x)
    dx = stage.backward_input(0, grad)
    stage.backward_weight(0)
    x_ref = x.clone().requires_grad_(True)
    twin(x_ref).backward(grad)
    for mine, theirs in zip(module.parameters(), twin.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-14)
    expected_dx = x_ref.grad if x_ref.grad is not None else torch.zeros_like(x)
    torch.testing.assert_close(dx, expected_dx, rtol=0, atol=1e-14)


def _two_stages(case: str) -> tuple[torch.nn.Sequential, torch.Tensor]:
    """A two-stage model the stage boundary used to break, and its input."""
    torch.manual_seed(2)
    linear = [torch.nn.Linear(6, 6, dtype=torch.float64) for _ in range(3)]
    ids = torch.randint(0, 10, (4, 3))
    embed = torch.nn.Embedding(10, 6, dtype=torch.float64)
    if case == "in-place first layer":  # torchvision style: stage 1 starts with ReLU(True)
        chunks = [linear[0], torch.nn.Sequential(torch.nn.ReLU(inplace=True), linear[1])]
        return torch.nn.Sequential(*chunks), torch.randn(4, 6, dtype=torch.float64)
    if case == "frozen first stage":  # its output needs no gradient
        embed.weight.requires_grad_(False)
        return torch.nn.Sequential(embed, torch.nn.Sequential(linear[0], torch.nn.Tanh())), ids
    # integer messages: stage 0 has no parameters and sends token ids on
    return torch.nn.Sequential(_Crop(), torch.nn.Sequential(embed, linear[0])), ids


class _Crop(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 1:]


@pytest.mark.parametrize("split", [False, True], ids=["full", "I+W"])
@pytest.mark.parametrize("case", ["in-place first layer", "frozen first stage", "integer messages"])
def test_stage_boundaries_that_break_a_naive_split_match_one_process(case, split):
    model, x = _two_stages(case)
    twin = copy.deepcopy(model)
    first = PipelineStage(model[0], stage_index=0, num_stages=2)
    last = PipelineStage(model[1], stage_index=1, num_stages=2, loss_fn=_sum_loss)
    out = first.forward(0, x)
    last.forward(0, out, None)
    if split:
        dx = last.backward_input(0, None)
        last.backward_weight(0)
        first.backward_input(0, dx)
        first.backward_weight(0)
    else:
        first.backward(0, last.backward(0, None))
    _sum_loss(twin(x), None).backward()
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        if theirs.grad is None:
            assert mine.grad is None
        else:
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-14)
    assert first.pending() == last.pending() == 0


def _sum_loss(output: torch.Tensor, target: object) -> torch.Tensor:
    return output.sum()


def test_one_rank_plan_with_composite_and_fsdp_steps_matches_reference():
    """Local hand-offs, I/W, OVERLAP_F_B on two threads and FSDP steps (no-ops: nothing
    is sharded) give the single-process gradients."""
    executor, loss = run_plan(MIXED_ROWS, num_stages=3, num_microbatches=2)
    assert_matches_reference(executor, loss, 3, 2)


def test_recorder_sees_every_step_with_positions_and_threads():
    recorder = ListRecorder()
    rows: list[list[Step | None]] = [[MIXED_ROWS[0][0], None, *MIXED_ROWS[0][1:]]]  # with a bubble
    run_plan(rows, num_stages=3, num_microbatches=2, recorder=recorder)
    events = recorder.events
    assert events[0] == {"event": "begin_iteration", "iteration": 0, "token": 1}
    assert events[-1]["event"] == "end_iteration" and events[-1]["loss"] is not None
    begins = [e for e in events if e["event"] == "begin_step"]
    top = [
        e for e in begins if e["step"] != format_step(F(2, 1)) and e["step"] != format_step(I(2, 0))
    ]
    steps = [s for s in rows[0] if s is not None]
    assert [e["position"] for e in top] == list(range(len(steps)))  # bubbles are not counted
    assert [e["step"] for e in top] == [format_step(s) for s in steps]
    composite = next(e for e in begins if e["step"].endswith("OVERLAP_F_B"))
    subs = {e["step"]: e for e in begins if e["step"] in ("2F1", "2I0")}
    assert subs["2F1"]["thread"] == "main" and subs["2I0"]["thread"] == "overlap"
    assert subs["2F1"]["position"] == subs["2I0"]["position"] == composite["position"]
    ended = {e["begin"] for e in events if e["event"] == "end_step"}
    assert ended == {e["token"] for e in begins}


def test_custom_function_registry_replaces_and_wraps_handlers():
    _, stages = make_stages(3)
    plan = Plan(2, (0, 0, 0), MIXED_ROWS)
    executor = Executor(plan=plan, rank=0, stages=stages, p2p=None)
    seen: list[tuple[str, int, int, int]] = []

    def wrap_w(step: Step, context: StepContext) -> None:
        assert context.plan is plan and context.rank == 0 and len(context.inputs) == 2
        seen.append((format_step(step), context.position, context.iteration, len(context.losses)))
        context.default(step)

    def count_forward(step: Step, context: StepContext) -> None:
        seen.append((format_step(step), context.position, context.iteration, -1))
        context.default(step)

    executor.register_custom_function(StepKind.W, wrap_w)
    executor.register_custom_function("F", count_forward)  # also reaches the composite's F
    executor.register_custom_function(
        StepKind.REDUCE_GRAD, lambda step, context: seen.append(("reduce", context.position, 0, 0))
    )
    inputs, targets = demo_batch(0, 2 * DEMO.microbatch_size, DEMO, seed=0)
    loss = executor.run_iteration(
        inputs.split(DEMO.microbatch_size), targets.split(DEMO.microbatch_size)
    )
    executor.close()
    assert ("2W0", 7, 0, 2) in seen  # both last-stage losses exist by then
    assert [s for s in seen if s[0] == "2F1"] == [("2F1", 6, 0, -1)]  # inside the composite
    assert sum(1 for s in seen if s[0].endswith(("F0", "F1"))) == 6
    assert ("reduce", 15, 0, 0) in seen
    assert_matches_reference(executor, loss, 3, 2)


def test_a_plan_that_leaves_work_undone_is_an_error_and_stops_the_executor():
    rows: list[list[Step | None]] = [[F(0, 0), F(1, 0), B(1, 0)]]  # stage 0 never runs backward
    _, stages = make_stages(2)
    executor = Executor(plan=Plan(1, (0, 0), rows), rank=0, stages=stages, p2p=None)
    inputs, targets = demo_batch(0, DEMO.microbatch_size, DEMO, seed=0)
    with pytest.raises(
        RuntimeError, match=r"stage 0 has 1 micro-batch\(es\) without a finished backward"
    ):
        executor.run_iteration([inputs], [targets])
    with pytest.raises(
        RuntimeError, match=r"iteration 0 failed \(RuntimeError\); build a new runner"
    ):
        executor.run_iteration([inputs], [targets])


def test_parity_compare_names_the_parameter_and_error():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3, dtype=torch.float64))
    inputs, targets = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    ref_loss, ref_grads = TORCH.reference_gradients(
        copy.deepcopy(model), inputs, targets, demo_loss
    )
    loss = demo_loss(model(inputs), targets)
    loss.backward()
    model[0].bias.grad[1] += 1e-3 * model[0].bias.grad.abs().max()
    report = parity.compare(
        rank=3,
        gradients=TORCH.stage_gradients({1: PipelineStage(model, stage_index=1, num_stages=3)}),
        loss=loss.item(),
        reference_loss=ref_loss,
        reference_grads=ref_grads,
    )
    assert report.compared == 3
    assert [m.what for m in report.mismatches] == ["gradient of 0.bias (stage 1)"]
    assert report.mismatches[0].relative_error == pytest.approx(1e-3, rel=1e-6)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"ranks": 0}, "^ranks must be >= 1, got 0$"),
        ({"timeout": 0}, "^timeout must be > 0 seconds"),
        ({"data_parallel": 2}, "^data_parallel > 1 needs fsdp"),
        ({"backend": "jax"}, "^backend must be one of torch, mindspore"),
    ],
)
def test_run_config_rejects_bad_values(fields, message):
    with pytest.raises(PipetraceError, match=message):
        RunConfig(schedule="1f1b", **fields)


def test_run_config_plan_errors_are_usage_errors():
    with pytest.raises(PipetraceError, match="at least as many micro-batches") as info:
        RunConfig(schedule="dualpipev", ranks=4, microbatches=4).plan()
    assert info.value.exit_code == 2
    plan = RunConfig(schedule="ScheduleZBVZeroBubble", ranks=2, microbatches=4).plan()
    assert plan.name == "zbv" and plan.placement == (0, 1, 1, 0) and plan.has_comms()


def test_parity_compare_reports_a_missing_gradient_and_a_wrong_shape():
    report = parity.compare(
        rank=1,
        gradients={0: [("0.weight", None), ("0.bias", np.zeros(3))]},
        loss=None,
        reference_loss=1.0,
        reference_grads={"0.weight": np.ones((3, 3)), "0.bias": np.ones(2)},
    )
    assert [m.what for m in report.mismatches] == [
        "gradient of 0.weight (stage 0) (missing)",
        "gradient of 0.bias (stage 0)",
    ]
    assert all(m.relative_error == float("inf") for m in report.mismatches)
    assert report.tolerance == parity.TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.bool, torch.int8])
def test_stream_header_round_trips(dtype):
    meta = TensorMeta((4, 1, 7), dtype)
    assert TensorMeta.from_header(meta.header()) == meta


def test_stream_header_refuses_what_it_cannot_describe():
    with pytest.raises(RuntimeError, match="at most 8 dims"):
        TensorMeta((1,) * 9, torch.float32).header()
    with pytest.raises(RuntimeError, match="cannot send dtype float8_e4m3fn"):
        TensorMeta((2,), torch.float8_e4m3fn).header()


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown backend 'jax'; choose from torch, mindspore"):
        backend_module("jax")


def test_framework_neutral_modules_import_no_framework():
    """The runner, the demo worker, the parity check, the launchers and the seam itself are
    written against the backend seam: importing them loads neither torch nor MindSpore."""
    code = (
        "import sys; import pipetrace.runtime.runner, pipetrace.runtime.worker, "
        "pipetrace.runtime.parity, pipetrace.runtime.launch, pipetrace.runtime.backend, "
        "pipetrace.runtime.mindspore.cluster; "
        "print(sorted(m for m in ('torch', 'mindspore') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_demo_worker_outside_its_launcher_names_what_is_missing(monkeypatch):
    from click.testing import CliRunner

    from pipetrace.runtime.worker import main

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(main, ["--schedule", "1f1b"])
    assert result.exit_code == 2
    assert "RANK and WORLD_SIZE not set: start this under torchrun" in result.output


def _samples_by_step(recorder: ListRecorder, iteration: int) -> dict[str, list[int]]:
    """Iteration ``iteration``'s memory samples: the in-flight bytes after each step."""
    begins, start = {}, None
    for i, event in enumerate(recorder.events):
        if event["event"] == "begin_iteration" and event["iteration"] == iteration:
            start = i
        elif start is not None and event["event"] == "begin_step":
            begins[event["token"]] = event["step"]
        elif start is not None and event["event"] == "end_iteration":
            break
    samples = recorder.events[start:i] if start is not None else []
    return {begins[e["step"]]: e["inflight"] for e in samples if e["event"] == "memory_sample"}


def test_memory_samples_count_local_hand_offs_until_consumed():
    """A one-rank plan's hand-offs: the activation F(s) passes on counts in stage s+1's slot
    until that stage's forward takes it, a gradient in stage s-1's until its backward does
    (the composite's forward and backward hand over on two threads). A recorder switched on
    again after an unrecorded iteration samples the same bytes."""
    _, stages = make_stages(3)
    plan = Plan(2, (0, 0, 0), MIXED_ROWS)
    recorder = ListRecorder(records_memory=True)
    executor = Executor(plan=plan, rank=0, stages=stages, p2p=None, recorder=recorder)
    inputs, targets = demo_batch(0, 2 * DEMO.microbatch_size, DEMO, seed=0)
    batch = inputs.split(DEMO.microbatch_size), targets.split(DEMO.microbatch_size)
    for iteration in range(3):
        recorder.records_memory = iteration != 1  # off for the middle one
        executor.run_iteration(*batch)
    executor.close()
    one = DEMO.microbatch_size * DEMO.width * 8  # an activation or its gradient, float64
    first = _samples_by_step(recorder, 0)
    assert first["0F0"] == [0, one, 0] and first["1F0"] == [0, 0, one]
    assert first["2F0"] == [0, 0, 0]  # the last stage keeps its loss, hands nothing on
    assert first["(2F1;2I0)OVERLAP_F_B"] == [0, one, 0]  # 2F1 took its input, 2I0 gave dx
    assert first["1B0"] == [one, 0, 0] and first["0I0"] == [0, 0, 0]
    assert first["0RESHARD"] == [0, 0, 0]
    assert _samples_by_step(recorder, 1) == {}
    third = _samples_by_step(recorder, 2)
    assert third == {step: first[step] for step in third}
    # after the first sample, steps that move no bytes are not sampled
    assert set(first) - set(third) == {"0UNSHARD", "0REDUCE_GRAD", "0RESHARD"}


def test_tied_weights_with_a_given_plan_need_its_tied_reductions():
    """Without TIED_REDUCE steps the two copies' gradients were never summed, silently."""
    from pipetrace.runtime.runner import resolve_plan
    from pipetrace.schedule.builders import build_plan

    plain = build_plan("1f1b", num_ranks=4, num_microbatches=8)
    with pytest.raises(ValueError, match="tied weights need TIED_REDUCE steps in the given plan"):
        resolve_plan(plain, 4, None, None, True)
    tied = build_plan("1f1b", num_ranks=4, num_microbatches=8, comms=True, tie_weights=True)
    assert resolve_plan(tied, 4, None, None, True) is tied
    # zbv puts the first and the last stage on rank 0: autograd sums the tied copies there
    zbv = build_plan("zbv", num_ranks=2, num_microbatches=4, stages_per_rank=2)
    assert resolve_plan(zbv, 2, None, None, True).has_comms()


def test_a_module_list_is_one_module_per_stage_and_another_model_is_named():
    from pipetrace.runtime.split import stage_modules

    backend = TorchBackend()
    plan = Plan(2, (0, 1), [[F(0, 0)], [F(1, 0)]])
    parts = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    assert stage_modules(backend, torch.nn.ModuleList(parts), plan, 1) == {1: parts[1]}

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(4, 4)

    with pytest.raises(TypeError, match=r"^got a Net, which is not nn.Sequential: give a whole"):
        stage_modules(backend, Net(), plan, 0)


def test_a_stage_returning_a_tuple_and_a_step_without_autograd_are_named():
    class Pair(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    stage = PipelineStage(Pair(), stage_index=0, num_stages=2)
    with pytest.raises(TypeError, match=r"^stage 0 returned a tuple: a stage returns one tensor"):
        stage.forward(0, torch.ones(2, 2))
    backend = TorchBackend()
    assert backend.cannot_train() is None
    with torch.no_grad():
        assert "torch.no_grad()" in backend.cannot_train()
    with torch.inference_mode():
        assert "torch.inference_mode()" in backend.cannot_train()


def test_failures_are_told_own_errors_first_then_stalls_then_lost_peers():
    """In a deadlock a peer of the cycle loses its connection when a stalled rank's watchdog
    ends it: the stall says more, so it comes first even when noticed later."""
    from pipetrace.runtime.launch import _order
    from pipetrace.runtime.results import RankFailure

    closed = RankFailure(0, "RuntimeError: [pair.cc:553] Connection closed by peer", at=1.0)
    stalled = RankFailure(1, "waiting for rank 2 in step 1SEND_F1 (iteration 1)", at=2.0)
    raised = RankFailure(2, "RuntimeError: injected crash", at=3.0)
    failures = [closed, stalled, raised]
    _order(failures)
    assert [f.rank for f in failures] == [2, 1, 0]
