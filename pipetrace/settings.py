"""Settings declared once: a field's default, its check, and the names users give it.

A settings dataclass (`pipetrace.runtime.config.RunConfig`,
`pipetrace.recorder.setup.RecordSettings`) declares each field with a `Setting`, which holds
the field's default, the check every value must pass and the names the setting has outside
Python: a command-line flag, an environment variable. ``__post_init__`` calls
`check_settings`, so a value is checked once, wherever it came from (Python, the CLI, the
environment). The error names fields as Python does; `SettingsError.worded` names them as
the flag or variable the user actually typed, which is how the CLI and `read_environment`
report them. Pure Python: no click, no torch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any, Literal, TypeVar

from pipetrace.errors import PipetraceError

T = TypeVar("T")

Check = Callable[[Any], "str | None"]
"""What is wrong with a value, completing "NAME ..." (e.g. "must be >= 1, got 0"), or None."""

Outside = Literal["flag", "env"]
"""Which outside name `SettingsError.worded` uses."""

_METADATA_KEY = "pipetrace.setting"


@dataclass(frozen=True)
class Setting:
    """One setting. Shared by every dataclass that has it, so its default is written once."""

    default: Any = MISSING
    """MISSING: the field is required."""
    check: Check | None = None
    """None: any value of the field's type."""
    choices: tuple[str, ...] | None = None
    """The only values allowed (checked like ``check``; the CLI offers them as a choice)."""
    flag: str | None = None
    """The `pipetrace run` flag that sets it, e.g. "--stall-timeout"."""
    env: str | None = None
    """The environment variable `read_environment` takes it from, e.g. "PIPETRACE_DIR"."""
    parse: Callable[[str], Any] = str
    """Turns the variable's text into a value; raises ValueError saying what it should be."""

    def field(self) -> Any:
        """The dataclass field for this setting (its default, with the setting as metadata)."""
        return dataclasses.field(default=self.default, metadata={_METADATA_KEY: self})

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` (see `Check`); the one place a value is judged."""
        if self.choices is not None and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}; got {value!r}"
        return self.check(value) if self.check is not None else None


def setting(default: Any = MISSING, check: Check | None = None, **names: Any) -> Any:
    """A field for a setting only one dataclass has (see `Setting` for ``names``)."""
    return Setting(default, check, **names).field()


def setting_of(field: dataclasses.Field) -> Setting | None:
    """The `Setting` a dataclass field was declared with, or None for a plain field."""
    return field.metadata.get(_METADATA_KEY)


def settings_fields(cls: type) -> dict[str, Setting]:
    """Field name -> setting, for every field of ``cls`` declared with a `Setting`."""
    pairs = ((field.name, setting_of(field)) for field in dataclasses.fields(cls))
    return {name: found for name, found in pairs if found is not None}


class SettingsError(PipetraceError):
    """A setting's value is not allowed (exit code 2).

    ``template`` names fields as ``{field_name}`` placeholders, so that one message reads
    right from Python (``str(error)``: "ranks must be >= 1, got 0") and, reworded by
    `worded`, on the command line ("--ranks must be >= 1, got 0").
    """

    def __init__(self, settings: type, template: str) -> None:
        self.settings = settings
        self.template = template
        super().__init__(self.worded(None))

    def worded(self, outside: Outside | None) -> str:
        """The message naming each field by its ``outside`` name ("flag" or "env") where it
        has one, by its Python name otherwise."""
        names = {}
        for field in dataclasses.fields(self.settings):
            found = setting_of(field)
            named = getattr(found, outside) if found is not None and outside else None
            names[field.name] = named or field.name
        return self.template.format_map(names)


def check_settings(settings: Any) -> None:
    """Raise `SettingsError` for the first field (in declaration order) whose value fails
    its setting's check; call it first in ``__post_init__``."""
    for name, declared in settings_fields(type(settings)).items():
        problem = declared.problem(getattr(settings, name))
        if problem is not None:
            escaped = problem.replace("{", "{{").replace("}", "}}")
            raise SettingsError(type(settings), f"{{{name}}} {escaped}")


def read_environment(cls: type[T], environ: Mapping[str, str] = os.environ) -> T:
    """``cls`` from the environment variables its settings name; unset or empty variables
    leave the default. Errors name the variable."""
    values = {}
    for name, declared in settings_fields(cls).items():
        raw = environ.get(declared.env, "") if declared.env else ""
        if not raw:
            continue
        try:
            values[name] = declared.parse(raw)
        except ValueError as exc:
            raise PipetraceError(f"{declared.env}={raw!r} {exc}") from None
    try:
        return cls(**values)
    except SettingsError as exc:
        raise PipetraceError(exc.worded("env")) from None


# -- checks and parsers -------------------------------------------------------------------


def at_least(low: int) -> Check:
    """A whole number no smaller than ``low``."""
    return lambda value: None if value >= low else f"must be >= {low}, got {value}"


def positive_seconds(value: float) -> str | None:
    return None if value > 0 else f"must be > 0 seconds, got {value:g}"


def seconds_or_off(value: float) -> str | None:
    return None if value >= 0 else f"must be >= 0 seconds (0 turns it off), got {value:g}"


def seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("is not a number of seconds") from None


def whole_number(text: str) -> int:
    """An integer, also written as a float ("2e5")."""
    try:
        value = float(text)
        if value.is_integer():
            return int(value)
    except ValueError:
        pass
    raise ValueError("is not a whole number")
