"""How a rank's log ended, told right whatever the ending: runs written from the documented
format (`handwritten.HandRun`), one test group per class of issue #13's defects."""

from __future__ import annotations

import json
import re

import pytest

from pipetrace.analyze.analysis import analyze
from pipetrace.analyze.load import load_run
from pipetrace.cli import main

from .handwritten import MS, HandRun, at

CLOSED = "Connection closed by peer [127.0.0.1]:1234"


def analyzed(run: HandRun, tmp_path) -> dict:
    return analyze(load_run(run.write(tmp_path / "run"), workers=0)).to_json()


def of_kind(document: dict, kind: str) -> list[dict]:
    return [f for f in document["findings"] if f["kind"] == kind]


def stalls_ending_at(document: dict, rank: int) -> list[dict]:
    return [
        f for f in of_kind(document, "rank_stalled") if f["details"].get("terminal_rank") == rank
    ]


def assert_told_right(document: dict) -> None:
    """No negative duration, no placeholder, no undocumented terminal state."""
    for f in document["findings"]:
        text = f["message"] + " " + f["cause"]
        assert not re.search(r"\bNone\b|\(no step\)|at least -", text), text
        if f["time_ns"] is not None:
            assert f["time_ns"][1] >= f["time_ns"][0], f
        assert f["details"].get("terminal_state") != "stopped", f


# -- 1. a log that stops inside a step, with no later event ---------------------------------


def test_a_log_stopping_in_a_step_before_a_peer_loses_its_connection_is_one_death(tmp_path):
    run = HandRun().cut(1, at(1, 30))  # rank 1 inside 1B0 of iteration 1
    run.cut(0, at(1, 20)).raises(0, at(1, 80), CLOSED)  # rank 0 waits in 0RECV_B0
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    died = [f for f in of_kind(document, "rank_failed") if f["ranks"] == [1]]
    assert len(died) == 1 and died[0]["severity"] == "error"
    assert "inside 1B0" in died[0]["message"] and died[0]["details"]["ending"] == "crashed"
    assert "rank 0's connection to it closed" in died[0]["cause"]
    for stall in stalls_ending_at(document, 1):
        assert stall["details"]["terminal_state"] == "crashed"
        assert "still in" not in stall["message"]


# (rank 1, rank 0) stop in: (1RECV_F0, 0F0), (1F0, 0RECV_B0), (1B0, 0RECV_B0), (1B0 late, ...)
@pytest.mark.parametrize("rank1_ms, rank0_ms", [(5, 9), (18, 20), (30, 20), (36, 20)])
def test_a_log_stopping_with_no_evidence_either_way_says_it_cannot_tell(
    tmp_path, rank1_ms, rank0_ms
):
    run = HandRun().cut(1, at(1, rank1_ms)).cut(0, at(1, rank0_ms))  # the whole job vanished
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    assert not [f for f in of_kind(document, "rank_failed") if f["severity"] == "error"]
    stalls = of_kind(document, "rank_stalled")
    assert stalls and {f["details"]["terminal_state"] for f in stalls} == {"unknown"}
    for stall in stalls:
        assert "cannot tell" in stall["message"]


def test_a_watchdog_stall_inside_a_step_is_computing_for_a_positive_time(tmp_path):
    run = HandRun().cut(1, at(1, 30)).stall(1, at(1, 2030), abort_ms=at(1, 4030))
    run.cut(0, at(1, 20)).stall(0, at(1, 2020), abort_ms=at(1, 4020))
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    (stall,) = stalls_ending_at(document, 1)
    assert stall["details"]["terminal_state"] == "computing" and "still in 1B0" in stall["message"]
    assert re.search(r"open for at least 4\.\d+ s", stall["message"]), stall["message"]
    assert not of_kind(document, "rank_failed")


# -- 2. a torn last line after a clean end ---------------------------------------------------


@pytest.mark.parametrize("torn", [b'{"e":"run_end","t":18', b"{"])
def test_a_torn_run_end_after_the_end_of_run_clock_exchange_is_a_clean_end(tmp_path, torn):
    run = HandRun().drop(1, e="run_end").tear(1, torn)
    path = run.write(tmp_path / "run")
    assert main(["analyze", str(path), "--workers", "0"]) == 0
    document = analyze(load_run(path, workers=0)).to_json()
    assert [r["state"] for r in document["ranks"]] == ["finished", "finished"]
    assert not of_kind(document, "rank_failed")


def test_a_log_torn_before_the_end_of_run_clock_exchange_is_not_a_clean_end(tmp_path):
    run = HandRun(iterations=2).cut(1, at(1, 50)).tear(1)
    document = analyzed(run, tmp_path)
    assert document["ranks"][1]["state"] != "finished"


def test_every_log_stopping_at_once_with_nothing_recorded_is_one_finding(tmp_path):
    # both stop inside iteration 1 with nothing open (what was open dropped): no hang to
    # tell of, and no rank went on
    run = HandRun().cut(0, at(1, 20)).drop(0, e="step_begin", step="0RECV_B0", it=1)
    run.drop(0, e="p2p_post", op="recv", it=1).cut(1, at(1, 30)).drop(1, step="1B0", it=1)
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    assert not of_kind(document, "rank_stalled") and not of_kind(document, "deadlock")
    (together,) = [f for f in of_kind(document, "rank_failed") if len(f["ranks"]) == 2]
    assert together["severity"] == "error" and together["details"]["spread_ns"] == 10_000_000
    assert together["message"].startswith("every rank's log stops within 10.0 ms")
    assert "killed at once" in together["cause"]
    apart = analyzed(HandRun().cut(0, at(1, 12)), tmp_path / "apart")  # rank 1 went on
    assert not [f for f in of_kind(apart, "rank_failed") if len(f["ranks"]) == 2]


def test_every_log_stopping_between_iterations_is_a_recording_never_closed(tmp_path):
    document = analyzed(HandRun().cut(0, at(1, 61)).cut(1, at(1, 50)), tmp_path)
    (together,) = [f for f in of_kind(document, "rank_failed") if len(f["ranks"]) == 2]
    assert together["severity"] == "warning"
    assert (
        "every rank had ended iteration 1 and had nothing open: the script ended without "
        "closing the recording" in together["cause"]
    )


def test_a_stall_the_run_went_on_from_is_a_warning_naming_the_step_it_waited_for(tmp_path):
    document = analyzed(HandRun().stall(0, at(0, 30)), tmp_path)  # rank 0's watchdog, once
    assert_told_right(document)
    assert not of_kind(document, "rank_stalled") and not of_kind(document, "rank_failed")
    (recovered,) = of_kind(document, "stall_recovered")
    assert recovered["severity"] == "warning" and recovered["ranks"] == [0]
    assert recovered["iterations"] == [0]
    assert recovered["details"]["longest"] == {
        "rank": 1,
        "step": "1B0",
        "duration_ns": 14 * MS,
        "between_steps": False,
    }
    assert recovered["message"].endswith(
        "then went on: the longest step then was 1B0 on rank 1, 14.0 ms"
    )
    cut = analyzed(HandRun().cut(0, at(0, 31)).stall(0, at(0, 30)), tmp_path / "cut")
    assert not of_kind(cut, "stall_recovered")  # rank 0 made no progress after it
    odd = HandRun().add(0, at(0, 30), "stall", idle_s="long", stacks={}, open_steps=[])
    (told,) = of_kind(analyzed(odd, tmp_path / "odd"), "stall_recovered")  # no traceback
    assert told["details"]["stalls"][0]["idle_s"] == 0.0


def test_an_unmatched_recv_blames_no_damage_on_its_own_cut_log(tmp_path):
    run = HandRun()
    for op in run.events[0]:  # rank 0 runs 0SEND_F0 of iteration 1 without posting it
        if op["e"] == "p2p_post" and op["it"] == 1 and op["op"] == "send":
            run.drop(0, id=op["id"])
    run.cut(1, at(1, 5))  # rank 1 waits in 1RECV_F0 until the job is killed: its log is cut
    document = analyzed(run, tmp_path)
    unmatched = of_kind(document, "unmatched_recv")
    assert unmatched and unmatched[0]["ranks"] == [1, 0]
    assert "damage in the log" not in unmatched[0]["cause"]  # rank 0's log is intact


def test_an_idle_rank_its_peers_stalled_on_with_no_connection_closed_is_hung(tmp_path):
    """A frozen process (SIGSTOP) between steps: its peers' watchdogs stall waiting and end
    them, and nobody's connection to it closes; a dead one's would have."""
    run = HandRun().cut(1, at(0, 50))  # rank 1 stops between iterations, nothing open
    run.cut(0, at(1, 11)).stall(0, at(1, 2000), abort_ms=at(1, 4000))  # in 0SEND_F0
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    (stall,) = stalls_ending_at(document, 1)
    assert stall["details"]["terminal_state"] == "hung"
    assert "no peer's connection to it closed" in stall["message"]
    assert not [f for f in of_kind(document, "rank_failed") if f["ranks"] == [1]]


def _stall(run: HandRun, rank: int, ms: float, idle_ms: float) -> HandRun:
    return run.add(rank, ms, "stall", idle_s=idle_ms / 1000, stacks={}, open_steps=[])


def test_a_recovered_stall_names_the_quiet_ranks_gap_between_its_steps(tmp_path):
    # rank 0 waits in iteration 0 from 44 ms on; rank 1 did nothing between 42 and 101 ms
    document = analyzed(_stall(HandRun(), 0, at(0, 59), 16), tmp_path)
    (recovered,) = of_kind(document, "stall_recovered")
    assert recovered["message"].endswith(
        "rank 1 made no progress between its steps for 59.0 ms, until 1RECV_F0"
    )
    assert recovered["details"]["longest"]["between_steps"] is True


def test_a_recovered_stall_says_nothing_of_how_the_log_ends(tmp_path):
    """The job vanishes later: the ranks' ends are read as before the stall, which is told
    apart (it had made the stalled rank "stalled" and its peers' hang)."""
    run = _stall(HandRun(), 0, at(0, 59), 16).cut(0, at(1, 61)).cut(1, at(1, 50))
    document = analyzed(run, tmp_path)
    assert [r["state"] for r in document["ranks"]] == ["ended", "ended"]
    assert not of_kind(document, "rank_stalled") and of_kind(document, "stall_recovered")
    (together,) = [f for f in of_kind(document, "rank_failed") if len(f["ranks"]) == 2]
    assert together["severity"] == "warning"


def test_overlapping_stalls_in_two_iterations_are_one_episode(tmp_path):
    run = _stall(_stall(HandRun(), 0, at(0, 59), 16), 1, at(1, 5), 60)
    (recovered,) = of_kind(analyzed(run, tmp_path), "stall_recovered")
    assert recovered["ranks"] == [0, 1] and recovered["iterations"] == [0, 1]


# -- 3. a rank that finished its plan and waits in the end-of-run clock exchange --------------


def test_a_chain_ending_at_a_rank_waiting_in_the_end_of_run_exchange_ends_at_exited(tmp_path):
    exchange = "the end-of-run clock exchange"
    run = HandRun()
    # rank 0 ran 0SEND_F0 of iteration 1 without posting it, finished, and waits at the end
    for op in run.events[0]:
        if op["e"] == "p2p_post" and op["it"] == 1:
            run.drop(0, id=op["id"])
    run.drop(0, e="run_end").drop(0, e="clock", phase="end")
    run.stall(0, at(2, 2000), abort_ms=at(2, 4000), waiting_in=exchange)
    # rank 1 waits for it in 1RECV_F0
    run.cut(1, at(1, 5)).stall(1, at(1, 2000), abort_ms=at(1, 4000))
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    (stall,) = stalls_ending_at(document, 0)
    assert stall["details"]["chain"] == [1, 0] and stall["details"]["terminal_state"] == "exited"
    assert exchange in stall["message"] and "died" not in stall["cause"]


def test_a_rank_that_left_its_loop_an_iteration_early_is_told_as_such(tmp_path):
    exchange = "the end-of-run clock exchange"
    run = HandRun().drop(0, it=1).drop(0, e="run_end").drop(0, e="clock", phase="end")
    run.stall(0, at(1, 2000), abort_ms=at(1, 4000), waiting_in=exchange)
    run.cut(1, at(1, 5)).stall(1, at(1, 2000), abort_ms=at(1, 4000))
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    (stall,) = stalls_ending_at(document, 0)
    assert stall["details"]["terminal_state"] == "exited"
    assert (
        "rank 0 left its training loop after 1 iteration(s) and waits in the end-of-run clock "
        "exchange; it never began iteration 1" in stall["message"]
    )
    assert "different numbers of iterations" in stall["cause"]


# -- 4. a crash inside a recv ----------------------------------------------------------------


@pytest.mark.parametrize("peer_ends", ["connection closed", "watchdog"])
def test_a_crash_inside_a_recv_ends_the_chain_at_the_crashed_rank(tmp_path, peer_ends):
    run = HandRun().cut(1, at(1, 2)).raises(1, at(1, 5), "RuntimeError: boom in the recv")
    run.cut(0, at(1, 11))  # its send is posted (at 10 ms) after the crash
    if peer_ends == "connection closed":
        run.raises(0, at(1, 60), CLOSED)
    else:
        run.stall(0, at(1, 2000), abort_ms=at(1, 4000))
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    assert not [
        f for f in of_kind(document, "rank_stalled") if f["details"]["terminal_state"] == "transfer"
    ]
    (stall,) = of_kind(document, "rank_stalled")
    assert stall["details"]["chain"] == [0, 1]
    assert stall["details"]["terminal_rank"] == 1
    assert stall["details"]["terminal_state"] == "crashed"
    failed = [f for f in of_kind(document, "rank_failed") if f["severity"] == "error"]
    assert [f["ranks"] for f in failed] == [[1]] and "in 1RECV_F0" in failed[0]["message"]


# -- 5. steps rebuilt from a stall record ----------------------------------------------------


@pytest.mark.parametrize("with_iteration", [True, False], ids=["it", "old-format"])
def test_a_step_rebuilt_from_a_stall_record_keeps_its_iteration(tmp_path, with_iteration):
    run = HandRun().cut(1, at(1, 30))
    open_steps = run.open_steps(1, with_iteration=with_iteration)
    run.drop(1, e="step_begin", step="1B0", it=1)  # its begin was lost; the stall lists it
    run.add(1, at(1, 2030), "stall", idle_s=2.0, stacks={}, open_steps=open_steps, inflight=[])
    run.cut(0, at(1, 20)).stall(0, at(1, 2020))
    path = run.write(tmp_path / "run")
    loaded = load_run(path, workers=0)
    rank = loaded.ranks[1]
    rebuilt = [
        int(it)
        for it, code, end in zip(rank.steps.it, rank.steps.code, rank.steps.end)
        if loaded.catalog.texts[int(code)] == "1B0" and end == -1
    ]
    assert rebuilt == [1]
    document = analyze(loaded).to_json()
    assert_told_right(document)
    assert not of_kind(document, "plan_divergence")


# -- 6. messages without holes ---------------------------------------------------------------


def test_a_crash_before_the_first_step_is_said_so(tmp_path):
    run = HandRun().cut(1, 0.6).raises(1, 0.8, "RuntimeError: bad config")
    run.cut(0, at(0, 11)).raises(0, at(0, 30), CLOSED)
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    (failed,) = [f for f in of_kind(document, "rank_failed") if f["ranks"] == [1]]
    assert "before its first step" in failed["message"]
    assert failed["steps"] == [] and failed["details"]["last_step"] is None
    for stall in stalls_ending_at(document, 1):
        assert "before its first step" in stall["message"]


def test_a_crash_between_iterations_is_placed_after_the_last_step(tmp_path):
    run = HandRun().cut(1, at(0, 50)).raises(1, at(0, 70), "RuntimeError: checkpoint failed")
    run.cut(0, at(1, 11)).raises(0, at(1, 60), CLOSED)
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    (failed,) = [f for f in of_kind(document, "rank_failed") if f["ranks"] == [1]]
    assert "after 1SEND_B0" in failed["message"] and "in 1SEND_B0" not in failed["message"]
    assert failed["iterations"] == [0] and failed["steps"][0]["note"] == "last step run"


# -- 7. a terminating signal after a hang, or after a silent death ---------------------------


def _sigterm(run: HandRun, rank: int, ms: float) -> HandRun:
    return run.add(rank, ms, "signal", signal="SIGTERM", open_steps=run.open_steps(rank))


def test_a_sigterm_that_ends_a_hang_leaves_the_hang_the_finding(tmp_path):
    # rank 1 hangs in 1F0 (its watchdog says so), rank 0 waits for its gradient; a time limit
    # then ends both with SIGTERM: the hang is the news, not the signals
    run = HandRun().cut(1, at(1, 15)).stall(1, at(1, 2015))
    run.cut(0, at(1, 20)).stall(0, at(1, 2020))
    _sigterm(_sigterm(run, 0, at(1, 30_000)), 1, at(1, 30_010))
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    assert not [f for f in of_kind(document, "rank_failed") if f["severity"] == "error"]
    (stall,) = of_kind(document, "rank_stalled")
    assert stall["details"]["chain"] == [0, 1]
    assert stall["details"]["terminal_state"] == "computing"
    assert "1F0" in stall["message"]


def test_a_rank_idle_while_its_peer_stalled_waiting_hung_before_the_sigterm(tmp_path):
    # rank 0 stops moving between iterations (no watchdog outside steps); rank 1 waits in
    # 1RECV_F0 of iteration 1 and its watchdog says so; then SIGTERM ends both
    run = HandRun().cut(0, at(0, 61)).cut(1, at(1, 2)).stall(1, at(1, 2002))
    _sigterm(_sigterm(run, 1, at(1, 30_000)), 0, at(1, 30_010))
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    assert not [f for f in of_kind(document, "rank_failed") if f["severity"] == "error"]
    (stall,) = of_kind(document, "rank_stalled")
    assert stall["details"]["chain"] == [1, 0]
    assert stall["details"]["terminal_state"] == "hung"
    assert "rank 1 stalled (watchdog) waiting" in stall["message"]


def test_a_log_that_stops_before_a_peer_records_sigterm_is_the_rank_that_died(tmp_path):
    # torchrun ends the other ranks with SIGTERM when one dies; a live rank records it
    run = HandRun().cut(1, at(1, 20))
    _sigterm(run.cut(0, at(1, 35)), 0, at(1, 200))
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    failed = {f["ranks"][0]: f for f in of_kind(document, "rank_failed")}
    assert failed[1]["severity"] == "error" and "it died first" in failed[1]["cause"]
    assert failed[0]["severity"] == "warning" and "follows rank 1's failure" in failed[0]["cause"]


def test_an_error_the_framework_wrapped_is_named_by_the_users_own(tmp_path):
    # torch.distributed.pipelining re-raises a stage's error as an indented multi-line text
    wrapped = "\n    [Stage 1] failed to run forward:\n    args: ()\n    "
    run = HandRun().cut(1, at(1, 15)).raises(1, at(1, 16), wrapped)
    event = run.events[1][-1]
    event["traceback"] = (
        'Traceback (most recent call last):\n  File "train.py", line 7, in forward\n'
        "ValueError: my model broke\n\nThe above exception was the direct cause of the "
        'following exception:\n\nTraceback (most recent call last):\n  File "stage.py", '
        f"line 900, in forward_one_chunk\nRuntimeError: {wrapped}\n"
    )
    run.cut(0, at(1, 20)).raises(0, at(1, 80), CLOSED)
    document = analyzed(run, tmp_path)
    (failed,) = [f for f in of_kind(document, "rank_failed") if f["severity"] == "error"]
    assert failed["message"] == "rank 1 raised ValueError: my model broke in 1F0"
    assert 'File "train.py", line 7, in forward' in failed["cause"]
    assert "re-raised as RuntimeError: [Stage 1] failed to run forward: args: ()" in failed["cause"]
    assert "\n" not in failed["details"]["error"]


def test_a_sigterm_on_a_rank_that_was_not_watched_is_the_end_of_the_job_not_a_cause(tmp_path):
    # rank 1 hangs in 1F0 (watchdog); rank 0, waiting for it, recorded no stall of its own
    # (its watchdog was off); the time limit's SIGTERM ends them
    run = HandRun().cut(1, at(1, 15)).stall(1, at(1, 2015)).cut(0, at(1, 20))
    _sigterm(_sigterm(run, 0, at(1, 30_000)), 1, at(1, 30_010))
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    (failed,) = of_kind(document, "rank_failed")
    assert failed["ranks"] == [0] and failed["severity"] == "warning"
    assert "the job was ended while rank 1 hung" in failed["cause"]
    (stall,) = of_kind(document, "rank_stalled")
    assert stall["details"]["terminal_state"] == "computing"


# -- 8. overlap mode: a compute step whose recv is still open ---------------------------------


@pytest.mark.parametrize(
    "innermost, terminal",
    [
        ("train.py:7 in forward: spin()", "computing"),  # stuck in its own code
        ("/x/pipetrace/runtime/p2p_common.py:230 in complete: work.wait()", "transfer"),
    ],
    ids=["own-code", "in-the-wait"],
)
def test_the_stall_stack_tells_a_compute_step_stuck_before_its_recv_wait(
    tmp_path, innermost, terminal
):
    # overlap mode waits a step's recv inside the step: rank 1 sits in 1F0 with 1RECV_F0
    # posted and never completed; where its main thread stands tells which it waits on
    run = HandRun().cut(1, at(1, 15))
    recv = next(e for e in run.events[1] if e["e"] == "p2p_post" and e["it"] == 1)
    run.events[1] = [e for e in run.events[1] if e.get("id") != recv["id"] or e is recv]
    run.stall(1, at(1, 2015))
    run.events[1][-1]["stacks"] = {"MainThread (1)": ["train.py:1 in main: step()", innermost]}
    run.cut(0, at(1, 20)).stall(0, at(1, 2020))
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    states = {f["details"]["terminal_state"] for f in of_kind(document, "rank_stalled")}
    assert terminal in states


def test_a_rank_stalled_outside_its_steps_on_device_work_names_that_work(tmp_path):
    """On a GPU the host enqueues and goes on: a rank whose device never finishes a kernel
    stalls outside any step, later, where it waits for the device. Its watchdog's
    `device_pending` names the kernel, and the hang's cause says so."""
    pending = {"id": 7, "step": "1B0", "stream": "compute", "enqueued_t": 0, "age_s": 41.0}
    run = (
        HandRun()
        .cut(1, at(0, 50))
        .stall(1, at(0, 2000), device_pending=[pending | {"started": True}])
    )
    run.cut(0, at(1, 11)).stall(0, at(1, 2000), abort_ms=at(1, 4000))  # in 0SEND_F0
    document = analyzed(run, tmp_path)
    (stall,) = stalls_ending_at(document, 1)
    assert stall["details"]["terminal_state"] == "hung"
    assert stall["cause"].startswith(
        "rank 1 waits on its device: 1B0 enqueued 41 s ago, started on the device but never "
        "completed (a kernel that never ends"
    ), stall["cause"]


def test_ranks_whose_devices_wait_on_a_transfer_chain_to_the_kernel_that_never_ends(tmp_path):
    """NCCL's host waits return at once: every rank's host finishes its steps and stalls
    later, outside them. The device work pending says who waits for whom: rank 0's device
    on 0RECV_B0 from rank 1, whose device never finishes 1B0. One chain, one error."""

    def pending(step: str, stream: str) -> list[dict]:
        return [{"id": 1, "step": step, "stream": stream, "enqueued_t": 0, "age_s": 30.0}]

    run = HandRun().cut(0, at(0, 61)).cut(1, at(0, 50))
    run.stall(0, at(0, 2000), device_pending=pending("0RECV_B0", "p2p"))
    run.stall(1, at(0, 2000), device_pending=pending("1B0", "compute"))
    document = analyzed(run, tmp_path)
    (stall,) = of_kind(document, "rank_stalled")
    assert stall["severity"] == "error" and stall["details"]["chain"] == [0, 1]
    assert stall["message"].startswith(
        "stalled: rank 0 in 0RECV_B0 on its device: recv from rank 1"
    )
    assert stall["cause"].startswith("rank 1 waits on its device: 1B0 enqueued 30 s ago")


def test_mindspores_recv_failed_is_a_wait_that_gave_up_not_a_root_cause(tmp_path):
    """MindSpore's CPU collectives end a P2P wait past MS_CPU_COMM_OP_TIMEOUT with "Recv
    failed.": rank 0's error is the hang's symptom, and the frozen rank 1 is named."""
    run = HandRun().cut(1, at(1, 30))  # rank 1 frozen inside 1B0 of iteration 1
    run.cut(0, at(1, 25)).raises(0, at(1, 8000), "Recv failed.")  # in 0RECV_B0
    document = analyzed(run, tmp_path)
    errors = [f for f in document["findings"] if f["severity"] == "error"]
    assert [f["kind"] for f in errors] == ["rank_stalled"], errors
    assert errors[0]["details"]["terminal_rank"] == 1
    (failed,) = of_kind(document, "rank_failed")
    assert failed["severity"] == "warning" and "a P2P wait gave up" in failed["cause"]


def test_a_log_cut_short_of_a_rank_that_ran_to_the_end_is_no_death(tmp_path):
    """Its peers completed the end-of-run clock exchange, which waits for every rank: the
    rank ran to the end and only its log lost its last part (a full disk, a cut file). It
    read as a rank that died without a trace, an error, with the rest of the job named."""
    from pipetrace.analyze import endings
    from pipetrace.testing.cluster import FakeCluster

    FakeCluster.of(ranks=4, iterations=3).record(tmp_path)
    log = tmp_path / "rank-00002.ndjson"
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b"".join(lines[: len(lines) // 2]))
    run = load_run(tmp_path, workers=0)
    document = analyze(run).to_json()
    assert not [f for f in document["findings"] if f["severity"] != "info"], document["findings"]
    assert any("rank-00002.ndjson ends at" in p["message"] for p in document["input_problems"])
    verdict = endings.rank_endings(run)[2]
    assert verdict.state == endings.EXITED and "rank 0 completed the end-of-run clock" in (
        verdict.evidence
    )


def test_a_death_whose_last_records_were_lost_is_placed_where_the_peer_saw_it(tmp_path):
    """Rank 1's log ends in iteration 0 (a kill before its flush), yet rank 0 completed both
    messages of iteration 1 with it: it is said to have run on, in iteration 1."""
    run = HandRun(iterations=3).cut(1, at(0, 39))
    run.cut(0, at(1, 45)).raises(0, at(1, 80), CLOSED)
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    (died,) = [f for f in of_kind(document, "rank_failed") if f["ranks"] == [1]]
    assert "its last records were lost: it ran on into iteration 1" in died["message"]
    assert "rank 0 completed 0RECV_B0 with it (iteration 1)" in died["cause"]
    assert died["iterations"] == [1]


def test_the_ranks_waiting_at_the_end_for_a_hung_rank_are_one_consequence(tmp_path):
    """Rank 1 hangs inside the last iteration (its watchdog says so) while rank 0 finished
    and waits in the end-of-run exchange: that wait follows from the hang told first, not
    from a rank stopped outside its iterations."""
    exchange = "the end-of-run clock exchange"
    run = HandRun().drop(0, e="run_end").drop(0, e="clock", phase="end")
    run.stall(0, at(2, 2000), abort_ms=at(2, 4000), waiting_in=exchange)
    run.cut(1, at(1, 30)).stall(1, at(1, 2030), abort_ms=at(1, 4030))
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    (at_end,) = [f for f in of_kind(document, "rank_stalled") if "waiting_in" in f["details"]]
    assert at_end["severity"] == "warning"
    assert "rank 1 never left its iterations: it is in the hang told above" in at_end["cause"]
    assert [f for f in of_kind(document, "rank_stalled") if f["severity"] == "error"]


def test_a_hung_rank_whose_last_records_were_lost_says_where_its_peers_saw_it(tmp_path):
    """Rank 1 frozen (SIGSTOP) and killed: its log ends in iteration 0 (the tail unflushed),
    yet rank 0 completed 0SEND_F0 of iteration 1 with it before stalling in 0RECV_B0."""
    run = HandRun(iterations=3).cut(1, at(0, 45))
    run.cut(0, at(1, 20)).stall(0, at(1, 2020), abort_ms=at(1, 4020))
    document = analyzed(run, tmp_path)
    assert_told_right(document)
    (stall,) = stalls_ending_at(document, 1)
    assert "(iteration 0)" in stall["message"]
    assert (
        "its last records were lost: rank 0 completed 0SEND_F0 with it in iteration 1"
        in (stall["message"])
    )
    assert "it never ran 1SEND_B0 of iteration 1" in stall["message"]


def test_logs_that_stop_together_while_their_processes_run_are_no_kill(tmp_path):
    """Both logs stop at once, as a run in progress looks between flushes; the headers name
    a process that still runs here (this one): not a script that ended without closing."""
    import os
    import socket

    path = HandRun(iterations=3).cut(0, at(1, 62)).cut(1, at(1, 62)).write(tmp_path / "run")
    for log in path.glob("rank-*.ndjson"):
        header, rest = log.read_bytes().split(b"\n", 1)
        live = {**json.loads(header), "pid": os.getpid(), "host": socket.gethostname()}
        log.write_bytes(json.dumps(live).encode() + b"\n" + rest)
    document = analyze(load_run(path, workers=0)).to_json()
    (together,) = [f for f in of_kind(document, "rank_failed") if f["ranks"] == [0, 1]]
    assert together["severity"] == "info" and "still being recorded" in together["cause"]
