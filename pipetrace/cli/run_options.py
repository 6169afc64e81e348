"""The flags of a training run, generated from `RunConfig`'s settings.

Each flag takes its name, default and choices from the `RunConfig` field it sets
(`pipetrace.settings`); only what a command line needs beyond that (a short form, the help
text, a default decided when the run starts) is written here. The same flags are parsed by
`pipetrace run` and by the rank entry points under torchrun and msrun.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click

from pipetrace.errors import PipetraceError
from pipetrace.runtime import fault_spec
from pipetrace.runtime import faults as _faults
from pipetrace.runtime.config import RunConfig
from pipetrace.schedule.swap import SWAP_EXAMPLES
from pipetrace.settings import SettingsError, settings_fields

_SETTINGS = settings_fields(RunConfig)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig)}

# Fields whose default, when the flag is not given, depends on a fault that hangs: lowered so
# that an injected run ends within seconds, recorded.
HANG_DEFAULTS = {
    "stall_timeout": _faults.HANG_STALL_TIMEOUT,
    "abort_timeout": _faults.HANG_ABORT_TIMEOUT,
    "timeout": _faults.HANG_P2P_TIMEOUT,
}


@dataclass(frozen=True)
class Flag:
    """How one `RunConfig` field appears on the command line, beyond its setting."""

    name: str
    """The field."""
    help: str
    short: str | None = None
    shown_default: str | None = None
    """A default decided when the run starts: shown in the help, and the flag defaults to None."""
    click_options: dict[str, Any] = field(default_factory=dict)
    """Passed to `click.option` as they are (a type the default does not imply, a metavar)."""

    def option(self) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        declared = _SETTINGS[self.name]
        default = _DEFAULTS[self.name]
        names = [declared.flag] + ([self.short] if self.short else []) + [self.name]
        options: dict[str, Any] = {"help": self.help}
        if default is dataclasses.MISSING:
            options["required"] = True
        elif self.shown_default is not None:
            options.update(default=None, help=f"{self.help}  [default: {self.shown_default}]")
        elif isinstance(default, bool):
            options.update(is_flag=True, default=default)
        else:
            options.update(default=default, show_default=default not in (None, ()))
        if declared.choices is not None:
            options["type"] = click.Choice(declared.choices)
        elif isinstance(default, int | float) and not isinstance(default, bool):
            options["type"] = type(default)
        return click.option(*names, **options, **self.click_options)


def _hang_default(name: str) -> str:
    return f"{_DEFAULTS[name]:g}; {HANG_DEFAULTS[name]:g} with a fault that hangs"


FLAGS = (
    Flag(
        "schedule", "Schedule name, e.g. 1f1b, zbv, dualpipev, or a torch class name.", short="-s"
    ),
    Flag(
        "ranks",
        "Pipeline ranks P.",
        short="-p",
        shown_default=f"{_DEFAULTS['ranks']}; WORLD_SIZE / D under torchrun",
    ),
    Flag("microbatches", "Micro-batches M per iteration.", short="-m"),
    Flag(
        "stages_per_rank",
        "Stages per rank V (interleaved-1f1b, zb1p; zbv and dualpipev use 2).",
        short="-v",
        click_options={"type": int},
    ),
    Flag("steps", "Training iterations.", short="-n"),
    Flag("backend", "Framework that runs the plan."),
    Flag(
        "runtime",
        "pipetrace: pipetrace's own runtime; torch: torch.distributed.pipelining's schedule "
        "class for the schedule (same model, data and seed), recorded by the adapter.",
    ),
    Flag(
        "out",
        "Run directory for the recording.",
        short="-o",
        shown_default="runs/SCHEDULE-TIME",
        click_options={"type": click.Path(file_okay=False)},
    ),
    Flag("overwrite", "Remove a previous run from --out first (otherwise refused)."),
    Flag(
        "record",
        "steps: every step, P2P op and lifecycle event; full: also the stack of each P2P post.",
    ),
    Flag(
        "stall_timeout",
        "Seconds without progress before a rank records a stall with every thread's stack "
        "(0: off).",
        shown_default=_hang_default("stall_timeout"),
    ),
    Flag(
        "abort_timeout",
        "Further seconds after a stall before the watchdog ends the rank (0: never).",
        shown_default=_hang_default("abort_timeout"),
    ),
    Flag(
        "tie_weights",
        "Tie the demo's first and last Linear weights; TIED_REDUCE sums their gradients.",
    ),
    Flag("torch_profiler", "Also capture a torch.profiler trace per rank into OUT/profiler/."),
    Flag("seed", "Seed for the model and the synthetic data."),
    Flag(
        "overlap_p2p",
        "Post recvs early, wait them where consumed; drain sends at iteration end.",
    ),
    Flag("check_parity", "After step 1, compare loss and gradients with a single-process run."),
    Flag(
        "timeout",
        "Seconds a rank waits on a peer before failing.",
        shown_default=_hang_default("timeout"),
    ),
    Flag("data_parallel", "Data-parallel replicas D (P * D processes).", short="-d"),
    Flag("fsdp", "Shard each stage with FSDP2 across the D replicas."),
    Flag(
        "overlap_bf",
        "Run each steady-state backward together with the next forward (OVERLAP_B_F steps; "
        "1f1b and interleaved-1f1b).",
    ),
    Flag(
        "overlap_bf_split",
        "As --overlap-bf, with each pair's backward split into I (dx) then W (dw) on the "
        "pair's backward thread.",
    ),
    Flag(
        "swap",
        "Offload these activations to host memory between forward and backward, with "
        f"overlapped swap steps: {SWAP_EXAMPLES}.",
        click_options={"metavar": "POLICY"},
    ),
    Flag(
        "faults",
        f"Inject a fault (repeatable): {', '.join(_faults.FAULT_KINDS)}; keys and defaults below.",
        click_options={"multiple": True, "metavar": "KIND[:KEY=VALUE,...]"},
    ),
)
"""In the order `--help` lists them."""


def run_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The flags of a training run.

    The wrapped function receives ``make_config(default_ranks) -> RunConfig``: ``--ranks``
    defaults to 2 for `pipetrace run` but to WORLD_SIZE / D under torchrun, which only the
    caller knows. Building the config validates the flags (errors name the flag);
    ``make_config(..., inject=False)`` leaves out the --inject faults (for a probe that only
    reads other flags).

    With a fault that hangs (`RunConfig.hangs`), --stall-timeout, --abort-timeout and --timeout
    default to `HANG_DEFAULTS`, so that the run ends within seconds.
    """

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Any:
        given = {flag.name: kwargs.pop(flag.name) for flag in FLAGS}
        faults = tuple(fault_spec.parse_fault(spec) for spec in given.pop("faults"))
        hangs = any(fault.HANGS for fault in faults)
        for name, hanging in HANG_DEFAULTS.items():
            if given[name] is None:
                given[name] = hanging if hangs else _DEFAULTS[name]

        def make(default_ranks: int, *, inject: bool = True) -> RunConfig:
            ranks = default_ranks if given["ranks"] is None else given["ranks"]
            try:
                return RunConfig(**{**given, "ranks": ranks}, faults=faults if inject else ())
            except SettingsError as exc:
                raise PipetraceError(exc.worded("flag"), exc.exit_code) from None

        return func(make_config=make, **kwargs)

    for flag in reversed(FLAGS):
        wrapper = flag.option()(wrapper)
    return wrapper
