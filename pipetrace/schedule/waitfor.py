"""The wait-for graph: who waits for whom, grouped by what each waiting node ends up on.

Both the verifier (ranks blocked in a simulated plan, :mod:`.execution`) and the run analyzer
(ranks blocked in a recorded run, `pipetrace.analyze.deadlock`) reduce a hang to this graph
and solve it here. Every waiting node waits for exactly one thing (a node, or ``None``: a
message from nowhere), so the graph is functional: following the waits from any node ends
either in a cycle (a deadlock) or at a node that is not waiting, or at a waiting node whose
wait names no node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

CYCLE = "cycle"  # the waits go round: nobody in the cycle can move
ENDS_AT = "ends_at"  # the waits end at a node that is not waiting (finished, computing, ...)
DEAD_END = "dead_end"  # the waits end at a waiting node whose wait names no node
KINDS = (CYCLE, ENDS_AT, DEAD_END)


@dataclass
class WaitGroup:
    """Waiting nodes whose waits lead to one cycle or one end.

    ``cycle``: the cycle's nodes in wait order, from the first one the walk reached (CYCLE
    only). ``end``: the node that is not waiting (ENDS_AT) or the last waiting node
    (DEAD_END); -1 for a CYCLE. ``members``: every waiting node of the group, in the order given to
    `solve`."""

    kind: str
    cycle: list[int] = field(default_factory=list)
    end: int = -1
    members: list[int] = field(default_factory=list)


def solve(waits_for: Mapping[int, int | None], order: Iterable[int]) -> list[WaitGroup]:
    """Group the waiting nodes (the keys of ``waits_for``, each walked once in ``order``);
    the groups come in the order of their first member there."""
    group_of: dict[int, WaitGroup] = {}
    ends: dict[int, WaitGroup] = {}  # ENDS_AT groups by their end node
    groups: list[WaitGroup] = []
    for start in order:
        path = _walk(waits_for, start, group_of)
        last = waits_for[path[-1]] if path else start
        if last in group_of:
            group = group_of[last]  # type: ignore[index]
        elif last in path:
            group = WaitGroup(CYCLE, cycle=path[path.index(last) :])
        elif last is None:
            group = WaitGroup(DEAD_END, end=path[-1])
        else:
            group = ends.setdefault(last, WaitGroup(ENDS_AT, end=last))
        if not group.members:
            groups.append(group)
        group.members.append(start)
        for node in path:
            group_of[node] = group
    return groups


def _walk(
    waits_for: Mapping[int, int | None], start: int, known: Mapping[int, WaitGroup]
) -> list[int]:
    """The waiting nodes from ``start`` on, up to a repeat, an end or a grouped node."""
    path: list[int] = []
    seen: set[int] = set()
    node: int | None = start
    while node in waits_for and node not in known and node not in seen:
        path.append(node)
        seen.add(node)
        node = waits_for[node]
    return path
