"""The run model: clock refinement, pairing, parallel loading and the synthetic generator."""

from __future__ import annotations

import os

import numpy as np
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.load import load_run
from pipetrace.analyze.model import OP_SEND, OPEN, _parse_texts, parse_texts, steps_of
from pipetrace.schedule.ir import B, F, Step, StepKind, format_step, overlap
from pipetrace.testing.cluster import FakeCluster
from pipetrace.testing.synthetic import write_synthetic_run


def matched_slack(run):
    """done(recv) - post(send) of every matched pair, aligned."""
    out = []
    for rank in run.present_ranks:
        p = rank.p2p
        sends = np.flatnonzero((p.op == OP_SEND) & (p.match_rank >= 0))
        for row in sends:
            other = run.ranks[int(p.match_rank[row])].p2p
            done = other.done[p.match_index[row]]
            if done != OPEN:
                out.append(int(done - p.post[row]))
    return np.array(out)


def test_clock_refinement_puts_every_recv_after_its_send(tmp_path):
    # ranks' clocks are skewed and the recorded offsets of ranks 1 and 2 are 3 ms wrong
    FakeCluster.of(
        clock_offsets_ns=[0, 40_000_000, -25_000_000, 7_000_000],
        clock_errors_ns=[0, 3_000_000, -3_000_000, 0],
    ).record(tmp_path)
    run = load_run(tmp_path, workers=0)
    q = run.clock_quality
    assert q["early_receives_before"] > 0 and q["refined"] and q["min_slack_ns"] >= 0
    assert matched_slack(run).min() >= 0
    assert abs(run.ranks[1].clock.correction_ns) > 1_000_000


def test_clean_recording_needs_no_refinement(clean_run):
    run = load_run(clean_run, workers=0)
    assert not run.clock_quality["refined"] and matched_slack(run).min() >= 0
    assert all((r.p2p.match_rank >= 0).all() for r in run.ranks)


def test_every_op_is_paired_with_its_seq_counterpart(clean_run):
    run = load_run(clean_run, workers=0)
    for rank in run.ranks:
        p = rank.p2p
        for row in range(len(p)):
            other = run.ranks[int(p.match_rank[row])].p2p
            j = int(p.match_index[row])
            assert other.match_rank[j] == rank.rank and other.match_index[j] == row
            assert (other.seq[j], other.it[j], other.ch[j]) == (p.seq[row], p.it[row], p.ch[row])
            assert other.op[j] != p.op[row]


def test_parallel_and_serial_loading_agree(tmp_path):
    write_synthetic_run(tmp_path, num_ranks=4, num_microbatches=8, iterations=3, jitter=0.1)
    a, b = load_run(tmp_path, workers=0), load_run(tmp_path, workers=2)
    assert a.catalog.texts == b.catalog.texts
    for ra, rb in zip(a.ranks, b.ranks):
        for name in ("begin", "end", "code", "pos", "it"):
            assert np.array_equal(getattr(ra.steps, name), getattr(rb.steps, name))
        for name in ("post", "done", "seq", "match_rank", "match_index"):
            assert np.array_equal(getattr(ra.p2p, name), getattr(rb.p2p, name))


def test_a_synthetic_run_written_by_a_pool_of_workers_is_one_run(tmp_path, monkeypatch):
    # the documented command: `python -m pipetrace.testing.synthetic OUT --ranks 64`
    monkeypatch.delenv("PIPETRACE_RUN_ID", raising=False)
    write_synthetic_run(tmp_path, num_ranks=4, num_microbatches=4, iterations=1, workers=2)
    run = load_run(tmp_path, workers=0)
    assert [r.status.state for r in run.ranks] == ["finished"] * 4
    assert "PIPETRACE_RUN_ID" not in os.environ  # set for the pool only


def test_synthetic_straggler_and_clean(tmp_path):
    write_synthetic_run(tmp_path / "clean", num_ranks=4, num_microbatches=8, iterations=3)
    assert [f.kind for f in analyze(load_run(tmp_path / "clean")).findings] == []
    write_synthetic_run(
        tmp_path / "slow", num_ranks=4, num_microbatches=8, iterations=3, slow_stages={2: 3.0}
    )
    found = analyze(load_run(tmp_path / "slow")).findings
    assert [(f.kind, f.ranks) for f in found] == [("straggler", [2])]


def test_overlapping_substeps_are_folded_into_their_composite(tmp_path):
    FakeCluster.of("dualpipev", ranks=2, stages_per_rank=2, iterations=1).record(tmp_path)
    run = load_run(tmp_path, workers=0)
    assert "overlap" in run.threads
    assert [f.kind for f in analyze(run).findings if f.severity != "info"] == []


def test_pairing_by_channel_equals_the_global_sort_with_duplicates(tmp_path, clean_run):
    """Sequence numbers too large to pack take the general pairing (one global sort): it
    pairs a run with duplicated ops exactly as the per-channel pairing does."""
    import shutil

    from pipetrace.recorder import format as fmt

    shutil.copytree(clean_run, tmp_path / "packed")
    log = tmp_path / "packed" / fmt.rank_log_name(1)
    lines = log.read_bytes().splitlines(keepends=True)
    posts = [line for line in lines if b'"p2p_post"' in line][:6]
    log.write_bytes(b"".join(lines + posts))  # the same ops (ids, seqs) again
    shutil.copytree(tmp_path / "packed", tmp_path / "general")
    for log in (tmp_path / "general").glob("rank-*.ndjson"):
        header, *events = log.read_bytes().splitlines(keepends=True)
        shifted = [_shift_seq(line, 2**40) for line in events]
        log.write_bytes(header + b"".join(shifted))
    packed = load_run(tmp_path / "packed", workers=0)
    general = load_run(tmp_path / "general", workers=0)
    assert general.ranks[1].p2p.seq.min() >= 2**40
    for a, b in zip(packed.ranks, general.ranks):
        assert np.array_equal(a.p2p.match_rank, b.p2p.match_rank)
        assert np.array_equal(a.p2p.match_index, b.p2p.match_index)
    assert (packed.ranks[1].p2p.match_rank < 0).sum() == 6  # the duplicates stay unpaired


def _shift_seq(line: bytes, by: int) -> bytes:
    if b'"p2p_post"' not in line:
        return line
    event = orjson.loads(line)
    event["seq"] += by
    return orjson.dumps(event) + b"\n"


def test_steps_from_parsed_columns_are_the_parsed_steps():
    """The simple texts are made from the columns in bulk; the others parsed one by one, in
    their places."""
    expected = [
        F(0, 1),
        overlap(F(0, 0), B(1, 0)),
        Step(StepKind.UNSHARD, 2),
        Step(StepKind.SEND_B, 3, 7),
    ]
    texts = [format_step(step) for step in expected] + ["junk", "0F"]
    assert steps_of(texts, *parse_texts(texts)) == [*expected, None, None]
    simple = [format_step(F(s, m)) for s in range(3) for m in range(2)]
    assert steps_of(simple, *parse_texts(simple)) == [F(s, m) for s in range(3) for m in range(2)]


def test_a_stage_or_microbatch_beyond_int32_is_unparsable():
    """No plan has one; a damaged log's text must not wrap around into another step."""
    texts = ["0F2147483647", "0F2147483648", "2147483648B0", "0UNSHARD", "9" * 12 + "W1"]
    kind, stage, mb = parse_texts(texts)
    assert stage.tolist() == [0, -1, -1, 0, -1]
    assert mb.tolist() == [2147483647, -1, -1, -1, -1]
    assert (kind[[1, 2, 4]] == -1).all() and (kind[[0, 3]] >= 0).all()


_TEXT_PARTS = st.sampled_from(
    ["0", "1", "7", "12", "007", "1234567890", "٣", "F", "B", "W", "I", "SEND_F", "RECV_B"]
    + ["SEND_B", "RECV_F", "SEND", "f", "(", ")", ",", "-", " ", "é"]
)


@settings(max_examples=500, deadline=None)
@given(
    texts=st.lists(
        st.one_of(st.lists(_TEXT_PARTS, max_size=5).map("".join), st.text(max_size=8)),
        max_size=20,
    )
)
def test_the_compiled_text_reader_reads_as_the_python_one(texts):
    """`parse_texts` takes the simple texts in C and leaves the rest to `_parse_texts`:
    together they give what `_parse_texts` gives alone, on any text (non-ASCII digits,
    leading zeros, digit runs too long for C, kinds that are prefixes of others)."""
    texts += [format_step(F(2, 3)), format_step(Step(StepKind.SEND_B, 1, 4)), 5]
    for mine, python in zip(parse_texts(texts), _parse_texts(texts), strict=True):
        assert mine.dtype == python.dtype
        np.testing.assert_array_equal(mine, python)
