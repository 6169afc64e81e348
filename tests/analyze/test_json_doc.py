"""`pipetrace analyze --json` and docs/analyze.md cannot drift apart: every field the JSON
skeleton names is in the document and every field of the document is named (as
docs/trace-format.md is checked against the recorder), and each finding's `details` keys are
the ones its kind's row of the findings table lists. The docs quote one exposed-comm threshold."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.findings import KINDS
from pipetrace.analyze.load import load_run
from pipetrace.analyze.performance import EXPOSED_MIN_FRACTION

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "analyze.md"
SAMPLES = ROOT / "sample_traces"
_TOKEN = re.compile(r'"[^"]*"|\.\.\.|[{}\[\]|:,]|[\w.]+')


@dataclass
class Obj:
    """An object of the skeleton: its fields (None: not described further); ``open`` when it
    has alternatives (`{...} | {...}`), of which a document holds one."""

    fields: dict[str, object] = field(default_factory=dict)
    open: bool = False


@dataclass
class Array:
    item: object


class _Skeleton:
    """A parser of the JSON skeleton in docs/analyze.md (keys, nesting, `|` alternatives)."""

    def __init__(self, text: str) -> None:
        self.tokens = _TOKEN.findall(text)
        self.i = 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        self.i += 1
        return self.tokens[self.i - 1]

    def value(self) -> object:
        token = self.take()
        if token == "{":
            found: object = self.obj()
        elif token == "[":
            found = Array(None if self.peek() in ("]", "...") else self.value())
            while self.take() != "]":
                pass
        else:
            found = None  # a literal, a type name or "..."
        while self.peek() == "|":
            self.take()
            other = self.value()
            if isinstance(found, Obj) and isinstance(other, Obj):
                found = Obj({**found.fields, **other.fields}, open=True)
            elif found is None:
                found = other
        return found

    def obj(self) -> Obj:
        out = Obj()
        while (token := self.take()) != "}":
            if token == ",":
                continue
            name = token.strip('"')
            out.fields[name] = None
            if self.peek() == ":":
                self.take()
                out.fields[name] = self.value()
        return out


def skeleton() -> Obj:
    text = DOC.read_text()
    block = text.split("## JSON (`--json`)", 1)[1].split("```", 2)[1]
    parsed = _Skeleton(block).value()
    assert isinstance(parsed, Obj)
    return parsed


def documented_details() -> dict[str, set[str]]:
    """{kind: the details keys its row of the findings table names}."""
    found = {}
    for line in DOC.read_text().splitlines():
        cells = line.split(" | ")
        kinds = re.findall(r"`(\w+)`", cells[0]) if len(cells) > 3 else []
        if kinds and set(kinds) <= set(KINDS):
            keys = set(re.findall(r"`(\w+)`", cells[-1]))
            for kind in kinds:
                found[kind] = keys
    return found


def mismatches(doc: object, value: object, where: str = "") -> list[str]:
    """Fields the document has and the skeleton does not name, or the other way round."""
    if doc is None or value is None:
        return []
    if isinstance(doc, Array):
        assert isinstance(value, list), where
        return [m for item in value for m in mismatches(doc.item, item, where + "[]")]
    assert isinstance(doc, Obj) and isinstance(value, dict), where
    out = [f"{where}.{k}: not documented" for k in value if k not in doc.fields]
    if not doc.open:
        out += [f"{where}.{k}: documented, missing" for k in doc.fields if k not in value]
    for k, sub in doc.fields.items():
        if k in value:
            out += mismatches(sub, value[k], f"{where}.{k}")
    return out


SAMPLE_NAMES = sorted(p.name for p in SAMPLES.iterdir() if (p / "meta.json").is_file())


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_json_fields_are_the_documented_ones(name):
    document = analyze(load_run(SAMPLES / name, workers=0)).to_json()
    assert mismatches(skeleton(), document) == []
    assert document["run"]["p2p"] in ("plain", "overlap")


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_finding_details_are_the_documented_ones(name):
    documented = documented_details()
    assert set(documented) == set(KINDS)
    for f in analyze(load_run(SAMPLES / name, workers=0)).to_json()["findings"]:
        assert set(f["details"]) <= documented[f["kind"]], f["kind"]
        if f["kind"] == "rank_stalled":
            assert {"chain", "terminal_rank", "terminal_state"} <= set(f["details"])
        if f["kind"] == "rank_failed":
            assert {"last_step", "ending"} <= set(f["details"])


def test_both_docs_quote_the_one_exposed_comm_threshold():
    quoted = f"{EXPOSED_MIN_FRACTION:.0%}".replace("%", " %")
    analyze_doc = DOC.read_text()
    diagnosis_doc = (ROOT / "docs" / "diagnosis.md").read_text()
    (row,) = [line for line in analyze_doc.splitlines() if line.startswith("| `exposed_comm`")]
    assert f"≥ {quoted}" in row and "EXPOSED_MIN_FRACTION" in row
    section = diagnosis_doc.split("## exposed_comm", 1)[1]
    assert quoted in section and "EXPOSED_MIN_FRACTION" in section
    assert "half the iteration" not in diagnosis_doc + analyze_doc
