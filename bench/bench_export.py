"""Perfetto export speed and size, against the perfetto package's own builders.

    .venv/bin/python bench/bench_export.py [--ranks 8 --microbatches 64 --iterations 20]
                                           [--schedule zbv] [--run DIR] [--repeat 3]

Writes a synthetic run (`pipetrace.testing.synthetic`, the recorder's exact format) unless
``--run`` names a recorded one, loads it once, then times, best of ``--repeat``:

- the export itself (layout + protobuf writer), in slices per second (target >= 200k/s);
- the whole `pipetrace export` path: load + analyze + export;
- the Chrome JSON writer, for comparison;
- the baseline, in the same process: the same slices (begin with its annotations, end)
  written one TracePacket at a time through `perfetto`'s `StreamingTraceProtoBuilder` with
  inline names and absolute timestamps, on a sample of the slices.

It also prints the bytes per event of each, and decodes the export with the real protos to
count what it holds.
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from pathlib import Path

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.load import load_run
from pipetrace.export.args import slice_args
from pipetrace.export.chrome_json import write_chrome_json
from pipetrace.export.layout import build_layout
from pipetrace.export.perfetto import write_perfetto
from pipetrace.testing.synthetic import write_synthetic_run


def best(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def baseline(layout, sample: int) -> tuple[float, int, int]:
    """Seconds, bytes and events for ``sample`` slices through the perfetto builders."""
    s, a, names = layout.slices, slice_args(layout), layout.names
    out = io.BytesIO()
    builder = StreamingTraceProtoBuilder(out)
    n = min(sample, len(s))
    t0 = time.perf_counter()
    for i in range(n):
        packet = builder.create_packet()
        packet.timestamp = int(s.begin[i]) + layout.run.t0_ns
        packet.trusted_packet_sequence_id = 1
        ev = packet.track_event
        ev.type = pb.TrackEvent.TYPE_SLICE_BEGIN
        ev.track_uuid = int(s.track[i])
        ev.name = names[int(s.name[i])]
        for key, column in (
            ("stage", a.stage),
            ("microbatch", a.microbatch),
            ("iteration", a.iteration),
            ("position", a.position),
            ("peer", a.peer),
            ("seq", a.seq),
            ("bytes", a.nbytes),
        ):
            value = int(column[i])
            if value >= 0:
                ev.debug_annotations.add(name=key, int_value=value)
        builder.write_packet(packet)
        packet = builder.create_packet()
        packet.timestamp = int(s.end[i]) + layout.run.t0_ns
        packet.trusted_packet_sequence_id = 1
        packet.track_event.type = pb.TrackEvent.TYPE_SLICE_END
        packet.track_event.track_uuid = int(s.track[i])
        builder.write_packet(packet)
    return time.perf_counter() - t0, len(out.getvalue()), 2 * n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--run", type=Path, help="A recorded run directory instead of a synthetic one."
    )
    parser.add_argument("--schedule", default="zbv")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--sample", type=int, default=20_000, help="Slices written through the builders."
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run
        if run_dir is None:
            run_dir = Path(tmp) / "run"
            write_synthetic_run(
                run_dir,
                schedule=args.schedule,
                num_ranks=args.ranks,
                num_microbatches=args.microbatches,
                iterations=args.iterations,
                workers=2,
            )
        load_s, run = best(lambda: load_run(run_dir), args.repeat)
        analyze_s, analysis = best(lambda: analyze(run), args.repeat)
        findings = analysis.findings
        layout_s, layout = best(lambda: build_layout(run, findings), args.repeat)

        def proto() -> bytes:
            buf = io.BytesIO()
            write_perfetto(build_layout(run, findings), buf)
            return buf.getvalue()

        def chrome() -> int:
            return write_chrome_json(build_layout(run, findings), io.BytesIO())

        export_s, data = best(proto, args.repeat)
        json_s, json_bytes = best(chrome, args.repeat)
        base_s, base_bytes, base_events = baseline(layout, args.sample)
    trace = pb.Trace.FromString(data)
    decoded_events = sum(p.HasField("track_event") for p in trace.packet)
    slices = len(layout.slices)
    events = 2 * slices + len(layout.instants) + len(layout.counters)
    assert decoded_events == events
    base_per_slice = base_s / (base_events / 2)
    source = (
        str(run_dir)
        if args.run
        else (
            f"synthetic {args.schedule}, {args.ranks} ranks, "
            f"{args.microbatches} micro-batches, {args.iterations} iterations"
        )
    )
    print(f"run: {source}; {run.num_events:,} recorded events")
    print(
        f"export: {slices:,} slices, {len(layout.instants):,} instants, "
        f"{len(layout.counters):,} counter samples, {layout.num_flows:,} flows, "
        f"{len(layout.tracks):,} tracks = {events:,} trace events"
    )
    print()
    print("| figure | result |")
    print("|---|---|")
    print(
        f"| export (layout + protobuf), slices/s | {slices / export_s:,.0f} "
        f"({export_s:.2f} s; layout {layout_s:.2f} s) |"
    )
    print(
        f"| load + analyze + export, slices/s | {slices / (load_s + analyze_s + export_s):,.0f} "
        f"(load {load_s:.2f} s, analyze {analyze_s:.2f} s) |"
    )
    print(
        f"| protobuf bytes per trace event | {len(data) / events:.1f} "
        f"({len(data) / 2**20:.1f} MiB) |"
    )
    print(
        f"| perfetto builders, per slice (same process) | {base_per_slice * 1e6:.1f} µs = "
        f"{1 / base_per_slice:,.0f} slices/s; "
        f"export is {base_per_slice / (export_s / slices):.0f}x faster |"
    )
    print(
        "| builders' bytes per event (inline names, absolute times) | "
        f"{base_bytes / base_events:.1f} |"
    )
    print(
        f"| Chrome JSON, slices/s and bytes per event | {slices / json_s:,.0f}; "
        f"{json_bytes / events:.1f} |"
    )


if __name__ == "__main__":
    main()
