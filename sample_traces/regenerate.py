"""Regenerate sample_traces/: small recorded runs of the real runtime, clean and with faults.

    .venv/bin/python sample_traces/regenerate.py                 # every sample (~1-2 min)
    .venv/bin/python sample_traces/regenerate.py fault-hang ...  # only these

Each sample is the recording `pipetrace run` makes with the arguments listed below (they go
through the same flag parsing, so hanging faults get the same short watchdog timeouts);
samples that end cleanly share one launch per world size, to pay the ranks' start-up once.
Then sample_traces/README.md is rewritten: what each sample is, what `pipetrace analyze`
finds in it, and the sizes. Timings differ from run to run, so findings that depend on them
(stragglers, exposed communication) may too.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import click
from click.testing import CliRunner

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

COMMON = ["-m", "4", "-n", "2"]
FAULT_RUN = ["-s", "1f1b", "-p", "3", *COMMON]
SAMPLES: dict[str, list[str]] = {
    "clean-gpipe": ["-s", "gpipe", "-p", "3", *COMMON],
    "clean-1f1b": ["-s", "1f1b", "-p", "3", *COMMON],
    "clean-interleaved-1f1b": ["-s", "interleaved-1f1b", "-p", "2", "-v", "2", *COMMON],
    "clean-zb1p": ["-s", "zb1p", "-p", "2", "-v", "2", *COMMON],
    "clean-zbv": ["-s", "zbv", "-p", "2", *COMMON],
    "clean-dualpipev": ["-s", "dualpipev", "-p", "2", *COMMON, "--overlap-p2p"],
    "fault-crash": [*FAULT_RUN, "--inject", "crash"],
    "fault-hang": [*FAULT_RUN, "--inject", "hang"],
    "fault-deadlock": [*FAULT_RUN, "--inject", "deadlock"],
    "fault-drop-recv": [*FAULT_RUN, "--inject", "drop-recv"],
    "fault-drop-send": [*FAULT_RUN, "--inject", "drop-send"],
    "fault-extra-send": [*FAULT_RUN, "--inject", "extra-send"],
    "fault-shape-mismatch": [*FAULT_RUN, "--inject", "shape-mismatch"],
    "fault-swap-order": [*FAULT_RUN, "--inject", "swap-order"],
    "fault-straggler": [*FAULT_RUN, "--inject", "straggler"],
    "fault-slow-link": [*FAULT_RUN, "--inject", "slow-link"],
}


def config_of(name: str):
    """The RunConfig `pipetrace run ARGS --out sample_traces/NAME` would run."""
    from pipetrace.runtime.config import run_options

    made = []

    @click.command()
    @run_options
    def probe(make_config):
        made.append(make_config(2))

    args = [*SAMPLES[name], "--out", f"sample_traces/{name}"]
    result = CliRunner().invoke(probe, args, catch_exceptions=False)
    if result.exit_code != 0:
        raise SystemExit(f"{name}: {result.output}")
    return made[0]


def record(names: list[str]) -> None:
    from pipetrace.runtime.launch import launch

    configs = {name: config_of(name) for name in names}
    groups: list[list[str]] = []
    together: dict[int, list[str]] = {}
    for name, config in configs.items():
        if any(f.ENDS_RUN for f in config.faults):
            groups.append([name])
        else:
            together.setdefault(config.world_size, []).append(name)
    groups += list(together.values())
    for group in groups:
        for name in group:
            shutil.rmtree(HERE / name, ignore_errors=True)
        print(f"recording {', '.join(group)}", flush=True)
        result = launch([configs[name] for name in group], kill_grace=2.0)
        ends = any(f.ENDS_RUN for name in group for f in configs[name].faults)
        if bool(result.failures) != ends:
            raise SystemExit(f"{group}: unexpected outcome {result.failures}")


def findings_of(name: str) -> list[tuple[str, str, str]]:
    from pipetrace.analyze.analysis import analyze
    from pipetrace.analyze.load import load_run

    analysis = analyze(load_run(HERE / name, workers=0))
    return [(f.severity, f.kind, f.message) for f in analysis.findings]


def write_readme() -> None:
    from pipetrace.runtime.config import RunConfig

    rows, total = [], 0
    for name in SAMPLES:
        path = HERE / name
        if not path.is_dir():
            continue
        size = sum(f.stat().st_size for f in path.iterdir())
        total += size
        config: RunConfig = config_of(name)
        plan = config.plan()
        injected = "; ".join(f.describe(plan, overlap=config.overlap_p2p) for f in config.faults) or "none"
        counts: dict[str, int] = {}
        for severity, kind, _ in findings_of(name):
            if severity != "info":
                counts[f"{kind} ({severity})"] = counts.get(f"{kind} ({severity})", 0) + 1
        found = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in counts.items()) or "nothing above info"
        args = " ".join(SAMPLES[name])
        rows.append(f"| `{name}/` | `pipetrace run {args}` | {injected} | {found} | {size / 1024:.0f} KB |")
    text = f"""# Sample traces

Small recordings of the real runtime (gloo on local CPU ranks, the demo model, 4 micro-batches,
2 training steps): one clean run per built-in schedule and one run per injectable fault
(`pipetrace run --inject`, docs/runtime.md). Tests, docs/diagnosis.md, the TUI and demos use
them; explain any of them with `pipetrace analyze sample_traces/NAME`.

Regenerate them all (about a minute or two) with

```
.venv/bin/python sample_traces/regenerate.py        # or: ... regenerate.py fault-hang clean-zbv
```

Each is what the listed `pipetrace run` command records with `--out sample_traces/NAME`. The
findings column is `pipetrace analyze` at the time of recording (warnings and errors); timings
differ from run to run, so timing findings (straggler, exposed_comm) can come and go.

| run | recorded with | injected | analyze finds | size |
|---|---|---|---|---|
{chr(10).join(rows)}

Total: {total / 1024:.0f} KB.
"""
    (HERE / "README.md").write_text(text)
    print(f"wrote {HERE / 'README.md'} ({total / 1024:.0f} KB of traces)")


def main(argv: list[str]) -> None:
    os.chdir(ROOT)  # meta.json records --out as given: keep it relative to the repository
    names = argv or list(SAMPLES)
    unknown = [n for n in names if n not in SAMPLES]
    if unknown:
        raise SystemExit(f"unknown sample(s) {', '.join(unknown)}; choose from {', '.join(SAMPLES)}")
    record(names)
    write_readme()


if __name__ == "__main__":
    main(sys.argv[1:])
