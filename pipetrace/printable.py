"""Text from a trace made safe to print to a terminal.

A trace may come from someone else (docs/security.md): an exception message, a step text or
a thread name can hold escape sequences that set a terminal's title or clipboard (OSC), or
move its cursor. Every line the CLI prints shows such characters as ``\\xNN`` escapes instead.
"""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, C1 controls, and the bidirectional overrides that
# show text in another order than it is stored.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on written as an escape."""
    return _UNSAFE.sub(_escape, text)


def stripped(text: str) -> str:
    """``text`` without those characters: for a screen laid out by cell widths, where an
    escape's four cells would not fit (a terminal shows a control character in none)."""
    return _UNSAFE.sub("", text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
