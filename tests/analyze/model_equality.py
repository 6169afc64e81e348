"""Field-by-field equality of run models (and of anything built of dataclasses, lists, dicts
and numpy arrays), for tests that build one model two ways."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

import numpy as np


def assert_same(a: Any, b: Any, where: str = "run") -> None:
    """Field by field, arrays by dtype, shape and values (private fields are caches, and
    fields out of the comparison, like `Run.entry`, not part of the model)."""
    if is_dataclass(a):
        assert type(a) is type(b), where
        for f in fields(a):
            if f.compare and not f.name.startswith("_"):
                assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), where
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where
