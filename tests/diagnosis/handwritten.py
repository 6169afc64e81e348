"""Run directories written event by event from docs/trace-format.md alone (not by the recorder,
the runtime or the synthetic writer), so that tests can end a rank's log any way a user's job
can: cut anywhere, torn, with or without the watchdog's, the exception's or the signal's record.

The run: two ranks, one stage each, one micro-batch, plan
rank 0 `0F0 0SEND_F0 0RECV_B0 0B0`, rank 1 `1RECV_F0 1F0 1B0 1SEND_B0`, each iteration
`PERIOD_MS` long. Times are given in ms since the run's start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MS = 1_000_000
T0 = 1_800_000_000_000_000_000
PERIOD_MS = 100
PLAN = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
CONFIG = {"schedule": "handwritten", "overlap_p2p": False, "seed": 0}

# per rank: (step, begin ms, end ms, P2P op or None, post ms, done ms) within an iteration
_TIMING = {
    0: [
        ("0F0", 0, 10, None, 0, 0),
        ("0SEND_F0", 10, 13, "send", 10, 12),
        ("0RECV_B0", 13, 41, "recv", 13, 40),
        ("0B0", 41, 60, None, 0, 0),
    ],
    1: [
        ("1RECV_F0", 0, 13, "recv", 1, 12),
        ("1F0", 13, 23, None, 0, 0),
        ("1B0", 23, 37, None, 0, 0),
        ("1SEND_B0", 37, 41, "send", 38, 40),
    ],
}
_ITER_END_MS = {0: 61, 1: 42}


def at(iteration: int, ms: float) -> float:
    """The run time (ms) of ``ms`` into iteration ``iteration``."""
    return 1 + iteration * PERIOD_MS + ms


class HandRun:
    """A clean run's events, to be cut, extended and written."""

    def __init__(self, iterations: int = 2) -> None:
        self.iterations = iterations
        self.events = {rank: _clean_events(rank, iterations) for rank in (0, 1)}
        self.torn: dict[int, bytes] = {}

    def cut(self, rank: int, after_ms: float) -> HandRun:
        """The rank's log stops at ``after_ms``: nothing later was written."""
        self.events[rank] = [e for e in self.events[rank] if e["t"] <= _ns(after_ms)]
        return self

    def drop(self, rank: int, **match: Any) -> HandRun:
        """Remove the rank's events whose fields equal ``match`` (and their ends)."""
        gone = {
            e.get("id") for e in self.events[rank] if all(e.get(k) == v for k, v in match.items())
        }
        self.events[rank] = [
            e
            for e in self.events[rank]
            if not all(e.get(k) == v for k, v in match.items())
            and not (e["e"] in ("step_end", "p2p_done") and e["id"] in gone)
        ]
        return self

    def add(self, rank: int, ms: float, event: str, **fields: Any) -> HandRun:
        self.events[rank].append({"e": event, "t": _ns(ms), **fields})
        self.events[rank].sort(key=lambda e: e["t"])
        return self

    def open_steps(self, rank: int, *, with_iteration: bool = True) -> list[dict[str, Any]]:
        """The rank's steps begun and not ended, as `stall`/`exception` list them."""
        ended = {e["id"] for e in self.events[rank] if e["e"] == "step_end"}
        return [
            {"id": e["id"], "thread": e["th"], "pos": e["pos"], "step": e["step"]}
            | ({"it": e["it"]} if with_iteration else {})
            for e in self.events[rank]
            if e["e"] == "step_begin" and e["id"] not in ended
        ]

    def inflight(self, rank: int) -> list[dict[str, Any]]:
        done = {e["id"] for e in self.events[rank] if e["e"] == "p2p_done"}
        return [e for e in self.events[rank] if e["e"] == "p2p_post" and e["id"] not in done]

    def stall(
        self, rank: int, ms: float, *, abort_ms: float | None = None, **extra: Any
    ) -> HandRun:
        """The rank's watchdog records a stall at ``ms`` (and ends the run at ``abort_ms``)."""
        self.add(
            rank,
            ms,
            "stall",
            idle_s=1.0,
            stacks={"main": ["train.py:1 in main: step()"]},
            open_steps=self.open_steps(rank),
            inflight=self.inflight(rank),
            **extra,
        )
        if abort_ms is not None:
            waiting = {"waiting_in": extra["waiting_in"]} if "waiting_in" in extra else {}
            self.add(
                rank, abort_ms, "abort", idle_s=2.0, message="watchdog: no progress", **waiting
            )
        return self

    def raises(self, rank: int, ms: float, message: str) -> HandRun:
        """The rank records an exception at ``ms`` (its log then ends)."""
        return self.add(
            rank,
            ms,
            "exception",
            type="RuntimeError",
            message=message,
            traceback=f'Traceback (most recent call last):\n  File "train.py", line 1\n{message}\n',
            open_steps=self.open_steps(rank),
        )

    def tear(self, rank: int, fragment: bytes = b'{"e":"run_end","t":18') -> HandRun:
        """The rank's last line is torn: ``fragment`` without a newline ends the file."""
        self.torn[rank] = fragment
        return self

    def write(self, path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        (path / "meta.json").write_text(json.dumps(_meta()))
        for rank, events in self.events.items():
            lines = [json.dumps(_header(rank))] + [json.dumps(e) for e in events]
            data = ("\n".join(lines) + "\n").encode() + self.torn.get(rank, b"")
            (path / f"rank-{rank:05d}.ndjson").write_bytes(data)
        return path


def _ns(ms: float) -> int:
    return T0 + int(ms * MS)


def _meta() -> dict[str, Any]:
    return {
        "format": "pipetrace-run",
        "schema_version": 1,
        "pipetrace_version": "0.1.0",
        "framework": "handwritten",
        "framework_version": "0",
        "python_version": "3.11.7",
        "world_size": 2,
        "created": T0,
        "schedule": {"name": "handwritten", "params": {}},
        "num_microbatches": 1,
        "placement": [0, 1],
        "plan": PLAN,
        "hosts": ["host"],
        "config": CONFIG,
    }


def _header(rank: int) -> dict[str, Any]:
    return {
        "format": "pipetrace-events",
        "schema_version": 1,
        "rank": rank,
        "world_size": 2,
        "pid": 1000 + rank,
        "host": "host",
        "pipetrace_version": "0.1.0",
        "framework": "handwritten",
        "framework_version": "0",
        "record_mode": "steps",
        "t0": T0,
    }


def _clock(ms: float, phase: str) -> dict[str, Any]:
    return {
        "e": "clock",
        "t": _ns(ms),
        "phase": phase,
        "offset_ns": 0,
        "uncertainty_ns": 1000,
        "reference_rank": 0,
    }


def _clean_events(rank: int, iterations: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"e": "run_start", "t": _ns(0), "config": CONFIG, "plan": PLAN[rank], "stages": [rank]},
        _clock(0.5, "start"),
    ]
    ids = iter(range(1, 10**6))
    peer = 1 - rank
    for it in range(iterations):
        events.append({"e": "iter_begin", "t": _ns(at(it, 0)), "it": it})
        for pos, (step, begin, end, op, post, done) in enumerate(_TIMING[rank]):
            sid = next(ids)
            events.append(
                {
                    "e": "step_begin",
                    "t": _ns(at(it, begin)),
                    "id": sid,
                    "it": it,
                    "pos": pos,
                    "step": step,
                    "th": "main",
                }
            )
            if op is not None:
                pid = next(ids)
                events.append(
                    {
                        "e": "p2p_post",
                        "t": _ns(at(it, post)),
                        "id": pid,
                        "it": it,
                        "op": op,
                        "step": step,
                        "peer": peer,
                        "ch": "F" if "_F" in step else "B",
                        "seq": 0,
                        "bytes": 64,
                        "shape": [4, 4],
                        "dtype": "float32",
                    }
                )
                events.append({"e": "p2p_done", "t": _ns(at(it, done)), "id": pid})
            events.append({"e": "step_end", "t": _ns(at(it, end)), "id": sid})
        loss = 0.5 if rank == 1 else None
        events.append(
            {"e": "iter_end", "t": _ns(at(it, _ITER_END_MS[rank])), "it": it, "loss": loss}
        )
    last = at(iterations, 0)
    events += [_clock(last, "end"), {"e": "run_end", "t": _ns(last + 1)}]
    return sorted(events, key=lambda e: e["t"])
