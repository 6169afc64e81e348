"""The run directory format: names, versions and event types. Documented in docs/trace-format.md.

A run directory holds ``meta.json`` and one newline-delimited JSON event log per rank
(``rank-00000.ndjson``, ...). Each log starts with a header line; every later line is one
event with an ``e`` (event type) and a ``t`` (wall-clock time, integer nanoseconds since the
Unix epoch, taken from the rank's monotonic clock anchored once at start).

Bump ``SCHEMA_VERSION`` whenever a field changes meaning or a required field is added;
readers accept every version up to their own and refuse newer ones.
"""

from __future__ import annotations

from pathlib import Path

SCHEMA_VERSION = 1
META_FORMAT = "pipetrace-run"
LOG_FORMAT = "pipetrace-events"
META_FILE = "meta.json"
PROFILER_DIR = "profiler"

# Event types (the "e" field). Begin/end pairs carry the same "id".
RUN_START = "run_start"  # config and the rank's full plan
CLOCK = "clock"  # offset of this rank's clock to rank 0's, with its uncertainty
ITER_BEGIN = "iter_begin"
ITER_END = "iter_end"  # with the loss on the rank that holds the last stage
STEP_BEGIN = "step_begin"
STEP_END = "step_end"
P2P_POST = "p2p_post"  # isend/irecv issued
P2P_DONE = "p2p_done"  # its wait returned
STALL = "stall"  # watchdog: no progress for a while; every thread's stack, ops in flight
DUMP = "dump"  # the same content, on demand (SIGUSR1)
SIGNAL = "signal"  # a terminating signal was received
EXCEPTION = "exception"
ABORT = "abort"  # the watchdog ended the run
RUN_END = "run_end"  # a clean end

EVENT_TYPES = (
    RUN_START,
    CLOCK,
    ITER_BEGIN,
    ITER_END,
    STEP_BEGIN,
    STEP_END,
    P2P_POST,
    P2P_DONE,
    STALL,
    DUMP,
    SIGNAL,
    EXCEPTION,
    ABORT,
    RUN_END,
)


def rank_log_name(rank: int) -> str:
    return f"rank-{rank:05d}.ndjson"


def rank_log_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / rank_log_name(rank)
