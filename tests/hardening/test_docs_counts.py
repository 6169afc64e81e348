"""The docs count the built-in schedules as the code has them (issue 18: a page said seven
when there were six)."""

from __future__ import annotations

import re
from pathlib import Path

from pipetrace.schedule.builders import SCHEDULE_NAMES

ROOT = Path(__file__).resolve().parents[2]
WORDS = [
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
]
COUNTED = re.compile(r"\b(\w+)\s+built-in\s+schedules", re.IGNORECASE)


def test_every_count_of_the_built_in_schedules_is_right():
    counts = [
        (page.name, word)
        for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for word in COUNTED.findall(page.read_text())
        if word.lower() in WORDS or word.isdigit()
    ]
    assert counts  # docs/mindspore.md counts them
    expected = {WORDS[len(SCHEDULE_NAMES) - 1], str(len(SCHEDULE_NAMES))}
    assert [c for c in counts if c[1].lower() not in expected] == []
