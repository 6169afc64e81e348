"""pipetrace's demo model trained by torch.distributed.pipelining's own runtime, recorded.

`run_torch_demo` starts the ranks on this machine (gloo on 127.0.0.1) and runs one or more
`TorchCase` one after the other in the same process group, each into its own run directory.
It is what the tests use, and what ``pipetrace run --runtime torch`` can call: the model,
data and loss are `pipetrace.runtime.demo`'s, so a run of pipetrace's runtime and one of
torch's on the same schedule can be compared with ``pipetrace diff``.

Faults (`TorchFault`) make the failures the analyzers must name: a forward that never
returns, a backward that raises, a send that is never posted. A CSV plan with two actions
swapped is a `TorchCase` with ``swap``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrace.recorder.setup import RecordSettings
from pipetrace.runtime.launch import free_port

CASES_ENV = "PIPETRACE_TORCH_DEMO_CASES"
SEED = 1234
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
SINGLE_STAGE = ("ScheduleGPipe", "Schedule1F1B")
CSV_RUNTIME = "csv"


@dataclass(frozen=True)
class TorchFault:
    """One fault on one rank, in iteration ``iteration`` at micro-batch ``microbatch``."""

    kind: str
    """"hang_forward" (the stage's forward never returns), "fail_backward" (its backward
    raises) or "drop_send" (its forward send of that micro-batch is never posted)."""
    rank: int
    iteration: int = 1
    microbatch: int = 0


@dataclass(frozen=True)
class TorchCase:
    """One run of the demo on a torch schedule class."""

    schedule: str
    """A class name of torch.distributed.pipelining.schedules, or "csv": a
    `_PipelineScheduleRuntime` loading the ``csv_from`` class's plan from a CSV file."""
    run_dir: str
    microbatches: int = 4
    stages_per_rank: int = 1
    steps: int = 2
    csv_from: str = "ScheduleInterleaved1F1B"
    swap: tuple[int, int, int] | None = None
    """(rank, i, j): swap the rank's actions i and j in the CSV."""
    fault: TorchFault | None = None
    stall_timeout: float = 30.0
    abort_timeout: float = 30.0
    width: int = 32
    microbatch_size: int = 4


def run_torch_demo(cases: list[TorchCase], world_size: int, *, timeout: float = 120.0) -> list[int]:
    """Run ``cases`` on ``world_size`` local ranks; returns each rank's exit code (ranks
    still running after ``timeout`` seconds are killed, -9)."""
    payload = json.dumps([dataclasses.asdict(case) for case in cases])
    return launch_local_ranks(
        [sys.executable, "-m", "pipetrace.torch_pipelining.demo"],
        world_size,
        env={CASES_ENV: payload},
        timeout=timeout,
    )


def launch_local_ranks(
    command: list[str], world_size: int, *, env: dict[str, str], timeout: float
) -> list[int]:
    """Start ``command`` once per rank with torchrun's variables (gloo on 127.0.0.1) and
    wait; returns the exit codes, -9 for a rank killed after ``timeout`` seconds."""
    port = free_port()
    processes = []
    for rank in range(world_size):
        rank_env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            **env,
        )
        processes.append(subprocess.Popen(command, env=rank_env))
    deadline = time.monotonic() + timeout
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(process.wait())
    return codes


def _load_cases(text: str) -> list[TorchCase]:
    cases = []
    for raw in json.loads(text):
        fault = raw.pop("fault")
        swap = raw.pop("swap")
        cases.append(
            TorchCase(
                **raw,
                fault=TorchFault(**fault) if fault else None,
                swap=tuple(swap) if swap else None,
            )
        )
    return cases


def _placement(schedule: str, world_size: int, num_stages: int) -> tuple[int, ...]:
    from pipetrace.schedule.ir import Placement, stage_to_rank

    shape = Placement.V if schedule in V_SHAPED else Placement.LOOP
    return stage_to_rank(shape, world_size, num_stages)


def build_schedule(case: TorchCase, rank: int, world_size: int) -> Any:
    """The case's torch schedule over this rank's stages of the demo model."""
    import torch
    from torch.distributed.pipelining import PipelineStage, schedules

    from pipetrace.runtime.config import DemoConfig
    from pipetrace.runtime.demo import build_demo_model, demo_loss
    from pipetrace.runtime.torch_backend import split_sequential

    source = case.csv_from if case.schedule == CSV_RUNTIME else case.schedule
    per_rank = 1 if source in SINGLE_STAGE else case.stages_per_rank
    num_stages = per_rank * world_size
    demo = DemoConfig(width=case.width, blocks_per_stage=1, microbatch_size=case.microbatch_size)
    chunks = split_sequential(build_demo_model(num_stages, demo, seed=SEED), num_stages)
    placement = _placement(source, world_size, num_stages)
    stages = [
        PipelineStage(chunks[s], s, num_stages, torch.device("cpu"))
        for s in range(num_stages)
        if placement[s] == rank
    ]
    if case.fault is not None and case.fault.rank == rank:
        _inject(case.fault, stages)
    cls = getattr(schedules, source)
    if source in SINGLE_STAGE:
        return cls(stages[0], n_microbatches=case.microbatches, loss_fn=demo_loss)
    schedule = cls(stages, n_microbatches=case.microbatches, loss_fn=demo_loss)
    if case.schedule != CSV_RUNTIME:
        return schedule
    path = Path(case.run_dir).with_suffix(f".rank{rank}.csv")
    order = {r: list(actions) for r, actions in schedule.pipeline_order_with_comms.items()}
    if case.swap is not None:
        swap_rank, i, j = case.swap
        row = order[swap_rank]
        row[i], row[j] = row[j], row[i]
    schedule.pipeline_order_with_comms = order
    schedule._dump_csv(str(path), format="compute_comms")
    runtime = schedules._PipelineScheduleRuntime(
        stages, n_microbatches=case.microbatches, loss_fn=demo_loss
    )
    runtime._load_csv(str(path), format="compute_comms")
    return runtime


def _inject(fault: TorchFault, stages: list[Any]) -> None:
    """Arm ``fault`` on this rank's first stage (before recording wraps it)."""
    stage = stages[0]
    state = {"iteration": -1}
    forward = stage.forward_one_chunk

    def counted_forward(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if chunk_id == 0:
            state["iteration"] += 1
        hit = state["iteration"] == fault.iteration and chunk_id == fault.microbatch
        if hit and fault.kind == "hang_forward":
            while True:
                time.sleep(1.0)
        return forward(chunk_id, *args, **kwargs)

    stage.forward_one_chunk = counted_forward
    if fault.kind == "fail_backward":
        backward = stage.backward_one_chunk

        def failing_backward(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if state["iteration"] == fault.iteration and chunk_id == fault.microbatch:
                raise RuntimeError(f"injected failure in the backward of micro-batch {chunk_id}")
            return backward(chunk_id, *args, **kwargs)

        stage.backward_one_chunk = failing_backward
    if fault.kind == "drop_send":
        sends = stage.get_fwd_send_ops

        def dropping_sends(chunk_id: int) -> list[Any]:
            ops = sends(chunk_id)
            if state["iteration"] == fault.iteration and chunk_id == fault.microbatch:
                return []
            return ops

        stage.get_fwd_send_ops = dropping_sends


def run_case(case: TorchCase, rank: int, world_size: int) -> None:
    """Train the demo for ``case.steps`` iterations, recorded into ``case.run_dir``."""
    import torch

    from pipetrace.runtime.config import DemoConfig
    from pipetrace.runtime.demo import demo_batch
    from pipetrace.torch_pipelining.api import record

    schedule = build_schedule(case, rank, world_size)
    settings = RecordSettings(
        run_dir=case.run_dir,
        stall_timeout=case.stall_timeout,
        abort_timeout=case.abort_timeout,
    )
    demo = DemoConfig(width=case.width, blocks_per_stage=1, microbatch_size=case.microbatch_size)
    stages = schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]
    first = any(stage.is_first for stage in stages)
    last = any(stage.is_last for stage in stages)
    params = [p for stage in stages for p in stage.submod.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05)
    with record(schedule, settings=settings, config={"demo": dataclasses.asdict(case)}):
        for step in range(case.steps):
            inputs, targets = demo_batch(
                step, case.microbatches * case.microbatch_size, demo, seed=SEED
            )
            args = (inputs,) if first else ()
            schedule.step(*args, target=targets if last else None)
            optimizer.step()
            optimizer.zero_grad()


def main() -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for case in _load_cases(os.environ[CASES_ENV]):
            run_case(case, rank, world_size)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
