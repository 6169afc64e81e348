"""Parsing worker processes that never outlive the command that started them.

`load.load_run` parses rank logs in a process pool. Two things must hold whatever happens to
the parent (`analyze`, `export`, `tui`, `diff` all load through it):

- the pool is never bigger than the work and the machine: one worker per log at most, and
  no more than the CPUs this process may run on (a ``--workers 99999`` would otherwise
  start thousands of processes);
- a worker exits when its parent dies (SIGKILL, the OOM killer, a ``timeout``) and when the
  parent is interrupted (SIGINT, SIGTERM): an orphaned worker would keep parsing, re-parented
  to init, forever.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

_PR_SET_PDEATHSIG = 1
"""prctl(2): the signal the kernel sends this process when its parent thread exits."""
_POLL_S = 0.5
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
"""mallopt(3) parameters (glibc's malloc.h)."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under taskset or a cgroup)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def worker_count(requested: int, logs: int) -> int:
    """The pool size for ``requested`` workers and ``logs`` files: never more than there are
    logs to parse or CPUs to parse them on (0 stays 0: parse in this process)."""
    return max(0, min(requested, logs, usable_cpus()))


def start_worker(parent_pid: int) -> None:
    """Pool initializer: `exit_with_parent`, and `keep_freed_memory`."""
    exit_with_parent(parent_pid)
    keep_freed_memory()


def keep_freed_memory() -> None:
    """Keep memory freed by this process for its next allocations instead of handing it
    back to the system at once: a parser allocates and frees megabytes per log, and glibc's
    defaults gave every new allocation fresh pages, whose faults cost a third of the parse
    (measured: 1.7 ms of system time per 10k-event log, 0.1 ms with these settings).
    glibc only; elsewhere nothing changes."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_TRIM_THRESHOLD, 256 << 20)  # free heap top kept up to this size
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # blocks below this come from the heap, reused


def exit_with_parent(parent_pid: int) -> None:
    """End this worker when ``parent_pid`` goes away.

    On Linux the kernel does it (``PR_SET_PDEATHSIG``, SIGKILL); elsewhere a daemon thread
    polls the parent. The parent may already be gone by the time this runs: checked last.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it stops us below
    if not _kernel_kills_orphan():
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if os.getppid() != parent_pid:
        os._exit(1)


def _kernel_kills_orphan() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_POLL_S)
    os._exit(1)


def stop_workers(pool: ProcessPoolExecutor) -> None:
    """End the pool's workers now (the load was interrupted or failed), not after the logs
    they are parsing: `ProcessPoolExecutor.shutdown` would wait for those."""
    terminate = getattr(pool, "terminate_workers", None)  # Python 3.14+
    if terminate is not None:
        terminate()
        return
    # Before 3.14 the executor has no public way to stop running workers.
    for process in list((pool._processes or {}).values()):
        process.terminate()
    pool.shutdown(wait=True, cancel_futures=True)
