"""Template matching (`pipetrace.analyze.templated`) reads a log exactly as JSON decoding does.

The matcher must give the general path's result for every log: the recorder's own lines
(sample traces, synthetic runs) and lines changed in the ways that must send a line, or its
chunk, to the JSON path (spaces, escapes, other key orders, floats, leading zeros, numbers
beyond int64, unknown values, extra fields, cut or blank lines).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipetrace.analyze import templated
from pipetrace.analyze.parse import RawRank, parse_rank_file
from pipetrace.testing.synthetic import write_synthetic_run

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
SAMPLE_LOGS = sorted(SAMPLES.glob("*/rank-*.ndjson"))


def assert_same(matched: RawRank, decoded: RawRank) -> None:
    for name, value in vars(decoded).items():
        other = getattr(matched, name)
        if name == "problems":
            assert asdict(other) == asdict(value)
        elif name in ("steps", "p2p", "memory"):
            assert other.keys() == value.keys(), name
            for column in value:
                assert other[column].dtype == value[column].dtype, (name, column)
                np.testing.assert_array_equal(other[column], value[column], err_msg=name)
        elif name == "text_parts":
            for mine, theirs in zip(other, value, strict=True):
                np.testing.assert_array_equal(mine, theirs)
        elif name == "plan_index":
            assert other.dtype == value.dtype
            np.testing.assert_array_equal(other, value)
        else:
            assert other == value, name


def test_the_compiled_helper_is_built():
    """An install (`make test` installs the package) builds it; without it every analysis
    silently takes the JSON path, about twice as slow."""
    assert templated.available()


@pytest.mark.parametrize("log", SAMPLE_LOGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_sample_logs_read_the_same(log):
    assert_same(parse_rank_file(log), parse_rank_file(log, matching=False))


@pytest.fixture(scope="module")
def synthetic_log(tmp_path_factory) -> Path:
    """A log of ~2.9 MB: three chunks, so that a chunk left to the JSON path sits between
    matched ones (the codes given to new texts must not depend on which path read them)."""
    run = tmp_path_factory.mktemp("synthetic")
    write_synthetic_run(
        run, schedule="interleaved-1f1b", num_ranks=2, num_microbatches=256, iterations=4
    )
    log = run / "rank-00001.ndjson"
    assert log.stat().st_size > 2 * templated.CHUNK_BYTES
    return log


def test_a_synthetic_log_reads_the_same_and_matches_every_frequent_line(synthetic_log):
    matched = parse_rank_file(synthetic_log)
    assert_same(matched, parse_rank_file(synthetic_log, matching=False))
    assert matched.events > 100 and len(matched.steps["begin"]) and len(matched.p2p["post"])


EDITS = [
    (b'"t":', b'"t": '),  # a space
    (b'"step":"', b'"step":"\\u0030'),  # an escape (the same text or another)
    (b'"th":"main"', b'"th":"m\\u00e9in"'),  # a non-ASCII thread name
    (b'"id":', b'"id":0'),  # a leading zero: not JSON
    (b'"it":', b'"it":-'),  # negative
    (b'"pos":', b'"pos":1.5,"x":'),  # a float
    (b'"seq":', b'"seq":99999999999999999999,"y":'),  # beyond int64
    (b'"op":"send"', b'"op":"sned"'),  # outside its set
    (b'"ch":"F"', b'"ch":"X"'),  # an unknown channel
    (b'"shape":[', b'"shape":[1,'),
    (b'"shape":[', b'"shape":["a",'),  # not ints
    (b"}", b',"extra":1}'),  # an extra field
    (b'{"e":"step_end","t":', b'{"t":0,"e":"step_end","t":'),  # a duplicate key
    (b'"t":', b'"t":-'),  # before the epoch
    (b"}", b""),  # cut
    (b"}", b"}\r"),  # a CR before the newline
]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    edits=st.lists(
        st.tuples(st.integers(0, 10**6), st.sampled_from(range(len(EDITS)))), max_size=4
    ),
    blank=st.booleans(),
)
def test_changed_lines_read_the_same(synthetic_log, tmp_path, edits, blank):
    lines = synthetic_log.read_bytes().split(b"\n")
    for at, which in edits:
        index = 1 + at % (len(lines) - 2)  # never the header or the final empty piece
        old, new = EDITS[which]
        lines[index] = lines[index].replace(old, new, 1)
    if blank:
        lines.insert(len(lines) // 2, b"")
    log = tmp_path / f"rank-{len(edits)}-{blank}.ndjson"
    log.write_bytes(b"\n".join(lines))
    assert_same(parse_rank_file(log), parse_rank_file(log, matching=False))


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(
        st.one_of(
            st.binary(max_size=120),
            st.sampled_from([text for old, new in EDITS for text in (old, new)]),
        ),
        max_size=40,
    )
)
def test_arbitrary_bytes_read_the_same(tmp_path_factory, pieces):
    """Bytes of any kind between real lines: never a crash, and the same reading."""
    real = (SAMPLES / "clean-1f1b" / "rank-00001.ndjson").read_bytes().split(b"\n")
    body = b"\n".join(real[1:8]) + b"".join(pieces) + b"\n" + b"\n".join(real[8:20])
    log = tmp_path_factory.mktemp("bytes") / "rank-00001.ndjson"
    log.write_bytes(real[0] + b"\n" + body)
    assert_same(parse_rank_file(log), parse_rank_file(log, matching=False))
