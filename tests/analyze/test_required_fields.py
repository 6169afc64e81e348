"""The reader's checks are the declaration's: an event that lacks a required field, or holds a
value of another type, is counted as corrupt; the same event intact is used."""

from __future__ import annotations

import orjson
import pytest

from pipetrace.analyze.parse import parse_rank_file
from pipetrace.recorder import format as fmt

GOOD = {
    fmt.INT: 3,
    fmt.STR: "0F0",
    fmt.INTS: [2, 2],
    fmt.STRS: ["0F0"],
    fmt.FLOAT_OR_NULL: None,
    fmt.FLOAT: 0.5,
    fmt.OBJECT: {},
    fmt.OBJECTS: [],
    fmt.OP: "send",
}
WRONG = {fmt.INT: "3", fmt.STR: 3, fmt.INTS: [2.5], fmt.STRS: [0], fmt.OP: "broadcast"}
REQUIRED = [
    (name, f) for name, event in fmt.EVENTS.items() for f in event.required(fmt.SCHEMA_VERSION)
]


def example(name: str) -> dict:
    """A valid event of type ``name`` with every declared field."""
    fields = {f.name: GOOD[f.type] for f in fmt.EVENTS[name].fields}
    return {"e": name, "t": 1_000, **fields}


def write_log(path, events: list[dict]) -> None:
    header = {"format": fmt.LOG_FORMAT, "schema_version": fmt.SCHEMA_VERSION}
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in [header, *events]))


def test_every_event_with_all_its_fields_is_used(tmp_path):
    write_log(tmp_path / "log.ndjson", [example(name) for name in fmt.EVENT_TYPES])
    raw = parse_rank_file(tmp_path / "log.ndjson")
    assert raw.error is None and raw.problems.corrupt_lines == 0 and raw.unknown_events == 0
    assert len(raw.steps["begin"]) == 1 and len(raw.p2p["post"]) == 1
    assert raw.steps["end"][0] == raw.p2p["done"][0] == 1_000  # paired by id
    assert list(raw.iterations) == [3] and raw.run_start is not None


@pytest.mark.parametrize(("name", "field"), REQUIRED, ids=lambda x: getattr(x, "name", x))
@pytest.mark.parametrize("damage", ["missing", "wrong type"])
def test_an_event_without_a_usable_required_field_is_corrupt(tmp_path, name, field, damage):
    broken = example(name)
    if damage == "missing":
        del broken[field.name]
    else:
        broken[field.name] = WRONG[field.type]
    intact = [example(n) for n in fmt.EVENT_TYPES]
    write_log(tmp_path / "log.ndjson", [*intact[:3], broken, *intact[3:]])
    raw = parse_rank_file(tmp_path / "log.ndjson")
    assert raw.problems.corrupt_lines == 1
    assert len(raw.steps["begin"]) == 1 and len(raw.p2p["post"]) == 1
