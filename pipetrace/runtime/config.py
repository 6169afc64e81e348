"""What a training run is asked to do, and the command-line flags that say it.

Pure Python (no torch): the CLI validates flags and builds the plan here, in the parent
process, before any rank starts. The same flags are parsed by `pipetrace run` and by
``python -m pipetrace.runtime.worker`` under torchrun (`run_options`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from pipetrace.errors import PipetraceError
from pipetrace.runtime import faults as _faults
from pipetrace.runtime.faults import Fault
from pipetrace.schedule.ir import Plan, ScheduleError, Step, StepKind

if TYPE_CHECKING:
    from pipetrace.recorder.hooks import RecorderHooks
    from pipetrace.recorder.setup import RecordSettings
    from pipetrace.runtime.executor import StepContext

RecorderFactory = Callable[[int, int], "RecorderHooks"]
CustomFunction = Callable[[Step, "StepContext"], None]
LossCallback = Callable[[int, int, float], None]  # (case index, step, loss)

BACKENDS = ("torch", "mindspore")


@dataclass(frozen=True)
class DemoConfig:
    """The built-in demo model and its synthetic data (see `pipetrace.runtime.demo`)."""

    width: int = 128
    """Features per layer: every block is Linear(width, width) + Tanh."""
    blocks_per_stage: int = 2
    """Blocks in each stage; the model has ``num_stages * blocks_per_stage`` blocks, so it
    splits evenly for every schedule and placement."""
    microbatch_size: int = 32
    """Samples per micro-batch; a global batch is ``microbatches * microbatch_size`` samples
    per data-parallel replica."""


@dataclass(frozen=True)
class RunConfig:
    """One training run of the demo model on a pipeline schedule."""

    schedule: str
    """A built-in schedule name or torch class name (see `pipetrace schedule list`)."""
    ranks: int = 2
    """Pipeline ranks P (per data-parallel replica)."""
    microbatches: int = 8
    """Micro-batches M per iteration."""
    stages_per_rank: int | None = None
    """Stages per rank V; None takes the schedule's default."""
    steps: int = 3
    """Training iterations (an SGD step after each)."""
    backend: str = "torch"
    """The framework that executes the plan: "torch" or "mindspore" (`pipetrace.runtime.mindspore`)."""
    out: str | None = None
    """The run directory for recordings, passed through to the recorder factory."""
    seed: int = 0
    """Seeds the model initialisation and the synthetic data."""
    overlap_p2p: bool = False
    """Post recvs early and wait them in the consuming step; drain sends at iteration end."""
    check_parity: bool = False
    """After step 1, compare the loss and every gradient with a single-process run."""
    timeout: float = 60.0
    """Seconds a rank may wait on a peer (the process-group timeout) before failing."""
    data_parallel: int = 1
    """Data-parallel replicas D; the job uses P * D processes."""
    fsdp: bool = False
    """Shard every stage with FSDP2 across the D replicas (adds UNSHARD/RESHARD/REDUCE_GRAD)."""
    learning_rate: float = 1.0
    """SGD learning rate."""
    record: str = "steps"
    """What the recorder writes to ``out``: "off", "steps" or "full" (adds P2P stacks)."""
    stall_timeout: float = 30.0
    """Seconds without progress before a rank's watchdog records a stall (0: no watchdog)."""
    abort_timeout: float = 30.0
    """Further seconds after a stall before the watchdog ends the rank (0: never)."""
    torch_profiler: bool = False
    """Also capture a torch.profiler trace per rank into ``out/profiler/``."""
    demo: DemoConfig = DemoConfig()
    """The demo model's size."""
    faults: tuple[Fault, ...] = ()
    """Faults to inject (`pipetrace.runtime.faults`; specs such as "hang:rank=2" are parsed).
    Construction fills in their defaults and checks them against the plan."""

    def __post_init__(self) -> None:
        checks = [
            ("--ranks", self.ranks, 1),
            ("--microbatches", self.microbatches, 1),
            ("--steps", self.steps, 1),
            ("--data-parallel", self.data_parallel, 1),
        ]
        for flag, value, low in checks:
            if value < low:
                raise PipetraceError(f"{flag} must be >= {low}, got {value}")
        if self.timeout <= 0:
            raise PipetraceError(f"--timeout must be > 0 seconds, got {self.timeout}")
        if self.data_parallel > 1 and not self.fsdp:
            raise PipetraceError(
                "--data-parallel > 1 needs --fsdp (replicas keep in sync through FSDP's "
                "gradient reduction; plain replicated data parallelism is not implemented)"
            )
        if self.record not in ("off", "steps", "full"):
            raise PipetraceError(f"--record must be off, steps or full, got {self.record!r}")
        for flag, value in (
            ("--stall-timeout", self.stall_timeout),
            ("--abort-timeout", self.abort_timeout),
        ):
            if value < 0:
                raise PipetraceError(f"{flag} must be >= 0 seconds (0 turns it off), got {value}")
        if self.torch_profiler and self.record == "off":
            raise PipetraceError(
                "--torch-profiler writes into the run directory: it needs recording on"
            )
        if self.backend not in BACKENDS:
            raise PipetraceError(
                f"unknown --backend {self.backend!r}; choose from {', '.join(BACKENDS)}"
            )
        if self.faults:  # last: the check builds the plan from the fields above
            object.__setattr__(self, "faults", _faults.resolve_faults(tuple(self.faults), self))

    @property
    def hangs(self) -> bool:
        """Whether an injected fault leaves the run hung until the watchdog or a timeout ends it."""
        return any(fault.HANGS for fault in self.faults)

    @property
    def world_size(self) -> int:
        return self.ranks * self.data_parallel

    def plan(self) -> Plan:
        """The lowered plan (with messages, and FSDP steps with ``fsdp``); a schedule that
        cannot be built raises PipetraceError (exit 2)."""
        from pipetrace.schedule.builders import build_plan, resolve_schedule_name

        try:
            return build_plan(
                resolve_schedule_name(self.schedule),
                num_ranks=self.ranks,
                num_microbatches=self.microbatches,
                stages_per_rank=self.stages_per_rank,
                comms=True,
                fsdp=self.fsdp,
            )
        except ScheduleError as exc:
            raise PipetraceError(str(exc)) from None

    def check_backend(self) -> None:
        """Refuse, before any process starts, a run the chosen backend cannot do (MindSpore
        not installed: the message says how to install it)."""
        if self.backend == "mindspore":
            from pipetrace.runtime.mindspore.support import check_run

            check_run(self)

    def record_settings(self) -> RecordSettings:
        """The recorder settings of this run; without ``out`` (under torchrun), PIPETRACE_DIR
        and the other PIPETRACE_* variables decide. With ``out``, the flags decide what they
        name and the variables the rest (flush interval, buffer size)."""
        from pipetrace.recorder.setup import RecordSettings

        from_env = RecordSettings.from_env()
        if self.out is None:
            return from_env
        return dataclasses.replace(
            from_env,
            run_dir=self.out if self.record != "off" else None,
            mode=self.record if self.record != "off" else "steps",
            stall_timeout=self.stall_timeout,
            abort_timeout=self.abort_timeout,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the recorder's run header (faults as their resolved specs)."""
        return {**dataclasses.asdict(self), "faults": [fault.spec for fault in self.faults]}


@dataclass
class WorkerSpec:
    """Everything a rank needs; pickled to each started rank, so callables must be
    importable module-level objects (or picklable instances of such classes)."""

    cases: tuple[RunConfig, ...]
    """Run configurations, run in order in one process group (same world size)."""
    make_recorder: RecorderFactory | None = None
    """``make_recorder(rank, world_size)`` -> the recorder for one case; None records nothing."""
    custom_functions: tuple[tuple[StepKind, CustomFunction], ...] = ()
    """Handlers registered on every rank's runner for every case (see `StepContext`)."""
    threads_per_rank: int | None = None
    """torch intra-op threads per rank; None leaves torch's default."""


def run_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The flags of a training run.

    The wrapped function receives ``make_config(default_ranks) -> RunConfig``: ``--ranks``
    defaults to 2 for `pipetrace run` but to WORLD_SIZE / D under torchrun, which only the
    caller knows. Building the config validates the flags; ``make_config(..., inject=False)``
    leaves out the --inject faults (for a probe that only reads other flags).

    With a fault that hangs (`RunConfig.hangs`), --stall-timeout, --abort-timeout and --timeout
    default to `faults.HANG_STALL_TIMEOUT` etc., so that the run ends within seconds.
    """

    @click.option(
        "--schedule",
        "-s",
        required=True,
        help="Schedule name, e.g. 1f1b, zbv, dualpipev, or a torch class name.",
    )
    @click.option(
        "--ranks",
        "-p",
        type=int,
        default=None,
        help="Pipeline ranks P.  [default: 2; WORLD_SIZE / D under torchrun]",
    )
    @click.option(
        "--microbatches",
        "-m",
        type=int,
        default=8,
        show_default=True,
        help="Micro-batches M per iteration.",
    )
    @click.option(
        "--stages-per-rank",
        "-v",
        type=int,
        default=None,
        help="Stages per rank V (interleaved-1f1b, zb1p; zbv and dualpipev use 2).",
    )
    @click.option(
        "--steps", "-n", type=int, default=3, show_default=True, help="Training iterations."
    )
    @click.option(
        "--backend",
        type=click.Choice(BACKENDS),
        default="torch",
        show_default=True,
        help="Framework that runs the plan.",
    )
    @click.option(
        "--out",
        "-o",
        type=click.Path(file_okay=False),
        default=None,
        help="Run directory for the recording.  [default: runs/SCHEDULE-TIME]",
    )
    @click.option(
        "--record",
        type=click.Choice(["off", "steps", "full"]),
        default="steps",
        show_default=True,
        help="steps: every step, P2P op and lifecycle event; full: also the stack of each P2P post.",
    )
    @click.option(
        "--stall-timeout",
        type=float,
        default=None,
        help="Seconds without progress before a rank records a stall with every thread's stack (0: off).  [default: 30; 3 with a fault that hangs]",
    )
    @click.option(
        "--abort-timeout",
        type=float,
        default=None,
        help="Further seconds after a stall before the watchdog ends the rank (0: never).  [default: 30; 2 with a fault that hangs]",
    )
    @click.option(
        "--torch-profiler",
        is_flag=True,
        help="Also capture a torch.profiler trace per rank into OUT/profiler/.",
    )
    @click.option(
        "--seed",
        type=int,
        default=0,
        show_default=True,
        help="Seed for the model and the synthetic data.",
    )
    @click.option(
        "--overlap-p2p",
        is_flag=True,
        help="Post recvs early, wait them where consumed; drain sends at iteration end.",
    )
    @click.option(
        "--check-parity",
        is_flag=True,
        help="After step 1, compare loss and gradients with a single-process run.",
    )
    @click.option(
        "--timeout",
        type=float,
        default=None,
        help="Seconds a rank waits on a peer before failing.  [default: 60; 20 with a fault that hangs]",
    )
    @click.option(
        "--data-parallel",
        "-d",
        type=int,
        default=1,
        show_default=True,
        help="Data-parallel replicas D (P * D processes).",
    )
    @click.option("--fsdp", is_flag=True, help="Shard each stage with FSDP2 across the D replicas.")
    @click.option(
        "--inject",
        multiple=True,
        metavar="KIND[:KEY=VALUE,...]",
        help=f"Inject a fault (repeatable): {', '.join(_faults.FAULT_KINDS)}; keys and defaults below.",
    )
    @functools.wraps(func)
    def wrapper(
        schedule: str,
        ranks: int | None,
        microbatches: int,
        stages_per_rank: int | None,
        steps: int,
        backend: str,
        out: str | None,
        seed: int,
        overlap_p2p: bool,
        check_parity: bool,
        timeout: float | None,
        data_parallel: int,
        fsdp: bool,
        record: str,
        stall_timeout: float | None,
        abort_timeout: float | None,
        torch_profiler: bool,
        inject: tuple[str, ...],
        **kwargs: Any,
    ) -> Any:
        faults = tuple(_faults.parse_fault(spec) for spec in inject)
        hangs = any(fault.HANGS for fault in faults)

        def pick(given: float | None, usual: float, hanging: float) -> float:
            return given if given is not None else hanging if hangs else usual

        def make(default_ranks: int, *, inject: bool = True) -> RunConfig:
            return RunConfig(
                schedule=schedule,
                ranks=default_ranks if ranks is None else ranks,
                microbatches=microbatches,
                stages_per_rank=stages_per_rank,
                steps=steps,
                backend=backend,
                out=out,
                seed=seed,
                overlap_p2p=overlap_p2p,
                check_parity=check_parity,
                timeout=pick(timeout, 60.0, _faults.HANG_P2P_TIMEOUT),
                data_parallel=data_parallel,
                fsdp=fsdp,
                record=record,
                stall_timeout=pick(stall_timeout, 30.0, _faults.HANG_STALL_TIMEOUT),
                abort_timeout=pick(abort_timeout, 30.0, _faults.HANG_ABORT_TIMEOUT),
                torch_profiler=torch_profiler,
                faults=faults if inject else (),
            )

        return func(make_config=make, **kwargs)

    return wrapper
