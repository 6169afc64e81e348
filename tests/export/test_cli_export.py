"""`pipetrace export` end to end: files, names, errors, and serving the trace once."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import orjson
import pytest

from pipetrace.cli import main
from pipetrace.export import default_output

from .decode import decode_perfetto

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


@pytest.fixture(scope="module")
def run_dir(recorded):
    return recorded("deadlock").path


def test_default_output_is_next_to_the_run(run_dir, tmp_path, capsys):
    target = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(run_dir), str(target)], check=True)
    assert main(["export", str(target) + "/"]) == 0
    out = tmp_path / "copy.pftrace"
    assert out.exists() and default_output(str(target) + "/") == out
    decoded = decode_perfetto(out.read_bytes())
    assert decoded.slices
    stdout = capsys.readouterr().out
    assert f"wrote {out}" in stdout and "ui.perfetto.dev" in stdout
    assert (
        int(re.search(r"(\d+) findings", stdout).group(1)) >= 2
    )  # the deadlock and the unmatched recv
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file


def test_chrome_json_and_output_option(run_dir, tmp_path):
    out = tmp_path / "t.json"
    assert (
        main(["export", str(run_dir), "--format", "chrome-json", "-o", str(out), "--no-findings"])
        == 0
    )
    doc = orjson.loads(out.read_bytes())
    assert any(e["ph"] == "X" for e in doc["traceEvents"])
    assert not any(e.get("name", "").startswith("error:") for e in doc["traceEvents"])


def _corrupt_meta(d):
    d.mkdir()
    (d / "meta.json").write_text("{not json")


def _not_a_run(d):
    d.mkdir()
    (d / "meta.json").write_text('{"format": "something-else", "schema_version": 1}')


def _no_logs(d):
    d.mkdir()
    (d / "meta.json").write_text(
        '{"format": "pipetrace-run", "schema_version": 1, "world_size": 2}'
    )


@pytest.mark.parametrize(
    "make",
    [
        None,
        lambda d: d.mkdir(),
        _corrupt_meta,
        _not_a_run,
        _no_logs,
        lambda d: d.write_text("a file"),
    ],
)
def test_unusable_input_is_one_line_and_exit_2(tmp_path, capsys, make):
    d = tmp_path / "run"
    if make is not None:
        make(d)
    assert main(["export", str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pipetrace: error:") and "Traceback" not in err[0]
    assert not (tmp_path / "run.pftrace").exists()


def test_unwritable_output_is_a_clean_error(run_dir, tmp_path, capsys):
    assert main(["export", str(run_dir), "-o", str(tmp_path / "missing" / "t.pftrace")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_open_serves_the_file_once(run_dir, tmp_path):
    out = tmp_path / "served.pftrace"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipetrace",
            "export",
            str(run_dir),
            "-o",
            str(out),
            "--open",
            "--port",
            "0",
            "--timeout",
            "30",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        link = ""
        while not link:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            if line.startswith("open https://ui.perfetto.dev/#!/?url="):
                link = line.split()[1]
        url = link.split("url=", 1)[1]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/served\.pftrace", url)
        preflight = urllib.request.Request(
            url,
            method="OPTIONS",
            headers={
                "Origin": "https://ui.perfetto.dev",
                "Access-Control-Request-Method": "GET",
                "Access-Control-Request-Private-Network": "true",
            },
        )
        with urllib.request.urlopen(preflight, timeout=10) as r:
            assert r.headers["Access-Control-Allow-Origin"] == "https://ui.perfetto.dev"
            assert r.headers["Access-Control-Allow-Private-Network"] == "true"
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.headers["Access-Control-Allow-Origin"] == "https://ui.perfetto.dev"
            assert r.read() == out.read_bytes()
        assert proc.wait(10) == 0  # it stops after serving once
    finally:
        proc.kill()
        proc.communicate()


def test_open_gives_up_after_the_timeout(run_dir, tmp_path, capsys):
    from pipetrace.export.serve import serve_once

    links = []
    out = tmp_path / "t.pftrace"
    out.write_bytes(b"x")
    assert serve_once(out, port=0, timeout=0.3, ready=links.append) is False
    assert links and links[0].endswith("/t.pftrace")


def test_failing_analyzers_do_not_stop_the_export(run_dir, tmp_path, capsys, monkeypatch):
    import pipetrace.analyze.analysis as analysis

    def broken(run):
        raise ValueError("analyzer bug")

    monkeypatch.setattr(analysis, "analyze", broken)
    out = tmp_path / "t.pftrace"
    assert main(["export", str(run_dir), "-o", str(out)]) == 0
    assert "analyzers failed (ValueError: analyzer bug)" in capsys.readouterr().err
    assert not [
        i for i in decode_perfetto(out.read_bytes()).instants if i.name.startswith("error:")
    ]


def _serve_in_thread(path, timeout):
    import threading

    from pipetrace.export.serve import serve_once

    links, result = [], {}
    thread = threading.Thread(
        target=lambda: result.setdefault(
            "served", serve_once(path, port=0, timeout=timeout, ready=links.append)
        ),
        daemon=True,
    )
    thread.start()
    while not links and thread.is_alive():
        thread.join(0.01)
    return links[0].split("url=", 1)[1], thread, result


def test_open_does_not_wait_on_an_idle_connection(tmp_path):
    import socket
    import time

    out = tmp_path / "t.pftrace"
    out.write_bytes(b"x")
    url, thread, result = _serve_in_thread(out, timeout=1.0)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)):  # connects, then says nothing
        thread.join(10)
    assert not thread.is_alive() and result["served"] is False
    assert time.monotonic() - started < 3  # bounded by --timeout, not by the idle client


def test_open_answers_only_requests_for_localhost(tmp_path):
    import urllib.error

    out = tmp_path / "t.pftrace"
    out.write_bytes(b"trace")
    url, thread, result = _serve_in_thread(out, timeout=10.0)
    rebound = urllib.request.Request(url, headers={"Host": "attacker.example:9001"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(rebound, timeout=5)
    assert refused.value.code == 403
    with urllib.request.urlopen(url.replace("127.0.0.1", "localhost"), timeout=5) as r:
        assert r.read() == b"trace"
    thread.join(5)
    assert result["served"] is True


def test_input_problems_are_said_as_analyze_says_them(tmp_path, capsys):
    run = tmp_path / "torn"
    shutil.copytree(SAMPLES / "clean-1f1b", run)
    with (run / "rank-00002.ndjson").open("ab") as log:
        log.write(b'{"e":"step_begin","t":17962')  # a kill mid-write: an info
    assert main(["export", str(run), "-o", str(tmp_path / "t.pftrace")]) == 0
    err = capsys.readouterr().err
    assert "pipetrace export: input info: rank-00002.ndjson: torn last line skipped" in err
