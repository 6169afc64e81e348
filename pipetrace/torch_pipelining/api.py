"""The public API: record an existing torch.distributed.pipelining schedule.

::

    from pipetrace.torch_pipelining import record

    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=loss_fn)
    with record(schedule, "run/"):          # or record(schedule) with PIPETRACE_DIR=run/
        for inputs, targets in data:
            schedule.step(inputs, target=targets)

``record`` patches nothing when recording is off (no ``run_dir`` and no ``PIPETRACE_DIR``), so
the schedule runs torch's own code at torch's own speed. It never stops training: with a bad
``PIPETRACE_*`` variable, on a torch release it was not verified against, on a forward-only
schedule or one it cannot read, or if setting up fails, it warns once and the job runs
unrecorded. ``schedule.eval(...)`` calls run torch's own code, unrecorded (`Instrumentation`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from types import TracebackType
from typing import Any

from pipetrace.recorder.hooks import RecorderHooks
from pipetrace.recorder.setup import RecordSettings, torch_recorder
from pipetrace.torch_pipelining.instrument import (
    Instrumentation,
    device_of,
    forward_only,
    place_of,
    rank_and_size,
)
from pipetrace.torch_pipelining.plan import plan_of
from pipetrace.torch_pipelining.version import unsupported_reason


class Recording:
    """A schedule being recorded (or not: `active` says). Close it, or use it as a context
    manager, after the last ``step``: a clean close records the end-of-run clock exchange,
    a collective every rank must reach."""

    def __init__(
        self,
        instrumentation: Instrumentation | None = None,
        recorder: RecorderHooks | None = None,
    ) -> None:
        self._instrumentation = instrumentation
        self._recorder = recorder

    @property
    def active(self) -> bool:
        return self._instrumentation is not None

    def suspend(self) -> None:
        """Run torch's own code until `resume` (the recorder stays open; iterations run
        meanwhile are not in the log). For measuring the recording's cost, or recording
        only some iterations."""
        if self._instrumentation is not None:
            self._instrumentation.undo()

    def resume(self) -> None:
        if self._instrumentation is not None and not self._instrumentation.installed:
            self._instrumentation.install()

    def close(self, *, clean: bool = True) -> None:
        """Restore torch's code and end the run (``clean=False`` after a failure: the rank's
        log then has no ``run_end``, which is how the analyzers know it failed)."""
        instrumentation, self._instrumentation = self._instrumentation, None
        if instrumentation is None:
            return
        instrumentation.undo()
        recorder = self._recorder
        if clean:
            recorder.end_run()
        elif hasattr(recorder, "close"):
            recorder.close()

    def __enter__(self) -> Recording:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """An exception raised in the block outside ``step`` (a data loader, the user's own
        collectives) is recorded as a step's is: without it the rank's log would just stop,
        read as a process killed from outside. ``sys.exit(0)`` (or with no code) in the
        block ends the run cleanly, as leaving it does."""
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            exc = None
        instrumentation = self._instrumentation
        if exc is not None and instrumentation is not None and exc is not instrumentation.failure:
            self._recorder.exception(exc)
        self.close(clean=exc is None)


def record(
    schedule: Any,
    run_dir: str | os.PathLike[str] | None = None,
    *,
    settings: RecordSettings | None = None,
    config: dict[str, Any] | None = None,
) -> Recording:
    """Start recording ``schedule`` on this rank; every rank of the pipeline must call it.

    ``run_dir`` overrides ``PIPETRACE_DIR``; the other ``PIPETRACE_*`` variables (or
    ``settings``) tune the recorder as for pipetrace's own runtime. ``config`` is added to
    the run configuration in meta.json (its ``runtime``, ``schedule_class`` and ``record``
    keys are the adapter's).

    Nothing here raises: a bad variable, an unverified torch, a forward-only or unreadable
    schedule, or a failing set-up is one `RuntimeWarning`, and the job runs unrecorded.
    """
    try:
        settings = _settings_of(settings, run_dir)
    except Exception as exc:  # a bad PIPETRACE_* variable must not stop the training
        return _unrecorded(f"pipetrace could not read its settings ({exc})")
    if not settings.enabled:
        return Recording()
    import torch

    problem = unsupported_reason(torch.__version__)
    if problem is not None:
        warnings.warn(problem, RuntimeWarning, stacklevel=2)
        return Recording()
    if forward_only(schedule):
        return _unrecorded(
            f"pipetrace records training steps: {type(schedule).__name__} has no loss_fn "
            "(forward-only)"
        )
    try:
        return _start(schedule, settings, config)
    except Exception as exc:
        return _unrecorded(
            f"pipetrace could not record {type(schedule).__name__} ({type(exc).__name__}: {exc})"
        )


def _settings_of(
    settings: RecordSettings | None, run_dir: str | os.PathLike[str] | None
) -> RecordSettings:
    """The settings given, else the environment's; ``run_dir`` over their directory."""
    settings = settings if settings is not None else RecordSettings.from_env()
    if run_dir is not None:
        settings = dataclasses.replace(settings, run_dir=os.fspath(run_dir))
    return settings


def _unrecorded(problem: str) -> Recording:
    """The one warning of a job that runs unrecorded (pointing at the ``record`` call)."""
    warnings.warn(f"{problem}; training continues unrecorded", RuntimeWarning, stacklevel=3)
    return Recording()


def _start(schedule: Any, settings: RecordSettings, config: dict[str, Any] | None) -> Recording:
    """Install the patches and begin the run; on failure, take back what was set up (the
    patches, and the recorder's writer and watchdog threads) and raise."""
    instrumentation = recorder = None
    try:
        plan = plan_of(schedule)
        rank, world_size = rank_and_size(schedule)
        recorder = torch_recorder(settings, device=device_of(schedule))
        instrumentation = Instrumentation(schedule, plan, rank, recorder)
        instrumentation.install()
        run_config = {
            **(config or {}),
            "runtime": "torch.distributed.pipelining",
            "schedule_class": type(schedule).__name__,
            "record": settings.mode,
        }
        recorder.begin_run(
            rank=rank, world_size=world_size, plan=plan, config=run_config, place=place_of(schedule)
        )
    except Exception:
        if instrumentation is not None:
            instrumentation.undo()
        if recorder is not None and hasattr(recorder, "close"):
            with contextlib.suppress(Exception):
                recorder.close()
        raise
    return Recording(instrumentation, recorder)
