"""A mapping whose values are built on first lookup and kept.

A 1024-rank run has thousands of lanes while a screen shows about forty; building every
lane up front cost seconds at start-up (docs/performance.md, the TUI section). The keys are
known cheaply up front, so ``len``, iteration and ``in`` cost nothing; a value costs its
build once, when something first looks at it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LazyMap(Mapping[K, V], Generic[K, V]):
    """``keys`` up front, ``build(key)`` on the first lookup of each key."""

    def __init__(self, keys: Iterable[K], build: Callable[[K], V]) -> None:
        self._keys = dict.fromkeys(keys)
        self._build = build
        self._built: dict[K, V] = {}

    def __getitem__(self, key: K) -> V:
        try:
            return self._built[key]
        except KeyError:
            if key not in self._keys:
                raise
        value = self._built[key] = self._build(key)
        return value

    def __iter__(self) -> Iterator[K]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def built(self) -> dict[K, V]:
        """The values built so far (a change that applies to every value need only reach
        these: later ones are built with it)."""
        return self._built
