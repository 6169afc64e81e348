"""What a training run is asked to do: `RunConfig` (each setting with its default, check and
`pipetrace run` flag), and what each rank is handed (`WorkerSpec`).

Pure Python (no torch, no click): the CLI validates flags and builds the plan here, in the
parent process, before any rank starts. The flags themselves are generated from `RunConfig`
in `pipetrace.cli.run_options`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipetrace.errors import PipetraceError
from pipetrace.limits import check_plan_size
from pipetrace.recorder.setup import ABORT_TIMEOUT, RECORD_MODE, STALL_TIMEOUT, RecordSettings
from pipetrace.runtime import fault_spec
from pipetrace.runtime.faults import Fault
from pipetrace.schedule.ir import Plan, ScheduleError, Step, StepKind
from pipetrace.schedule.swap import SwapPolicy, add_swap_steps, swap_problem
from pipetrace.settings import (
    Setting,
    SettingsError,
    at_least,
    check_settings,
    positive_seconds,
    setting,
)

if TYPE_CHECKING:
    from pipetrace.recorder.hooks import RecorderHooks
    from pipetrace.runtime.executor import StepContext

RecorderFactory = Callable[[int, int], "RecorderHooks"]
CustomFunction = Callable[[Step, "StepContext"], None]
LossCallback = Callable[[int, int, float], None]  # (case index, step, loss)

BACKENDS = ("torch", "mindspore")
RUNTIMES = ("pipetrace", "torch")
"""What executes the schedule: pipetrace's runtime (on ``--backend``), or torch's own
torch.distributed.pipelining (`pipetrace.torch_pipelining.demo`), recorded by the adapter."""

RANK_MEMORY_BYTES = 300 << 20
"""What one local torch rank needs at least (measured ~300 MB RSS)."""
RANKS_PER_CORE = 8
"""Local ranks per CPU core beyond which a run mostly waits for the CPU."""
MAX_LOCAL_RANKS_ENV = "PIPETRACE_MAX_LOCAL_RANKS"
"""Overrides the local-rank limit (`local_rank_limit`)."""

P2P_TIMEOUT = Setting(60.0, positive_seconds, flag="--timeout")
"""Seconds a rank may wait on a peer: the process-group timeout (also the runners' default)."""


def _swap_policy(value: str | None) -> str | None:
    """The check of ``swap``: None or a policy text `SwapPolicy.parse` accepts."""
    return None if value is None else swap_problem(value)


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

    def tied_names(self, num_stages: int) -> tuple[str, str]:
        """The weight that ``--tie-weights`` shares: the first block's Linear weight (the
        "input embedding") and the last block's (the "output projection"), by their names
        in the full model and in the stages."""
        return ("0.0.weight", f"{num_stages * self.blocks_per_stage - 1}.0.weight")


@dataclass(frozen=True)
class RunConfig:
    """One training run of the demo model on a pipeline schedule.

    Each field's default and check are declared once, with the `pipetrace run` flag that
    sets it (`pipetrace.settings`); the CLI's options are generated from these fields.
    """

    schedule: str = setting(flag="--schedule")
    """A built-in schedule name or torch class name (see `pipetrace schedule list`)."""
    ranks: int = setting(2, at_least(1), flag="--ranks")
    """Pipeline ranks P (per data-parallel replica)."""
    microbatches: int = setting(8, at_least(1), flag="--microbatches")
    """Micro-batches M per iteration."""
    stages_per_rank: int | None = setting(None, flag="--stages-per-rank")
    """Stages per rank V; None takes the schedule's default."""
    steps: int = setting(3, at_least(1), flag="--steps")
    """Training iterations (an SGD step after each)."""
    backend: str = setting("torch", choices=BACKENDS, flag="--backend")
    """The framework that executes the plan: "torch" or "mindspore"
    (`pipetrace.runtime.mindspore`)."""
    runtime: str = setting("pipetrace", choices=RUNTIMES, flag="--runtime")
    """"pipetrace" or "torch": the same model, data and schedule run by torch's
    torch.distributed.pipelining classes (one per built-in schedule), recorded."""
    out: str | None = setting(None, flag="--out")
    """The run directory for recordings, passed through to the recorder factory."""
    overwrite: bool = setting(False, flag="--overwrite")
    """Remove a previous run from ``out`` before recording (otherwise such a run is refused)."""
    seed: int = setting(0, flag="--seed")
    """Seeds the model initialisation and the synthetic data."""
    overlap_p2p: bool = setting(False, flag="--overlap-p2p")
    """Post recvs early and wait them in the consuming step; drain sends at iteration end."""
    check_parity: bool = setting(False, flag="--check-parity")
    """After step 1, compare the loss and every gradient with a single-process run."""
    timeout: float = P2P_TIMEOUT.field()
    """Seconds a rank may wait on a peer (the process-group timeout) before failing."""
    data_parallel: int = setting(1, at_least(1), flag="--data-parallel")
    """Data-parallel replicas D; the job uses P * D processes."""
    fsdp: bool = setting(False, flag="--fsdp")
    """Shard every stage with FSDP2 across the D replicas (adds UNSHARD/RESHARD/REDUCE_GRAD)."""
    overlap_bf: bool = setting(False, flag="--overlap-bf")
    """Pair each steady-state backward with the next forward in one OVERLAP_B_F step, run on
    two threads (1f1b and interleaved-1f1b)."""
    overlap_bf_split: bool = setting(False, flag="--overlap-bf-split")
    """As ``overlap_bf``, with each pair's backward split into I (dx) then W (dw), both run on
    the pair's worker thread: ``(0I3;0W3;0F7)OVERLAP_B_F``."""
    swap: str | None = setting(None, _swap_policy, flag="--swap")
    """Offload these activations to host memory between forward and backward: a swap policy
    (`pipetrace.schedule.swap.SwapPolicy`), e.g. "all", "stage=0", "microbatches=0-3";
    None swaps nothing."""
    learning_rate: float = 1.0
    """SGD learning rate."""
    record: str = RECORD_MODE.field()
    """What the recorder writes to ``out``: "off", "steps" or "full" (adds P2P stacks)."""
    stall_timeout: float = STALL_TIMEOUT.field()
    """Seconds without progress before a rank's watchdog records a stall (0: no watchdog)."""
    abort_timeout: float = ABORT_TIMEOUT.field()
    """Further seconds after a stall before the watchdog ends the rank (0: never)."""
    tie_weights: bool = setting(False, flag="--tie-weights")
    """Tie the demo's first and last Linear weights (`DemoConfig.tied_names`); the plan gets
    a TIED_REDUCE step on both stages' ranks, which sums the two gradients."""
    torch_profiler: bool = setting(False, flag="--torch-profiler")
    """Also capture a torch.profiler trace per rank into ``out/profiler/``."""
    demo: DemoConfig = DemoConfig()
    """The demo model's size."""
    faults: tuple[Fault, ...] = setting((), flag="--inject")
    """Faults to inject (`pipetrace.runtime.faults`; specs such as "hang:rank=2" are parsed).
    Construction fills in their defaults and checks them against the plan."""

    def __post_init__(self) -> None:
        check_settings(self)
        # before anything builds the plan (``-p 99999999999999999999``)
        check_plan_size(self.ranks, self.microbatches, max(self.stages_per_rank or 1, 2))
        # on MindSpore both flags are refused (`mindspore.support.check_run`): no advice to
        # add one
        if self.data_parallel > 1 and not self.fsdp and self.backend != "mindspore":
            raise SettingsError(
                RunConfig,
                "{data_parallel} > 1 needs {fsdp} (replicas keep in sync through FSDP's "
                "gradient reduction; plain replicated data parallelism is not implemented)",
            )
        if self.swap is not None and self.backend == "mindspore":
            raise SettingsError(
                RunConfig, "{swap} is not available on the mindspore backend; use --backend torch"
            )
        if self.torch_profiler and self.record == "off":
            raise SettingsError(
                RunConfig,
                "{torch_profiler} writes into the run directory: it needs recording on",
            )
        if self.runtime == "torch":
            self._check_torch_runtime()
        if self.faults:  # last: the check builds the plan from the fields above
            object.__setattr__(self, "faults", fault_spec.resolve_faults(tuple(self.faults), self))

    def _check_torch_runtime(self) -> None:
        """What torch's runtime cannot be asked for: pipetrace's own P2P mode, step kinds and
        swap steps (torch's loop runs its own actions)."""
        if self.backend != "torch":
            raise SettingsError(
                RunConfig, "{runtime} torch runs on torch only, not {backend} " + self.backend
            )
        for name, given in (
            ("overlap_p2p", self.overlap_p2p),
            ("overlap_bf", self.overlap_bf),
            ("overlap_bf_split", self.overlap_bf_split),
            ("swap", self.swap is not None),
        ):
            if given:
                raise SettingsError(
                    RunConfig,
                    f"{{{name}}} is a feature of pipetrace's runtime; {{runtime}} torch runs "
                    "torch's schedule classes as they are",
                )

    def check_local_processes(self, environ: Mapping[str, str] = os.environ) -> None:
        """Refuse, before any process starts, more local processes than this machine can
        hold (`local_rank_limit`); the message names the variable that raises the limit."""
        limit = local_rank_limit(environ)
        if self.world_size > limit:
            raise SettingsError(
                RunConfig,
                f"{{ranks}} x {{data_parallel}} = {self.world_size} local processes, more than "
                f"this machine's limit of {limit} (set {MAX_LOCAL_RANKS_ENV} to go past it, "
                "or start ranks on several machines with torchrun)",
            )

    @property
    def hangs(self) -> bool:
        """Whether an injected fault leaves the run hung until the watchdog or a timeout ends it."""
        return any(fault.HANGS for fault in self.faults)

    @property
    def world_size(self) -> int:
        return self.ranks * self.data_parallel

    def plan(self) -> Plan:
        """The lowered plan (with messages, FSDP steps with ``fsdp``, activation swap steps
        with ``swap``, TIED_REDUCE with ``tie_weights``); a schedule that cannot be built
        raises PipetraceError (exit 2)."""
        from pipetrace.schedule.builders import build_plan, resolve_schedule_name

        try:
            steps = {
                "comms": True,
                "fsdp": self.fsdp,
                "overlap_bf": self.overlap_bf,
                "overlap_bf_split": self.overlap_bf_split,
                "tie_weights": self.tie_weights,
            }
            plan = build_plan(
                resolve_schedule_name(self.schedule),
                num_ranks=self.ranks,
                num_microbatches=self.microbatches,
                stages_per_rank=self.stages_per_rank,
                **steps,  # what the runtime executes besides compute
            )
            if self.swap is not None:
                plan = add_swap_steps(plan, SwapPolicy.parse(self.swap))
            return plan
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
        from_env = RecordSettings.from_env()
        if self.out is None:
            return from_env
        return dataclasses.replace(
            from_env,
            run_dir=self.out,
            mode=self.record,
            stall_timeout=self.stall_timeout,
            abort_timeout=self.abort_timeout,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the recorder's run header (faults as their resolved specs)."""
        return {**dataclasses.asdict(self), "faults": [fault.spec for fault in self.faults]}


def local_rank_limit(environ: Mapping[str, str] = os.environ) -> int:
    """How many local ranks `pipetrace run` starts at most: ``PIPETRACE_MAX_LOCAL_RANKS``
    if set, else what the cores (`RANKS_PER_CORE`) and the memory (`RANK_MEMORY_BYTES`)
    allow, whichever is less."""
    given = environ.get(MAX_LOCAL_RANKS_ENV, "")
    if given:
        try:
            return int(given)
        except ValueError:
            raise PipetraceError(f"{MAX_LOCAL_RANKS_ENV}={given!r} is not a whole number") from None
    by_cores = RANKS_PER_CORE * (os.cpu_count() or 1)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(by_cores, memory // RANK_MEMORY_BYTES))


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
