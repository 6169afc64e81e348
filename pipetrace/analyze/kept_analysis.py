"""A cached run's `Analysis` (everything but the run), kept beside its run entry so that a
`tui`, `export` or `diff` of an unchanged run does not run the analyzers again.

``<meta.json's dir>/.pipetrace-cache/run.analysis`` (``run-<hash>.analysis`` for a
selection) is a `cache.write_entry` file: a JSON index (the run entry's key and a MAC) and
one byte column, the pickle of ``(findings, metrics, summary, replicas)``. Pickle, because
these are a few dozen kinds of nested dataclasses, dicts keyed by tuples and numpy arrays:
at 10 M events it writes and reads in ~0.02 s (docs/performance.md). Two things stay out:

- the run itself and its plan (`Run`, `RankTimeline`, `Plan`, `Step`): the pickle would drag
  the model in, which the run entry already holds; a part that reaches one is not kept;
- the ideal timeline's simulation (`IdealTimeline.simulation`, 30 MB of per-step Python
  lists, 2 s to unpickle): it is re-simulated from the plan and the kept metrics when first
  read (0.1 s; only the TUI's planned lanes read it).

Unpickling runs code named in the file, and a run directory travels (copied back from
nodes, shared as a tarball) with its ``.pipetrace-cache``. So an entry is read only when its
MAC, keyed with this user's secret (`_secret`: 32 random bytes in the user's cache
directory, mode 0600), matches its bytes: only this user's pipetrace can have written it. A
foreign, damaged or cut entry is ignored (the analyzers run and it is rewritten).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import os
import pickle
import secrets
import stat
from functools import cache as memoize
from pathlib import Path
from typing import Any

import numpy as np

from pipetrace.analyze import cache as column_cache
from pipetrace.analyze.model import RankTimeline, Run
from pipetrace.analyze.reader import TraceFormatError, open_regular
from pipetrace.schedule.ir import Plan, Step
from pipetrace.schedule.simulate import SimResult

KEPT_VERSION = 1
_SECRET_BYTES = 32
_LOG = logging.getLogger(__name__)
Parts = tuple[Any, ...]
"""``(findings, metrics, summary, replicas)`` of an `Analysis`, its summary's simulation
left out."""


class _Pickler(pickle.Pickler):
    """Leaves the simulation out (None in its place) and refuses the run model.
    `reducer_override` is not called for plain ints, floats, strs, lists, dicts and tuples,
    so the check costs nothing per number."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, SimResult):
            return type(None), ()
        if isinstance(obj, (Run, RankTimeline, Plan, Step)):
            raise pickle.PicklingError(f"the analysis references the run ({type(obj).__name__})")
        return NotImplemented


def write(path: Path, key: str, parts: Parts) -> None:
    """Keep ``parts`` under the run entry's ``key``; skipped (a debug note) when they
    reference the run or there is no secret to sign them with."""
    secret = _secret()
    if secret is None:
        return
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, protocol=5).dump(parts)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        _LOG.debug("%s: analysis not kept (%s)", path, exc)
        return
    data = np.frombuffer(buffer.getbuffer(), np.uint8)
    index = {"key": key, "version": KEPT_VERSION, "mac": _mac(secret, key, data)}
    column_cache.write_entry(path, index, {"pickle": data})


def read(path: Path, key: str) -> Parts | None:
    """The parts kept under ``key``, or None: none, stale, damaged or not signed by us."""
    secret = _secret()
    if secret is None:
        return None
    try:
        found = column_cache.read_entry(
            path, lambda index: index["key"] == key and index["version"] == KEPT_VERSION
        )
        if found is None:
            return None
        index, data = found
        pickled = column_cache.entry_arrays(index, data, {"pickle": np.uint8})["pickle"]
        if not hmac.compare_digest(str(index["mac"]), _mac(secret, key, pickled)):
            raise ValueError("not signed by this user's pipetrace")
        parts = pickle.loads(pickled)
        if type(parts) is not tuple or len(parts) != 4:
            raise ValueError("not an analysis")
        return parts
    except (FileNotFoundError, TraceFormatError):
        return None
    except (OSError, ValueError, KeyError, TypeError, pickle.UnpicklingError) as exc:
        _LOG.debug("%s: kept analysis ignored (%s)", path, exc)
        return None


def _mac(secret: bytes, key: str, data: np.ndarray) -> str:
    """The entry's MAC: its key and its bytes, keyed with this user's secret."""
    digest = hashlib.blake2b(key.encode(), key=secret, digest_size=32)
    digest.update(data.data)
    return digest.hexdigest()


def secret_path() -> Path:
    """Where this user's secret lives: ``$XDG_CACHE_HOME/pipetrace`` (``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pipetrace" / "analysis.key"


def _secret() -> bytes | None:
    """This user's secret (`secret_path`, read once per process)."""
    return _secret_at(secret_path())


@memoize
def _secret_at(path: Path) -> bytes | None:
    """The secret at ``path``, made on first use; None (nothing kept) when it cannot be
    made, or the file there is not a regular file of this user that only they can read."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _create_secret(path)
        with open_regular(path) as handle:
            info = os.fstat(handle.fileno())
            value = handle.read(_SECRET_BYTES + 1)
    except (OSError, TraceFormatError) as exc:
        _LOG.debug("%s: no secret, analyses not kept (%s)", path, exc)
        return None
    private = info.st_uid == os.getuid() and not info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
    return value if private and len(value) == _SECRET_BYTES else None


def _create_secret(path: Path) -> None:
    """Write a new secret unless there is one (a link there is never followed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as handle:
        handle.write(secrets.token_bytes(_SECRET_BYTES))
