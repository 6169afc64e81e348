"""The ``--inject`` spec language: ``KIND[:KEY=VALUE,...]`` parsed into the typed fault records of
`pipetrace.runtime.faults`, and resolved against a run (defaults filled in, checked against
its plan) before any rank starts."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pipetrace.errors import PipetraceError
from pipetrace.runtime.faults import FAULT_KINDS, Fault, FaultTarget

if TYPE_CHECKING:
    from pipetrace.runtime.config import RunConfig

FAULT_HELP = """\b
Faults for --inject KIND[:KEY=VALUE,...] (repeatable), e.g. straggler:rank=2,factor=3
  crash           raise in a step             rank step microbatch phase=F|B|W
  hang            block forever in a step     rank step microbatch phase=F|B|W
  deadlock        hold a send to peer until   rank peer step microbatch
                  a recv from peer completes
  drop-recv       skip one recv               rank step microbatch channel=F|B
  drop-send       skip one send               rank step microbatch channel=F|B
  extra-send      send a message twice        rank step microbatch channel=F|B
  shape-mismatch  send a smaller tensor       rank step microbatch channel shape=AxB
  swap-order      send two messages of a      rank step microbatch channel
                  channel in swapped order
  straggler       compute factor x slower     rank step factor=3 phase=F|B|all
  slow-link       delay every send            rank step delay=20ms

Defaults: rank = P/2 (deadlock: (P-1)/2 with peer = rank+1); step = 1, the iteration
counted from 0 (straggler and slow-link: 0, and every step after); microbatch = 1
(deadlock, swap-order: the first that can); channel = F where the rank has one. With a
fault that hangs (hang, deadlock, drop-recv, drop-send), --stall-timeout, --abort-timeout and
--timeout default to 3, 2 and 20 s. With --data-parallel D every fault also takes
replica=0..D-1 (default 0): rank is then the pipeline rank within that replica.
--runtime torch takes {torch}. Details: docs/runtime.md, "Fault injection".
""".format(torch=", ".join(kind for kind, cls in FAULT_KINDS.items() if "torch" in cls.RUNTIMES))


# -- parsing -----------------------------------------------------------------------------


def parse_fault(text: str) -> Fault:
    """``KIND[:KEY=VALUE,...]`` -> a fault with the given values (defaults still None)."""
    kind, _, rest = text.strip().partition(":")
    cls = FAULT_KINDS.get(kind.strip().lower())
    if cls is None:
        raise PipetraceError(
            f"--inject {text!r}: unknown fault kind {kind.strip()!r}; choose from "
            f"{', '.join(FAULT_KINDS)}"
        )
    keys = cls.keys()
    values: dict[str, object] = {}
    for item in rest.split(",") if rest.strip() else []:
        key, eq, raw = item.partition("=")
        key = key.strip().lower()
        if not eq or not key or not raw.strip():
            raise PipetraceError(f"--inject {text!r}: expected KEY=VALUE, got {item.strip()!r}")
        if key not in keys:
            raise PipetraceError(
                f"--inject {text!r}: {cls.KIND} takes {', '.join(keys)}; got {key!r}"
            )
        if key in values:
            raise PipetraceError(f"--inject {text!r}: {key} given twice")
        values[key] = _convert(text, cls, key, raw.strip())
    return cls(**values)  # type: ignore[arg-type]


def _convert(text: str, cls: type[Fault], key: str, raw: str) -> object:
    def bad(allowed: str) -> PipetraceError:
        return PipetraceError(f"--inject {text!r}: {key} must be {allowed}, got {raw!r}")

    if key in ("rank", "peer", "step", "microbatch", "replica"):
        if not raw.isdigit():
            raise bad("an integer >= 0")
        return int(raw)
    if key == "factor":
        try:
            value = float(raw)
        except ValueError:
            raise bad("a number > 1") from None
        if not value > 1 or math.isinf(value):
            raise bad("a number > 1")
        return value
    if key == "delay":
        scale, number = (1e-3, raw[:-2]) if raw.endswith("ms") else (1.0, raw.removesuffix("s"))
        try:
            value = float(number) * scale
        except ValueError:
            raise bad("a time such as 0.02, 20ms or 1s") from None
        if not 0 < value <= 60:
            raise bad("a time > 0 and at most 60 s (e.g. 20ms)")
        return value
    if key == "phase":
        phases: tuple[str, ...] = cls.PHASES
        value_ = "all" if raw.lower() == "all" else raw.upper()
        if value_ not in phases:
            raise bad(" or ".join(phases))
        return value_
    if key == "channel":
        if raw.upper() not in ("F", "B"):
            raise bad("F or B")
        return raw.upper()
    if key == "shape":
        dims = raw.lower().split("x")
        if not all(d.isdigit() and int(d) > 0 for d in dims) or len(dims) > 8:
            raise bad("dimensions > 0 joined by x, e.g. 16x128")
        return tuple(int(d) for d in dims)
    raise AssertionError(key)


def resolve_faults(faults: tuple[Fault | str, ...], config: RunConfig) -> tuple[Fault, ...]:
    """Parse (strings), fill in defaults and check every fault against ``config``'s plan."""
    parsed = [parse_fault(f) if isinstance(f, str) else f for f in faults]
    if not parsed:
        return ()
    if config.backend != "torch":
        raise PipetraceError(f"--inject works with --backend torch only, not {config.backend}")
    for fault in parsed:
        if config.runtime not in fault.RUNTIMES:
            takes = [kind for kind, cls in FAULT_KINDS.items() if config.runtime in cls.RUNTIMES]
            raise PipetraceError(
                f"--inject {fault.KIND}: not on --runtime {config.runtime}, which takes "
                f"{', '.join(takes)}"
            )
    where = FaultTarget(
        config.plan(),
        config.steps,
        config.overlap_p2p,
        (config.demo.microbatch_size, config.demo.width),
        config.data_parallel,
    )
    return tuple(f.resolve(where) for f in parsed)
