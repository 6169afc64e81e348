"""Which ranks of a run to load (`--ranks 0-3,8`, `--replica 1`).

A big job is often inspected one pipeline at a time: the loader parses only the selected
ranks and stands the others in as *not loaded* ranks (`RankState.NOT_LOADED`), so that a
finding whose wait leads to one of them says the rank was left out instead of blaming it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pipetrace.analyze.pipelines import pipelines_of
from pipetrace.errors import PipetraceError


def parse_rank_list(text: str) -> frozenset[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8}; ValueError saying what is wrong."""
    numbers: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not a number or a range like 0-3") from None
        if low < 0 or high < low:
            raise ValueError(f"{part.strip()!r} is not a range of ranks (0 <= first <= last)")
        numbers.update(range(low, high + 1))
    return frozenset(numbers)


def format_rank_list(numbers: Iterable[int], sep: str = ",") -> str:
    """The shortest ``"0-3,8"`` form of some numbers (``sep`` between the runs)."""
    ordered, runs = sorted(set(numbers)), []
    for n in ordered:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return sep.join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def short_rank_list(numbers: Iterable[int], limit: int = 48) -> str:
    """`format_rank_list`, or past ``limit`` characters (ranks strided over replicas do not
    make ranges) the first and last ones: ``9,19,29,...,319 (32 ranks)``."""
    ordered = sorted(set(numbers))
    text = format_rank_list(ordered)
    if len(text) <= limit or len(ordered) <= 6:
        return text
    return f"{','.join(map(str, ordered[:3]))},...,{ordered[-1]} ({len(ordered)} ranks)"


def replica_of_ranks(meta: dict[str, Any], world_size: int) -> list[int]:
    """The data-parallel replica of each global rank: from meta.json's ``pipelines``
    (``pipelines[replica]`` lists that replica's global ranks) when it has them, else
    consecutive blocks of the pipeline size, the layout `pipetrace run --data-parallel D`
    uses (replica = rank // P, P = the config's ``ranks``); one replica when neither says
    more, or when the world is one pipeline (older runs recorded replica 0 only)."""
    pipelines, _ = pipelines_of(meta, (), world_size)  # the loader's reading of them
    if pipelines.several:
        return [pipelines.replica_of(rank) for rank in range(world_size)]
    config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    replicas, per_replica = config.get("data_parallel"), config.get("ranks")
    if type(replicas) is not int or replicas < 1:
        return [0] * world_size
    if type(per_replica) is not int:
        per_replica = world_size // replicas
    if per_replica < 1 or per_replica * replicas != world_size:  # only one replica recorded
        return [0] * world_size
    return [rank // per_replica for rank in range(world_size)]


@dataclass(frozen=True)
class RankSelection:
    """The ranks and replicas asked for (None: no restriction of that kind)."""

    ranks: frozenset[int] | None = None
    replicas: frozenset[int] | None = None

    def resolve(self, meta: dict[str, Any], world_size: int) -> frozenset[int]:
        """The global ranks to load: in both filters; PipetraceError when none is left or a
        rank or replica does not exist in this run."""
        chosen = set(range(world_size))
        if self.ranks is not None:
            beyond = sorted(r for r in self.ranks if r >= world_size)
            if beyond:
                raise PipetraceError(
                    f"--ranks: the run has ranks 0-{world_size - 1}; no rank "
                    f"{format_rank_list(set(beyond))}"
                )
            chosen &= self.ranks
        if self.replicas is not None:
            replica = replica_of_ranks(meta, world_size)
            beyond = sorted(self.replicas - set(replica))
            if beyond:
                has = "one replica (0)" if max(replica) == 0 else f"replicas 0-{max(replica)}"
                raise PipetraceError(
                    f"--replica: the run has {has}; no replica {format_rank_list(set(beyond))}"
                )
            chosen &= {r for r in range(world_size) if replica[r] in self.replicas}
        if not chosen:
            raise PipetraceError("--ranks and --replica select no rank together")
        return frozenset(chosen)

    def describe(self) -> str:
        """The flags as given, for messages."""
        flags = []
        if self.ranks is not None:
            flags.append(f"--ranks {format_rank_list(self.ranks)}")
        if self.replicas is not None:
            flags.append(f"--replica {format_rank_list(self.replicas)}")
        return " ".join(flags)
