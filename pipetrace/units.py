"""Compact time and size texts for people: the analyzers' findings and the TUI (no UI imports)."""

from __future__ import annotations

import math

_UNITS = ((1e9, "s"), (1e6, "ms"), (1e3, "µs"), (1.0, "ns"))


def duration(ns: float, digits: int = 3) -> str:
    """``1.23 ms``, ``45.6 µs``, ``2.00 s``: about ``digits`` significant digits."""
    if ns is None or math.isnan(ns):
        return "-"
    if math.isinf(ns):
        return "∞"
    if ns == 0:
        return "0 ns"
    sign = "-" if ns < 0 else ""
    ns = abs(ns)
    for scale, unit in _UNITS:
        if ns >= scale or unit == "ns":
            value = ns / scale
            decimals = max(
                digits - 1 - int(math.floor(math.log10(value))) if value >= 1 else digits - 1, 0
            )
            return f"{sign}{value:.{decimals}f} {unit}"
    return f"{sign}{ns:.0f} ns"  # pragma: no cover


def tick_step(span_ns: float, max_ticks: int) -> float:
    """A round tick spacing (1, 2 or 5 times a power of ten ns) giving at most max_ticks."""
    raw = span_ns / max(max_ticks, 1)
    if raw <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if mult * power >= raw:
            return float(mult * power)
    return float(10 * power)  # pragma: no cover


def tick_label(t_ns: float, step_ns: float, largest_ns: float) -> str:
    """A tick's time in the unit that suits ``largest_ns`` (the largest time shown), with just
    enough decimals to tell ticks ``step_ns`` apart: ``1.5ms``, ``12s``, ``250µs``."""
    for scale, unit in _UNITS:
        if abs(largest_ns) >= scale or unit == "ns":
            ratio = step_ns / scale
            decimals = 0 if ratio >= 1 else min(int(math.ceil(-math.log10(ratio) - 1e-9)), 6)
            return f"{t_ns / scale:.{decimals}f}{unit}"
    return f"{t_ns:.0f}ns"  # pragma: no cover


def size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"  # pragma: no cover
