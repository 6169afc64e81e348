"""Test helpers that rank processes must be able to import (they are pickled to the ranks):
an in-memory recorder that dumps its calls to a JSON-lines file, and custom step functions
that inject failures."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import orjson

from pipetrace.schedule.ir import Plan, Step, format_step


class ListRecorder:
    """Keeps every hook call as a dict (thread-safe: OVERLAP_F_B calls from two threads);
    writes them to ``path`` at `end_run` or `exception`, if a path is given."""

    def __init__(self, path: Path | None = None, *, records_memory: bool = False) -> None:
        self.path = path
        self.records_memory = records_memory
        """Whether the executor samples memory (asked at each iteration: may be switched)."""
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._tokens = 0

    def _add(self, **event: Any) -> int:
        with self._lock:
            self._tokens += 1
            event["token"] = self._tokens
            self.events.append(event)
            return self._tokens

    def _flush(self) -> None:
        if self.path is not None:
            self.path.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in self.events))

    def begin_run(
        self,
        *,
        rank: int,
        world_size: int,
        plan: Plan,
        config: dict[str, Any],
        place: Any = None,
    ) -> None:
        self._add(
            event="begin_run", rank=rank, world_size=world_size, plan=plan.to_json(), config=config
        )

    def begin_iteration(self, iteration: int) -> None:
        self._add(event="begin_iteration", iteration=iteration)

    def end_iteration(self, iteration: int, loss: float | None) -> None:
        self._add(event="end_iteration", iteration=iteration, loss=loss)

    def begin_step(self, position: int, step: Step, thread: str = "main") -> Any:
        return self._add(
            event="begin_step", position=position, step=format_step(step), thread=thread
        )

    def end_step(self, token: Any, nbytes: int | None = None) -> None:
        if nbytes is None:
            self._add(event="end_step", begin=token)
        else:
            self._add(event="end_step", begin=token, nbytes=nbytes)

    def p2p_posted(self, **fields: Any) -> Any:
        fields["step"] = format_step(fields["step"])
        fields["shape"] = list(fields["shape"])
        return self._add(event="p2p_posted", **fields)

    def p2p_completed(self, token: Any) -> None:
        self._add(event="p2p_completed", posted=token)

    def memory_sample(
        self,
        token: Any,
        saved: list[int],
        inflight: list[int],
        allocator: Any = None,
        swapped: list[int] | None = None,
    ) -> None:
        self._add(event="memory_sample", step=token, saved=saved, inflight=inflight)

    def exception(self, exc: BaseException) -> None:
        self._add(event="exception", error=f"{type(exc).__name__}: {exc}")
        self._flush()

    def end_run(self) -> None:
        self._add(event="end_run")
        self._flush()


class RecorderFiles:
    """A recorder factory: one `ListRecorder` per (rank, case), written under ``directory``
    as ``rank{r}-case{k}.jsonl`` (the count of calls in this process gives k)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._cases = 0

    def __call__(self, rank: int, world_size: int) -> ListRecorder:
        path = self.directory / f"rank{rank}-case{self._cases}.jsonl"
        self._cases += 1
        return ListRecorder(path)


def read_events(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def sabotage_forward(step: Step, context: Any) -> None:
    """Custom F handler for iteration 1: rank 2 raises at its first forward; rank 0 stops
    responding at its third, stuck in Python where no peer's failure can reach it, so the
    launcher must kill it. (In 1F1B on 4 ranks, rank 1 receives micro-batch 1 before it
    sends micro-batch 0 on: rank 0 must send two before rank 2 can get one.)"""
    if context.iteration == 1 and context.rank == 2:
        raise RuntimeError(f"injected failure in {step}")
    if context.iteration == 1 and context.rank == 0 and step.microbatch == 2:
        time.sleep(3600)
    context.default(step)
