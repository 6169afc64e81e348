"""Pausing the cyclic garbage collector around work that makes many small acyclic objects."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building a large plan, model or chunk.

    A plan, or a chunk of decoded events, is hundreds of thousands of small acyclic objects;
    left on, the collector walks them again and again for nothing (about a third of the build
    time at P=64, M=512). Reference counting still frees everything; the previous state is
    restored on exit. The objects made meanwhile are moved straight to the oldest
    generation (`gc.freeze` then `gc.unfreeze`): otherwise the first collections after the
    pause walk them all once more (0.02-0.05 s after a 391k-step plan).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if was_enabled:
            gc.enable()
