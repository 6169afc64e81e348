"""Recording settings: defaults and checks declared once, read from Python or the environment,
each error naming the setting the way the user gave it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from pipetrace.errors import PipetraceError
from pipetrace.recorder.recorder import Recorder
from pipetrace.recorder.setup import RecordSettings
from pipetrace.settings import SettingsError, settings_fields

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_variable_is_read_into_its_field():
    settings = RecordSettings.from_env(
        {
            "PIPETRACE_DIR": "run",
            "PIPETRACE_RECORD": "full",
            "PIPETRACE_STALL_TIMEOUT": "5",
            "PIPETRACE_ABORT_TIMEOUT": "0",
            "PIPETRACE_FLUSH_INTERVAL": "0.5",
            "PIPETRACE_BUFFER_EVENTS": "2e3",
        }
    )
    assert settings == RecordSettings(
        run_dir="run",
        mode="full",
        stall_timeout=5,
        abort_timeout=0,
        flush_interval=0.5,
        buffer_events=2000,
    )
    assert settings.run_dir == Path("run") and settings.enabled


def test_unset_and_empty_variables_keep_the_defaults():
    assert RecordSettings.from_env({}) == RecordSettings()
    empty = {declared.env: "" for declared in settings_fields(RecordSettings).values()}
    assert RecordSettings.from_env(empty) == RecordSettings()
    assert not RecordSettings().enabled
    assert not RecordSettings(run_dir="run", mode="off").enabled


@pytest.mark.parametrize(
    "variable, value, message",
    [
        (
            "PIPETRACE_STALL_TIMEOUT",
            "soon",
            "PIPETRACE_STALL_TIMEOUT='soon' is not a number of seconds",
        ),
        ("PIPETRACE_BUFFER_EVENTS", "1.5", "PIPETRACE_BUFFER_EVENTS='1.5' is not a whole number"),
        ("PIPETRACE_BUFFER_EVENTS", "0", "PIPETRACE_BUFFER_EVENTS must be >= 1, got 0"),
        ("PIPETRACE_FLUSH_INTERVAL", "0", "PIPETRACE_FLUSH_INTERVAL must be > 0 seconds, got 0"),
        ("PIPETRACE_RECORD", "all", "PIPETRACE_RECORD must be one of off, steps, full; got 'all'"),
    ],
)
def test_a_bad_variable_is_named_in_the_error(variable, value, message):
    with pytest.raises(PipetraceError) as info:
        RecordSettings.from_env({variable: value})
    assert str(info.value) == message and info.value.exit_code == 2


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"mode": "all"}, "mode must be one of off, steps, full; got 'all'"),
        ({"abort_timeout": -1}, "abort_timeout must be >= 0 seconds (0 turns it off), got -1"),
        ({"buffer_events": 0}, "buffer_events must be >= 1, got 0"),
    ],
)
def test_a_bad_value_from_python_names_the_field(fields, message):
    with pytest.raises(SettingsError) as info:
        RecordSettings(**fields)
    assert str(info.value) == message


def test_a_recorder_refuses_settings_that_record_nothing(tmp_path):
    with pytest.raises(ValueError, match="run_dir"):
        Recorder(RecordSettings())
    with pytest.raises(ValueError, match="'off'"):
        Recorder(RecordSettings(run_dir=tmp_path, mode="off"))


def shown(default: object) -> str:
    """A default as the docs write it: 30.0 as 30, None as unset."""
    if default is None:
        return "unset"
    return default if isinstance(default, str) else f"{default:g}"


def test_the_variables_table_in_the_docs_matches_the_settings():
    text = (DOCS / "recording.md").read_text()
    rows = re.findall(r"^\| `(PIPETRACE_\w+)` \| `?(\w[\w.]*)", text, re.M)
    fields = {declared.env: name for name, declared in settings_fields(RecordSettings).items()}
    assert dict(rows).keys() == fields.keys()
    defaults = {f.name: f.default for f in dataclasses.fields(RecordSettings)}
    assert dict(rows) == {variable: shown(defaults[name]) for variable, name in fields.items()}
