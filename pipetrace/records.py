"""Dataclass records as JSON objects: every field by name, in declaration order.

Results (findings, metrics rows, critical-path segments) are dataclasses whose JSON form is
their fields; writing each ``to_json`` out key by key made near-identical copies that had to
be kept in step with the fields. Shallow on purpose: unlike `dataclasses.asdict` nothing is
deep-copied, which matters for runs with many findings.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any


def record_json(record: Any, **replaced: Any) -> dict[str, Any]:
    """The dataclass ``record``'s fields by name, with the ``replaced`` values instead
    (a nested record, a tuple written as a list, a value JSON cannot hold)."""
    out = {f.name: getattr(record, f.name) for f in fields(record)}
    out.update(replaced)
    return out


class JsonRecord:
    """Base of a dataclass whose JSON form is its fields as they are."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:
        return record_json(self)
