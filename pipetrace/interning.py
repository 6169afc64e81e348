"""Interning: small integer codes for repeated values (step texts, thread names, shapes)."""

from __future__ import annotations

from collections.abc import Hashable


class Interner:
    """Codes for values: ``values[code]`` is the value; a new value gets the next code.

    ``values`` is the caller's list, kept up to date in place (and may start non-empty).
    """

    def __init__(self, values: list) -> None:
        self.values = values
        self.codes: dict[Hashable, int] = {v: i for i, v in enumerate(values)}

    def get(self, value: Hashable) -> int:
        code = self.codes.get(value)
        if code is None:
            code = self.codes[value] = len(self.values)
            self.values.append(value)
        return code

    def truncate(self, count: int) -> None:
        """Forget every value after the first ``count``."""
        for value in self.values[count:]:
            del self.codes[value]
        del self.values[count:]
