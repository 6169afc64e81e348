"""`pipetrace run`'s flags and `RunConfig`'s fields are one list: same names, same defaults,
and a bad value reads right whether it came from Python or from the command line."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from pipetrace.cli import main, run_options
from pipetrace.cli.run import run
from pipetrace.runtime.config import RunConfig
from pipetrace.settings import SettingsError, settings_fields

DOCS = Path(__file__).resolve().parents[2] / "docs"
FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}
FLAGS = {declared.flag: name for name, declared in settings_fields(RunConfig).items()}
OPTIONS = {param.opts[0]: param for param in run.params if isinstance(param, click.Option)}


def shown(default: object) -> str:
    return f"{default:g}" if isinstance(default, int | float) else str(default)


def test_every_flag_sets_a_field_and_every_settable_field_has_a_flag():
    assert set(OPTIONS) - {"--help"} == set(FLAGS)
    assert all(OPTIONS[flag].name == name for flag, name in FLAGS.items())


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_each_flag_defaults_to_its_field(flag):
    option, field = OPTIONS[flag], FIELDS[FLAGS[flag]]
    if field.default is dataclasses.MISSING:
        assert option.required
    elif option.default is None and field.default is not None:
        # decided when the run starts (under torchrun, with a fault that hangs): the help says
        # what it is otherwise
        assert f"[default: {shown(field.default)};" in option.help
    else:
        assert option.default == field.default


@pytest.mark.parametrize(
    "fields, args, python, command_line",
    [
        (
            {"stall_timeout": -1},
            ["--stall-timeout", "-1"],
            "stall_timeout must be >= 0 seconds (0 turns it off), got -1",
            "--stall-timeout must be >= 0 seconds (0 turns it off), got -1",
        ),
        (
            {"microbatches": 0},
            ["-m", "0"],
            "microbatches must be >= 1, got 0",
            "--microbatches must be >= 1, got 0",
        ),
        (
            {"torch_profiler": True, "record": "off"},
            ["--torch-profiler", "--record", "off"],
            "torch_profiler writes into the run directory: it needs recording on",
            "--torch-profiler writes into the run directory: it needs recording on",
        ),
    ],
)
def test_an_error_names_the_field_in_python_and_the_flag_on_the_command_line(
    capsys, no_launch, fields, args, python, command_line
):
    with pytest.raises(SettingsError) as info:
        RunConfig("1f1b", **fields)
    assert str(info.value) == python
    assert main(["run", "-s", "1f1b", *args]) == 2
    assert capsys.readouterr().err == f"pipetrace: error: {command_line}\n"


def documented_defaults() -> dict[str, str]:
    """Flag -> the default the docs give it: "(default N)" in runtime.md's flag table, the
    default column of recording.md's."""
    found = {}
    for doc, default_of in (
        ("runtime.md", lambda cell: re.search(r"\(default (\w+)\)", cell)),
        ("recording.md", lambda cell: re.fullmatch(r"`?([^`]+)`?", cell)),
    ):
        for line in (DOCS / doc).read_text().splitlines():
            if not line.startswith("| `-"):
                continue
            flags, second = (cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:3])
            default = default_of(second)
            for flag in re.findall(r"--[\w-]+", flags):
                if default and flag in FLAGS:
                    found[flag] = default.group(1)
    return found


def test_the_docs_state_the_defaults_of_the_flags():
    documented = documented_defaults()
    assert {"--ranks", "--timeout", "--out", "--record", "--stall-timeout"} <= documented.keys()
    shown_defaults = {flag.name: flag.shown_default for flag in run_options.FLAGS}
    for flag, default in documented.items():
        name = FLAGS[flag]
        field_default = FIELDS[name].default
        if shown_defaults[name] is not None:
            expected = shown_defaults[name].split(";")[0]
        elif isinstance(field_default, bool):
            expected = "on" if field_default else "off"
        else:
            expected = shown(field_default)
        assert default == expected, flag


def test_the_settings_import_no_command_line_or_framework():
    code = (
        "import sys, pipetrace.runtime.config, pipetrace.recorder.setup; "
        "print(sorted({'click', 'torch', 'mindspore'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
