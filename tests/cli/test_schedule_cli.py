"""`pipetrace schedule ...` as a user runs it: output, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipetrace import __version__
from pipetrace.cli import main
from pipetrace.schedule.builders import build_compute_plan
from pipetrace.schedule.csvio import load_csv


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_and_version(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "schedule" in out
    code, out, _ = run(capsys, "--version")
    assert code == 0 and __version__ in out
    for sub in ("list", "show", "verify", "simulate"):
        code, out, _ = run(capsys, "schedule", sub, "--help")
        assert code == 0 and "Usage:" in out


def test_list_names_every_schedule_with_aliases(capsys):
    code, out, _ = run(capsys, "schedule", "list", "--json")
    assert code == 0
    listed = {item["name"]: item["aliases"] for item in json.loads(out)}
    assert set(listed) == {"gpipe", "1f1b", "interleaved-1f1b", "zb1p", "zbv", "dualpipev"}
    assert "ScheduleZBVZeroBubble" in listed["zbv"]


def test_show_csv_round_trips_through_the_file_loader(capsys, tmp_path):
    code, out, _ = run(
        capsys,
        "schedule",
        "show",
        "interleaved-1f1b",
        "-p",
        "2",
        "-m",
        "4",
        "-v",
        "2",
        "--format",
        "csv",
    )
    assert code == 0
    path = tmp_path / "plan.csv"
    path.write_text(out)
    loaded = load_csv(path)
    built = build_compute_plan(
        "interleaved-1f1b", num_ranks=2, num_microbatches=4, stages_per_rank=2
    )
    assert [loaded.steps(r) for r in range(2)] == [built.steps(r) for r in range(2)]
    assert loaded.placement == built.placement


def test_torch_class_names_are_accepted(capsys):
    code, out, _ = run(capsys, "schedule", "show", "schedule1f1b", "-p", "2", "-m", "2")
    assert code == 0 and "0F0" in out and "1B1" in out


def test_lowered_plan_written_as_csv_verifies_clean_under_every_semantics(capsys, tmp_path):
    code, out, _ = run(
        capsys, "schedule", "show", "zbv", "-p", "2", "-m", "4", "--comms", "--format", "csv"
    )
    assert code == 0 and "SEND_F" in out
    path = tmp_path / "zbv.csv"
    path.write_text(out)
    for semantics in ("eager", "rendezvous", "fifo"):
        code, out, _ = run(
            capsys, "schedule", "verify", "--csv", str(path), "--semantics", semantics
        )
        assert code == 0, out
        assert "OK" in out


def test_deadlocked_file_exits_1_with_blocked_grid_and_json(capsys, tmp_path):
    path = tmp_path / "sendsend.csv"
    path.write_text(
        "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n".replace(
            "1RECV_F0,1F0,1B0,1SEND_B0", "1SEND_B0,1RECV_F0,1F0,1B0"
        )
    )
    code, out, _ = run(capsys, "schedule", "verify", "--csv", str(path))
    assert code == 1
    assert "rank 0 blocked in 0SEND_F0 waiting for rank 1" in out
    assert "BLOCKED" in out
    code, out, _ = run(capsys, "schedule", "verify", "--csv", str(path), "--json")
    assert code == 1
    kinds = {f["kind"] for f in json.loads(out)["findings"]}
    assert "deadlock" in kinds
    code, out, _ = run(capsys, "schedule", "verify", "--csv", str(path), "--semantics", "eager")
    assert "deadlock" not in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["schedule", "verify", "--csv", "does-not-exist.csv"], "no such schedule file"),
        (["schedule", "verify", "nosuch", "-p", "2", "-m", "2"], "nosuch"),
        (["schedule", "verify", "1f1b", "-p", "2"], "needs --ranks and --microbatches"),
        (["schedule", "verify", "interleaved-1f1b", "-p", "4", "-m", "9"], "9 micro-batches"),
        (["schedule", "verify", "zbv", "-p", "2", "-m", "4", "-v", "3"], "3"),
        (["schedule", "simulate", "1f1b", "-p", "2", "-m", "2", "--costs", "F=x"], "F"),
        (["schedule", "verify", "1f1b", "-p", "0", "-m", "2"], "ranks"),
    ],
)
def test_user_errors_exit_2_with_one_line(capsys, args, message):
    code, _, err = run(capsys, *args)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    # one line names the problem (click adds its usage hint above usage errors)
    assert any(message in line for line in err.splitlines())


def test_malformed_csv_names_row_and_column(capsys, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1Q0\n")
    code, _, err = run(capsys, "schedule", "verify", "--csv", str(path))
    assert code == 2
    assert "row 2" in err and "column 2" in err and "1Q0" in err


@pytest.mark.parametrize(
    "cell, said",
    [
        ("9" * 50_000 + "F0", "a cell of 50,002 characters is no action"),
        ("9" * 5000 + "F0", "'999"),
    ],
    ids=["a-cell-no-action-is-as-long", "a-long-bad-action"],
)
def test_an_overlong_csv_cell_is_one_short_line(capsys, tmp_path, cell, said):
    path = tmp_path / "long.csv"
    path.write_text(f"0F0,{cell}\n")
    code, _, err = run(capsys, "schedule", "verify", "--csv", str(path))
    assert code == 2 and said in err
    assert len(err.splitlines()) == 1 and len(err) < 300


def test_simulate_json_reproduces_1f1b_idle_fraction(capsys):
    p, m = 4, 8
    code, out, _ = run(capsys, "schedule", "simulate", "1f1b", "-p", str(p), "-m", str(m), "--json")
    assert code == 0
    assert json.loads(out)["idle_fraction"] == pytest.approx((p - 1) / (m + p - 1))


def test_simulate_json_has_the_timeline_when_asked(capsys):
    code, out, _ = run(capsys, "schedule", "simulate", "1f1b", "-p", "2", "-m", "2", "--json")
    assert code == 0 and "timeline" not in json.loads(out)
    args = ("schedule", "simulate", "1f1b", "-p", "2", "-m", "2", "--json", "--timeline")
    code, out, _ = run(capsys, *args)
    steps = json.loads(out)["timeline"]
    compute = [s for s in steps if s["kind"] in ("F", "B")]
    assert code == 0 and len(compute) == 2 * 2 * 2  # ranks x micro-batches x (F, B)
    assert all(s["end"] > s["start"] for s in compute)


def test_simulate_warns_of_a_plan_verify_rejects(capsys, tmp_path):
    duplicated = tmp_path / "dup.csv"
    duplicated.write_text("0F0,0F0,0B0\n1F0,1B0\n")
    code, out, err = run(capsys, "schedule", "simulate", "--csv", str(duplicated))
    assert code == 1 and "makespan" in out
    assert "warning: the plan has 1 error(s)" in err and "0F0 appears 2 times" in err
    cycle = tmp_path / "cycle.csv"
    cycle.write_text("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")
    code, out, err = run(capsys, "schedule", "simulate", "--csv", str(cycle))
    assert code == 1 and out == "" and len(err.splitlines()) == 1
    assert "the plan cannot run" in err


def test_schedule_commands_do_not_import_torch():
    script = (
        "import sys\n"
        "from pipetrace.cli import main\n"
        "assert main(['schedule', 'verify', 'zbv', '-p', '2', '-m', '4']) == 0\n"
        "assert main(['schedule', 'simulate', '1f1b', '-p', '2', '-m', '4']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
