"""The device timer against a fake device with controlled times (no GPU needed)."""

from __future__ import annotations

import dataclasses
import queue
import subprocess
import sys
import threading
import time

import pytest

from pipetrace.recorder.clock import align_clocks
from pipetrace.recorder.device.anchor import Anchor
from pipetrace.recorder.device.classify import Boundness, classify
from pipetrace.recorder.device.spans import DeviceSpan
from pipetrace.recorder.device.timer import DeviceTimer, TimerSettings
from pipetrace.testing.fake_device import NEVER, FakeClock, FakeDevice, FakeStream, ShiftedClock

MS = 1_000_000
S = 1_000_000_000


class Session:
    """A started timer on a fake device, collecting the spans it resolves."""

    def __init__(
        self, *, drift_ppm: float = 0.0, clock: FakeClock | ShiftedClock | None = None, **settings
    ):
        self.clock = clock or FakeClock()
        self.device = FakeDevice(self.clock, drift_ppm=drift_ppm)
        self.compute = self.device.new_stream()
        self.p2p = self.device.new_stream()
        self.spans: list[DeviceSpan] = []
        self.anchors: list[Anchor] = []
        self.timer = DeviceTimer(
            self.device,
            now_ns=self.clock.now_ns,
            on_span=self.spans.append,
            on_anchor=self.anchors.append,
            settings=TimerSettings(**settings),
        )
        self.timer.start()

    def step(
        self, key: int, label: str, *, kernel_ns: float, host_ns: int = 10_000, stream=None
    ) -> tuple[int, int]:
        """Enqueue one step's kernel; returns the true host times of its device begin/end."""
        stream = stream or self.compute
        token = self.timer.begin(key, label, stream, "p2p" if stream is self.p2p else "compute")
        begin = max(stream.busy_until, self.device.device_now())
        self.clock.advance(host_ns)
        stream.launch(kernel_ns)
        end = stream.busy_until
        self.timer.end(token)
        return self.device.host_time_of(begin), self.device.host_time_of(end)


def test_events_are_reused_from_a_bounded_pool():
    session = Session()
    for iteration in range(100):
        for i in range(10):
            session.step(iteration * 10 + i, f"0F{i}", kernel_ns=100_000)
        session.clock.advance(5 * MS)
        assert session.timer.poll() == 10
    assert len(session.spans) == 1000
    assert session.timer.events_created <= 2 * 10  # one pair per step in flight


def test_a_hung_device_never_grows_the_pool_past_its_bound():
    session = Session(max_in_flight=8)
    session.compute.launch(NEVER)
    for i in range(20):
        session.step(i, f"0F{i}", kernel_ns=1_000)
    session.clock.advance(60 * S)
    assert session.timer.poll() == 0
    assert session.timer.events_created == 16
    assert session.timer.untimed == 12


def test_nothing_is_resolved_before_the_device_completes_it():
    session = Session()
    begin, end = session.step(7, "1F3", kernel_ns=5 * MS)
    assert session.timer.poll() == 0
    session.clock.advance(4 * MS)
    assert session.timer.poll() == 0 and session.spans == []
    session.clock.advance(2 * MS)
    assert session.timer.poll() == 1
    (span,) = session.spans
    assert (span.key, span.label, span.stream) == (7, "1F3", "compute")
    assert abs(span.device_begin_ns - begin) <= span.uncertainty_ns + 1_000
    assert abs(span.device_end_ns - end) <= span.uncertainty_ns + 1_000


def test_each_stream_resolves_on_its_own():
    session = Session()
    session.step(1, "0F0", kernel_ns=50 * MS)
    session.step(2, "0SEND_F0", kernel_ns=1 * MS, stream=session.p2p)
    session.clock.advance(2 * MS)
    session.timer.poll()
    assert [span.label for span in session.spans] == ["0SEND_F0"]
    assert session.spans[0].stream == "p2p"


def test_the_training_thread_never_synchronizes():
    session = Session(poll_interval_s=0.001, reanchor_s=0.5)
    syncs_at_start = len(session.device.syncs)
    for i in range(50):
        session.step(i, f"0F{i}", kernel_ns=2 * MS)
        session.clock.advance(100 * MS)  # re-anchors fall due on the poller's side
    session.timer.start_poller()
    deadline = time.monotonic() + 10
    while len(session.spans) < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    session.timer.close()
    assert len(session.spans) == 50
    after_start = session.device.syncs[syncs_at_start:]
    assert after_start, "the poller should have re-anchored"
    assert threading.main_thread().name not in after_start


def test_drift_is_corrected_within_the_stated_bound():
    drift_ppm = 50.0
    corrected = Session(drift_ppm=drift_ppm, reanchor_s=1.0)
    uncorrected = Session(drift_ppm=drift_ppm, reanchor_s=1.0)
    worst = {id(corrected): 0, id(uncorrected): 0}
    for second in range(60):
        corrected.timer.reanchor()  # what the poller does every reanchor_s
        for session in (corrected, uncorrected):
            session.clock.advance(S - 2 * MS)
            begin, end = session.step(second, f"0F{second}", kernel_ns=1 * MS)
            session.clock.advance(2 * MS)
            session.timer.poll()
            span = session.spans[-1]
            if second >= 2:  # the first interval assumes rate 1 (see the anchor module)
                error = max(abs(span.device_begin_ns - begin), abs(span.device_end_ns - end))
                worst[id(session)] = max(worst[id(session)], error)
    uncertainty = corrected.spans[-1].uncertainty_ns
    bound = 3 * uncertainty + 1_000  # three anchor uncertainties + float32 and rounding
    assert worst[id(corrected)] <= bound
    assert worst[id(uncorrected)] > 50 * bound  # 50 ppm over a minute: ~3 ms


def test_device_times_map_to_rank_0_clock_through_the_recorded_offset():
    true_time = FakeClock(tick_ns=2_000)
    clocks = {0: true_time.shifted(0), 1: true_time.shifted(3_700_000)}  # rank 1 runs ahead
    inboxes = {0: queue.Queue(), 1: queue.Queue()}

    def exchange(me: int):
        def send_ints(peer: int, values: list[int]) -> None:
            inboxes[peer].put(values)

        def recv_ints(peer: int, count: int) -> list[int]:
            return inboxes[me].get(timeout=10)

        return send_ints, recv_ints

    measured = {}

    def align(rank: int) -> None:
        send_ints, recv_ints = exchange(rank)
        measured[rank] = align_clocks(
            rank=rank,
            world_size=2,
            now_ns=clocks[rank].now_ns,
            send_ints=send_ints,
            recv_ints=recv_ints,
        )

    peer = threading.Thread(target=align, args=(1,))
    peer.start()
    align(0)
    peer.join()
    session = Session(clock=clocks[1], drift_ppm=20.0)
    begin_rank1, _ = session.step(0, "1F0", kernel_ns=1 * MS)
    session.clock.advance(2 * MS)
    session.timer.poll()
    (span,) = session.spans
    on_rank0 = span.device_begin_ns - measured[1].offset_ns
    truth_on_rank0 = begin_rank1 - clocks[1].offset_ns
    assert abs(on_rank0 - truth_on_rank0) <= measured[1].uncertainty_ns + span.uncertainty_ns


def test_work_the_device_never_completed_is_reported_with_its_age():
    session = Session()
    session.step(1, "3F5", kernel_ns=1 * MS)
    session.p2p.launch(NEVER)  # an earlier transfer on the P2P stream hangs
    session.step(2, "3SEND_B5", kernel_ns=1 * MS, stream=session.p2p)
    session.clock.advance(41 * S)
    session.timer.poll()
    (pending,) = session.timer.pending()
    assert (pending.key, pending.stream, pending.started) == (2, "p2p", False)
    assert pending.describe() == "3SEND_B5 enqueued 41 s ago, never completed on the device"


def test_work_stuck_inside_its_own_kernel_is_reported_as_started():
    session = Session()
    session.step(1, "2B4", kernel_ns=NEVER)
    session.clock.advance(12 * S)
    (pending,) = session.timer.pending()
    assert pending.started
    assert pending.describe() == "2B4 enqueued 12 s ago, started on the device but never completed"
    moment = dataclasses.replace(pending, age_ns=300_000)  # a crash lists work a moment old
    assert moment.describe().startswith("2B4 enqueued 300 µs ago")


def test_a_step_whose_kernels_ran_long_after_it_was_enqueued_is_device_bound():
    session = Session()
    session.step(1, "0F0", kernel_ns=20 * MS, host_ns=30_000)
    session.clock.advance(30 * MS)
    session.step(2, "0F1", kernel_ns=10_000, host_ns=1 * MS)  # the host is the slow side
    session.clock.advance(1 * MS)
    session.timer.poll()
    kinds = {span.label: classify(span) for span in session.spans}
    assert kinds == {"0F0": Boundness.DEVICE, "0F1": Boundness.LAUNCH}


def test_timing_before_the_first_anchor_is_refused():
    clock = FakeClock()
    device = FakeDevice(clock)
    timer = DeviceTimer(device, now_ns=clock.now_ns, on_span=lambda span: None)
    with pytest.raises(RuntimeError, match="before start"):
        timer.begin(0, "0F0", FakeStream(device))


def test_a_rate_is_measured_only_over_at_least_half_the_reanchor_interval():
    session = Session(drift_ppm=50.0, reanchor_s=1.0)
    session.clock.advance(S // 4)
    assert session.timer.reanchor().rate == 1.0
    session.clock.advance(S)
    previous, anchor = session.anchors[-1], session.timer.reanchor()
    measurement_error = (previous.uncertainty_ns + anchor.uncertainty_ns) / S
    assert abs(anchor.rate - 1 / (1 + 50e-6)) <= measurement_error
    assert [anchor.index for anchor in session.anchors] == [0, 1, 2]


def test_the_device_package_imports_torch_only_when_a_cuda_backend_is_asked_for():
    modules = ("anchor", "classify", "cuda", "pool", "protocol", "spans", "timer")
    code = (
        "import sys\n"
        + "".join(f"import pipetrace.recorder.device.{name}\n" for name in modules)
        + "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
