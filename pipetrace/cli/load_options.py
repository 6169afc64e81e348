"""The options that say how a recorded run is loaded, shared by `analyze`, `tui` and `export`:
``--no-cache``, ``--ranks`` and ``--replica`` (declared here once)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from pipetrace.analyze.selection import RankSelection, parse_rank_list


@dataclass(frozen=True)
class Loading:
    """How to load the run: `load_run`'s ``cache`` and ``select`` arguments."""

    cache: bool = True
    select: RankSelection | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"cache": self.cache, "select": self.select}


def _rank_list(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    try:
        return parse_rank_list(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def load_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add the loading options to a click command; it receives them as ``loading``."""

    @click.option(
        "--no-cache",
        is_flag=True,
        help="Parse every rank log again: neither read nor write the columnar cache "
        "(RUN_DIR/.pipetrace-cache/, see docs/analyze.md).",
    )
    @click.option(
        "--ranks",
        metavar="LIST",
        callback=_rank_list,
        help="Load only these global ranks, e.g. 0-3,8; the others count as not loaded.",
    )
    @click.option(
        "--replica",
        metavar="LIST",
        callback=_rank_list,
        help="Load only the ranks of these data-parallel replicas (pipelines), e.g. 1 or 0,2.",
    )
    @functools.wraps(command)
    def with_loading(
        *args: Any,
        no_cache: bool,
        ranks: frozenset[int] | None,
        replica: frozenset[int] | None,
        **kwargs: Any,
    ) -> Any:
        select = RankSelection(ranks, replica) if ranks is not None or replica is not None else None
        try:
            return command(*args, loading=Loading(not no_cache, select), **kwargs)
        finally:
            from pipetrace.analyze.run_cache import wait_for_writes  # imports numpy: not for --help

            wait_for_writes()  # the run entry written behind the command (`run_cache`)

    return with_loading
