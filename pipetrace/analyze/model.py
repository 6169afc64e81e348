"""The run model: one in-memory picture of a recorded run, shared by every analyzer and view.

`pipetrace.analyze.load.load_run` builds it; analyzers, the text report, the Perfetto export
and the TUI only read it. It is columnar: each rank's steps and P2P ops are numpy arrays (one
row per span), not one object per event, so a run of 10^7 events fits in a few hundred MB.

Conventions (see docs/analyze.md):

- Times are int64 **nanoseconds since** `Run.t0_ns`, on rank 0's clock: the recorded clock
  offsets are applied and then refined so that no matched message is received before it
  was sent (`ClockInfo`). An end that never happened (a step still open, an op never done)
  is `OPEN` (-1).
- Step texts are interned once per run in `Run.catalog`: a row's ``code`` indexes
  ``catalog.texts`` and the parallel arrays ``catalog.kind`` / ``stage`` / ``microbatch``.
- Rows are in the order the rank recorded them (begin order per thread).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipetrace.analyze.pipelines import Pipelines, rank_name
from pipetrace.recorder import format as fmt
from pipetrace.recorder.format import CHANNELS as CHANNELS  # re-exported for the views
from pipetrace.recorder.format import OPS as OPS
from pipetrace.schedule.ir import COMPUTE_KINDS, STEP_NUMBER, Plan, Step, StepKind, parse_step

if TYPE_CHECKING:
    from pipetrace.analyze.run_cache import RunEntry

try:
    from pipetrace.analyze import _linescan
except ImportError:  # not built: `_parse_texts` reads every text
    _linescan = None

OPEN = -1
"""The end time of a span that never ended (the only definition: parse and views import it)."""

KINDS: tuple[StepKind, ...] = tuple(StepKind)
"""``catalog.kind`` values index this tuple; -1 is a text that does not parse."""
KIND_CODE: dict[StepKind, int] = {k: i for i, k in enumerate(KINDS)}
COMPUTE_CODES = np.array(sorted(KIND_CODE[k] for k in COMPUTE_KINDS), dtype=np.int8)
COMPOSITE_CODES = np.array(
    sorted(KIND_CODE[k] for k in (StepKind.OVERLAP_F_B, StepKind.OVERLAP_B_F)), dtype=np.int8
)


def kind_table(kinds) -> np.ndarray:
    """A boolean lookup table over kind codes: ``table[catalog.kind[codes]]`` is a fast
    ``isin`` (index -1, an unparsable text, reads the last entry, which is False)."""
    table = np.zeros(len(KINDS) + 1, bool)
    for k in kinds:
        table[KIND_CODE[k]] = True
    return table


IS_COMPUTE = kind_table(COMPUTE_KINDS)
IS_COMPUTE_OR_COMPOSITE = kind_table(COMPUTE_KINDS | {StepKind.OVERLAP_F_B})
IS_COMM = kind_table({StepKind.SEND_F, StepKind.SEND_B, StepKind.RECV_F, StepKind.RECV_B})
IS_COMPOSITE = kind_table({StepKind.OVERLAP_F_B, StepKind.OVERLAP_B_F})
SEND_CODES = np.array([KIND_CODE[StepKind.SEND_F], KIND_CODE[StepKind.SEND_B]], dtype=np.int8)
RECV_CODES = np.array([KIND_CODE[StepKind.RECV_F], KIND_CODE[StepKind.RECV_B]], dtype=np.int8)

_SIMPLE_KINDS = frozenset(COMPUTE_KINDS) | {
    StepKind.SEND_F,
    StepKind.SEND_B,
    StepKind.RECV_F,
    StepKind.RECV_B,
}
_KIND_TEXT_CODE = {k.value: KIND_CODE[k] for k in _SIMPLE_KINDS}
_KINDS_TEXT = "|".join(sorted(_KIND_TEXT_CODE, key=len, reverse=True))
_SIMPLE = re.compile(f"({STEP_NUMBER})({_KINDS_TEXT})({STEP_NUMBER})")

OP_SEND, OP_RECV = 0, 1
"""``p2p.op`` codes: indexes into `OPS` (the trace's values of ``p2p_post.op``)."""
MAIN_THREAD = 0


class RankState:
    """How a rank's log ends (`RankStatus.state`)."""

    FINISHED = "finished"  # run_end recorded
    FAILED = "failed"  # an exception was recorded
    SIGNALED = "signaled"  # a terminating signal was recorded
    ABORTED = "aborted"  # the watchdog ended it after a stall
    STALLED = "stalled"  # a stall was recorded and nothing after it (still hung, or killed)
    ENDED = (
        "ended"  # the log just stops: no run_end and no failure event (killed, or still running)
    )
    MISSING = "missing"  # no usable log
    NOT_LOADED = "not_loaded"  # left out by --ranks / --replica (analyze/selection.py)


@dataclass
class StepCatalog:
    """Every distinct step text of the run, with its parsed parts (arrays indexed by code)."""

    texts: list[str]
    kind: np.ndarray  # int8: index into KINDS, -1 when the text does not parse
    stage: np.ndarray  # int32, -1 when none (composite, unparsable)
    microbatch: np.ndarray  # int32, -1 when none
    _codes: dict[str, int] | None = field(default=None, repr=False)  # `text_codes`
    _steps: list[Step | None] | None = field(default=None, repr=False)
    _one: dict[int, Step | None] = field(default_factory=dict, repr=False, compare=False)
    messages_by_code: tuple[np.ndarray, np.ndarray] | None = field(
        default=None, repr=False, compare=False
    )
    """`derive.message_identity` of every code, made there on first use."""

    @classmethod
    def build(
        cls,
        texts: list[str],
        parts: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
        codes: dict[str, int] | None = None,
        steps: list[Step | None] | None = None,
    ) -> StepCatalog:
        """``parts``: (kind, stage, microbatch) already parsed (e.g. by the loader's workers),
        with kind -2 for a text still to parse; ``codes``: text -> index, when already made;
        ``steps``: the Steps of the first texts, when already made."""
        if parts is None:
            kind, stage, mb = parse_texts(texts)
        else:
            kind, stage, mb = (a.copy() for a in parts)
            todo = np.flatnonzero(kind == -2)
            if len(todo):
                k, s, m = parse_texts([texts[i] for i in todo])
                kind[todo], stage[todo], mb[todo] = k, s, m
        return cls(
            list(texts),
            kind.astype(np.int8),
            stage.astype(np.int32),
            mb.astype(np.int32),
            codes,
            steps,
        )

    @property
    def text_codes(self) -> dict[str, int]:
        """Text -> code. Made on first use when not given: hashing a big run's few hundred
        thousand texts is a tenth of a reopen, and most views never look a text up."""
        if self._codes is None:
            self._codes = dict(zip(self.texts, range(len(self.texts))))
        return self._codes

    def code(self, text: str) -> int:
        """The code of a step text, -1 when the run never recorded it."""
        return self.text_codes.get(text, -1)

    def codes(self, texts: list[str]) -> np.ndarray:
        """`code` of many texts at once (int32)."""
        return np.fromiter(
            map(self.text_codes.get, texts, repeat(-1, len(texts))), np.int32, len(texts)
        )

    @property
    def steps(self) -> list[Step | None]:
        """The parsed step of every code (None for a text that does not parse).

        Built all at once on first use, from the parsed columns: a big run's plan names a
        few hundred thousand distinct steps, where a call per step would cost more than
        making the Step."""
        if self._steps is None:
            self._steps = []
        if len(self._steps) < len(self.texts):
            n = len(self._steps)
            self._steps += steps_of(
                self.texts[n:], self.kind[n:], self.stage[n:], self.microbatch[n:]
            )
        return self._steps

    def step(self, code: int) -> Step | None:
        """The parsed step of a code (None for a text that does not parse). Made alone
        while few were asked for (a view describing one step of a reopened run must not
        make the few hundred thousand of `steps`), then all at once."""
        if code < 0:
            return None
        built = self._steps
        if (built is not None and code < len(built)) or len(self._one) >= _ONE_BY_ONE:
            return self.steps[code]
        one = self._one.get(code, _UNMADE)
        if one is _UNMADE:
            at = slice(code, code + 1)
            one = self._one[code] = steps_of(
                self.texts[at], self.kind[at], self.stage[at], self.microbatch[at]
            )[0]
        return one  # type: ignore[return-value]

    def kind_of(self, code: int) -> StepKind | None:
        k = int(self.kind[code]) if code >= 0 else -1
        return KINDS[k] if k >= 0 else None


_ONE_BY_ONE = 256
"""How many steps `StepCatalog.step` makes one by one before it makes every step."""
_UNMADE = object()

_SIMPLE_KIND_AT: tuple[StepKind | None, ...] = tuple(
    k if k in _SIMPLE_KINDS else None for k in KINDS
) + (None,)
"""By kind code (-1, unparsable, reads the last entry): the kind when a text of it is just
"{stage}{KIND}{mb}", so its Step is made from the parsed columns without parsing again."""


_IS_SIMPLE = np.array([k is not None for k in _SIMPLE_KIND_AT], bool)


def steps_of(
    texts: list[str], kind: np.ndarray, stage: np.ndarray, mb: np.ndarray
) -> list[Step | None]:
    """One Step per text, from its parsed columns (composite and FSDP texts are parsed).

    The simple ones are made by one C-level ``map`` over the columns: a big plan has a few
    hundred thousand, and a Python loop around each call doubled the cost."""
    simple = _IS_SIMPLE[kind] & (mb >= 0)
    at = np.flatnonzero(simple)
    made = list(
        map(Step, map(KINDS.__getitem__, kind[at].tolist()), stage[at].tolist(), mb[at].tolist())
    )
    if len(made) == len(texts):
        return made
    steps = np.empty(len(texts), object)
    steps[at] = made
    others = np.flatnonzero(~simple)
    steps[others] = [_parsed(texts[i]) for i in others.tolist()]
    return steps.tolist()


def _parsed(text: str) -> Step | None:
    try:
        return parse_step(text)
    except ValueError:
        return None


def parse_texts(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kind, stage, microbatch) of step texts: the common "2F0" / "1SEND_B3" form by the
    compiled helper (`_linescan.simple_steps`: a big run has a few hundred thousand texts,
    and the regex and the int conversions were a tenth of a worker's parse), anything it
    leaves by `_parse_texts`; -1 where absent or unparsable."""
    n = len(texts)
    kind, stage, mb = np.full(n, -1, np.int8), np.full(n, -1, np.int32), np.full(n, -1, np.int32)
    if _linescan is None:
        left = range(n)
    else:
        listed = texts if type(texts) is list else list(texts)
        left = _linescan.simple_steps(listed, _KIND_TEXT_CODE, kind, stage, mb)
    if len(left):
        at = np.array(left, np.intp)
        kind[at], stage[at], mb[at] = _parse_texts([texts[i] for i in left])
    return kind, stage, mb


def _parse_texts(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`parse_texts` in Python: the simple form by one regex match, anything else by
    `parse_step`. A stage or micro-batch beyond int32 makes a text unparsable (no plan has
    one; a damaged log may)."""
    n = len(texts)
    kind, stage, mb = [-1] * n, [-1] * n, [-1] * n
    match = _SIMPLE.fullmatch
    codes = _KIND_TEXT_CODE
    for i, text in enumerate(texts):
        m = match(text) if type(text) is str else None
        if m is not None:
            st, kind_text, micro = m.groups()
            parsed = codes[kind_text], int(st), int(micro)
        else:
            try:
                step = parse_step(str(text))
            except ValueError:
                continue
            if step is None:
                continue
            parsed = (
                KIND_CODE[step.kind],
                -1 if step.stage is None else step.stage,
                -1 if step.microbatch is None else step.microbatch,
            )
        if parsed[1] <= _INT32_MAX and parsed[2] <= _INT32_MAX:
            kind[i], stage[i], mb[i] = parsed
    return np.array(kind, np.int8), np.array(stage, np.int32), np.array(mb, np.int32)


_INT32_MAX = 2**31 - 1


@dataclass
class StepTable:
    """One row per recorded step span (`step_begin` and its `step_end`)."""

    begin: np.ndarray  # int64 ns since Run.t0_ns
    end: np.ndarray  # int64, OPEN when never ended
    it: np.ndarray  # int32 iteration
    pos: np.ndarray  # int32 plan position (bubbles excluded)
    code: np.ndarray  # int32 into Run.catalog
    thread: np.ndarray  # int8 into Run.threads
    dbegin: np.ndarray  # int64: device begin (a `device` event), OPEN without one
    dend: np.ndarray  # int64: device end, OPEN without one

    def __len__(self) -> int:
        return len(self.begin)

    @classmethod
    def empty(cls) -> StepTable:
        types = (np.int64, np.int64, np.int32, np.int32, np.int32, np.int8, np.int64, np.int64)
        return cls(*(np.empty(0, dt) for dt in types))


@dataclass
class MemoryTable:
    """One row per `memory` sample: the bytes each stage of the rank held from ``t`` until
    the next row (docs/trace-format.md). ``saved`` and ``inflight`` have one column per stage
    of the rank, in `RankTimeline.stages` order."""

    t: np.ndarray  # int64 ns since Run.t0_ns
    step: np.ndarray  # int64: the row in the rank's StepTable whose step had ended, -1 none
    saved: np.ndarray  # int64 (samples, stages): activations kept for backward, on the device
    inflight: np.ndarray  # int64 (samples, stages): received, not yet consumed
    allocated: np.ndarray  # int64: the CUDA allocator's allocated bytes, -1 without
    reserved: np.ndarray  # int64: its reserved bytes, -1 without
    swapped: np.ndarray  # int64 (samples, stages): offloaded to the host (0 without swap)

    def __len__(self) -> int:
        return len(self.t)

    @classmethod
    def empty(cls, stages: int = 0) -> MemoryTable:
        none = np.empty(0, np.int64)
        grid = np.empty((0, stages), np.int64)
        return cls(none, none.copy(), grid, grid.copy(), none.copy(), none.copy(), grid.copy())


@dataclass
class P2PTable:
    """One row per P2P op (`p2p_post` and its `p2p_done`), with its matched counterpart."""

    post: np.ndarray  # int64 ns since Run.t0_ns
    done: np.ndarray  # int64, OPEN when never completed
    it: np.ndarray  # int32
    op: np.ndarray  # int8: OP_SEND or OP_RECV
    peer: np.ndarray  # int32 the other rank
    ch: np.ndarray  # int8: 0 "F", 1 "B", -1 other
    seq: np.ndarray  # int64
    nbytes: np.ndarray  # int64
    shape: np.ndarray  # int32 into Run.shapes
    dtype: np.ndarray  # int32 into Run.dtypes
    code: np.ndarray  # int32: the SEND/RECV step that posted it, into Run.catalog
    match_rank: np.ndarray  # int32: the rank of the counterpart op, -1 when unmatched
    match_index: np.ndarray  # int64: its row in that rank's P2PTable, -1 when unmatched
    dbegin: np.ndarray  # int64: device begin on the P2P stream, OPEN without one
    dend: np.ndarray  # int64: device end, OPEN without one

    def __len__(self) -> int:
        return len(self.post)

    @classmethod
    def empty(cls) -> P2PTable:
        types = (
            np.int64,
            np.int64,
            np.int32,
            np.int8,
            np.int32,
            np.int8,
            np.int64,
            np.int64,
            np.int32,
            np.int32,
            np.int32,
            np.int32,
            np.int64,
            np.int64,
            np.int64,
        )
        return cls(*(np.empty(0, dt) for dt in types))


@dataclass
class IterationTable:
    """One row per iteration the rank began."""

    it: np.ndarray  # int32
    begin: np.ndarray  # int64
    end: np.ndarray  # int64, OPEN when it never ended
    loss: np.ndarray  # float64, NaN when not recorded

    def __len__(self) -> int:
        return len(self.it)

    @classmethod
    def empty(cls) -> IterationTable:
        return cls(*(np.empty(0, dt) for dt in (np.int32, np.int64, np.int64, np.float64)))


@dataclass
class ClockInfo:
    """How a rank's times were put on rank 0's clock."""

    offset_start_ns: int | None  # recorded `clock` offsets (None: not recorded)
    offset_end_ns: int | None
    uncertainty_ns: int | None  # the smaller recorded uncertainty
    drift_ns: int  # end offset minus start offset (0 without both)
    correction_ns: int = 0  # added by refinement so that no message arrives before it was sent
    applied: str = "none"  # "none", "start", "end", "interpolated"

    def to_json(self) -> dict[str, Any]:
        return {
            "offset_start_ns": self.offset_start_ns,
            "offset_end_ns": self.offset_end_ns,
            "uncertainty_ns": self.uncertainty_ns,
            "drift_ns": self.drift_ns,
            "correction_ns": self.correction_ns,
            "applied": self.applied,
        }


@dataclass
class LifecycleEvent:
    """A rare event kept as recorded: clock, stall, dump, signal, exception, abort, run_end, ...

    ``t`` is aligned like every other time; ``fields`` are the event's other fields.
    """

    e: str
    t: int
    fields: dict[str, Any]


FROM_ANOTHER_RUN = "from another run"  # how a set-aside log's status detail begins


@dataclass
class RankStatus:
    state: str  # a RankState value
    detail: str  # one line: how the log ends
    last_step: str | None = None  # text of the last step begun
    last_iteration: int | None = None
    error: str | None = None  # exception "Type: message", signal name or abort message

    @property
    def from_another_run(self) -> bool:
        """The rank's log was set aside as another run's (the rank is MISSING)."""
        return self.detail.startswith(FROM_ANOTHER_RUN)


@dataclass
class RankTimeline:
    """Everything recorded by one rank. A missing rank has ``present`` False and empty tables."""

    rank: int
    present: bool
    steps: StepTable
    p2p: P2PTable
    iterations: IterationTable
    status: RankStatus
    clock: ClockInfo
    header: dict[str, Any] = field(default_factory=dict)
    plan: list[str] = field(default_factory=list)  # run_start's plan (bubbles removed)
    plan_codes: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    stages: list[int] = field(default_factory=list)
    config: dict[str, Any] | None = None  # run_start's config
    lifecycle: list[LifecycleEvent] = field(default_factory=list)
    events: int = 0  # event lines read
    path: Path | None = None
    memory: MemoryTable = field(default_factory=MemoryTable.empty)

    def time_columns(self) -> tuple[np.ndarray, ...]:
        """Every time column of its tables (steps, P2P ops, iterations, device times, memory
        samples); OPEN where none."""
        return (
            self.steps.begin,
            self.steps.end,
            self.p2p.post,
            self.p2p.done,
            self.iterations.begin,
            self.iterations.end,
            self.steps.dbegin,
            self.steps.dend,
            self.p2p.dbegin,
            self.p2p.dend,
            self.memory.t,
        )

    def last_time(self) -> int:
        """The last time anything was recorded on the rank (0 for an empty log): where the
        views draw spans that never ended."""
        ends = [int(col.max()) for col in self.time_columns() if len(col)]
        return max([0, *ends, *(ev.t for ev in self.lifecycle)])

    def events_of(self, e: str) -> list[LifecycleEvent]:
        return [ev for ev in self.lifecycle if ev.e == e]

    def last_of(self, e: str) -> LifecycleEvent | None:
        found = self.events_of(e)
        return found[-1] if found else None

    def last_progress(self) -> int:
        """When a step or P2P op of the rank last began or ended (-1: never)."""
        times = [
            column[column != OPEN]
            for column in (self.steps.begin, self.steps.end, self.p2p.post, self.p2p.done)
        ]
        return max((int(t.max()) for t in times if len(t)), default=-1)

    def final_stall(self) -> LifecycleEvent | None:
        """The watchdog's last stall when nothing moved after it: where the rank stayed. A
        stall it recovered from (`analyze.pauses`) says nothing of how its log ends."""
        stall = self.last_of(fmt.STALL)
        return stall if stall is not None and self.last_progress() <= stall.t else None


@dataclass
class InputProblem:
    """Something wrong with the input that the analysis worked around."""

    severity: str  # "warning" or "info"
    message: str
    rank: int | None = None
    damage: bool = True
    """Whether the log's records may be wrong or missing (a finding read from them says so)."""

    def to_json(self) -> dict[str, Any]:
        return {"severity": self.severity, "rank": self.rank, "message": self.message}


@dataclass(frozen=True, repr=False)
class Later:
    """A field's value to be made on its first read (`LazyField`). Its repr is the default
    one: its function's arguments are a whole run's plan."""

    make: Callable[[], Any]


_NO_DEFAULT = object()


class LazyField:
    """A dataclass field that may be given a `Later` instead of its value: the value is made
    on the first read and kept. A reopened run's `Run.plan` is one: meta.json's plan as
    `Step` objects is 0.3 s of a 1 s reopen at 1024 ranks, and only the analyzers that check
    or simulate the plan read it (its rows come checked from the cache entry, so making it
    cannot fail). A kept analysis's `IdealTimeline.simulation` is another (``default``: the
    field's default)."""

    def __init__(self, default: Any = _NO_DEFAULT) -> None:
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}_value"

    def __get__(self, run: Any, owner: type | None = None) -> Any:
        if run is None:  # the class's own attribute: the default dataclasses ask for
            if self.default is _NO_DEFAULT:
                raise AttributeError(self.slot)
            return self.default
        value = run.__dict__[self.slot]
        if isinstance(value, Later):
            value = run.__dict__[self.slot] = value.make()
        return value

    def __set__(self, run: Any, value: Any) -> None:
        run.__dict__[self.slot] = value


def plan_from_meta(meta: dict[str, Any], rows: list[list[Step | None]]) -> Plan:
    """meta.json's plan, given its rows as Steps (bubbles None); KeyError, TypeError or
    ValueError when meta.json's other fields of the plan do not read."""
    schedule = meta.get("schedule") or {}
    return Plan(
        int(meta["num_microbatches"]),
        tuple(int(r) for r in meta["placement"]),
        rows,
        str(schedule.get("name", "custom")),
        dict(schedule.get("params", {})),
    )


@dataclass
class Run:
    """A loaded run (one directory, or several gathered by `pipetrace.analyze.source`)."""

    path: Path
    meta: dict[str, Any]
    plan: Plan | None = LazyField()  # type: ignore[assignment]
    """meta.json's plan (bubbles included); None when it does not parse. A `Later` may be
    given for it (`LazyField`)."""
    world_size: int
    ranks: list[RankTimeline]  # index = rank
    catalog: StepCatalog
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    threads: list[str]  # thread names; index 0 is "main"
    t0_ns: int  # epoch ns (rank 0's clock) of time 0
    problems: list[InputProblem] = field(default_factory=list)
    clock_quality: dict[str, Any] = field(default_factory=dict)  # see clocks.align
    directories: tuple[Path, ...] = ()
    """Every directory the run was gathered from (`path` is the one holding meta.json)."""
    pipelines: Pipelines = field(default_factory=Pipelines)  # the replicas' global ranks
    entry: RunEntry | None = field(default=None, compare=False, repr=False)
    """The run cache entry this is the model of, where its analysis is kept
    (`analysis.analyze_cached`); None when not cached (``--no-cache``, a log still written)."""
    recording: bool = field(default=False, compare=False)
    """Whether a rank of it still runs on this host (`analyze.live`): a run in progress,
    whose report must not be kept."""

    @property
    def present_ranks(self) -> list[RankTimeline]:
        return [r for r in self.ranks if r.present]

    @property
    def num_events(self) -> int:
        return sum(r.events for r in self.ranks)

    @property
    def schedule_name(self) -> str:
        schedule = self.meta.get("schedule")
        return str(schedule.get("name", "?")) if isinstance(schedule, dict) else "?"

    @property
    def p2p_mode(self) -> str | None:
        """ "plain" or "overlap", as meta.json's config says (the runtime's ``overlap_p2p``
        flag, or a ``p2p`` string); None when it does not say. `metrics.overlap_mode` is the
        mode measured from the ops themselves."""
        config = self.meta.get("config")
        if not isinstance(config, dict):
            return None
        if isinstance(config.get("p2p"), str):
            return config["p2p"]
        if isinstance(config.get("overlap_p2p"), bool):
            return "overlap" if config["overlap_p2p"] else "plain"
        return None

    @property
    def num_microbatches(self) -> int | None:
        value = self.meta.get("num_microbatches")
        return value if isinstance(value, int) else None

    def stages_of(self, rank: int) -> list[int]:
        """The stages global rank ``rank`` holds: as its log says, else as the plan says."""
        timeline = self.ranks[rank] if 0 <= rank < len(self.ranks) else None
        if timeline is not None and timeline.stages:
            return timeline.stages
        if self.plan is None:
            return []
        return self.plan.stages_of(self.pipelines.pipeline_rank(rank))

    def rank_name(self, rank: int) -> str:
        """How findings and views name global rank ``rank``: ``rank 3``, or with several
        replicas ``replica 1, stage 1, global rank 3``."""
        return rank_name(self.pipelines, rank, self.stages_of(rank))

    def iterations(self) -> list[int]:
        """Every iteration number seen on any rank, ascending."""
        seen: set[int] = set()
        for rank in self.ranks:
            seen.update(int(i) for i in rank.iterations.it)
        return sorted(seen)
