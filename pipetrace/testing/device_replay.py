"""A fake-cluster run recorded with device timing on fake devices (no GPU needed).

The fake cluster (`pipetrace.testing.cluster`) says when each step starts and ends on the
host; here every rank's Recorder also has a `FakeDevice` on the same virtual clock, and each
step launches a kernel on the device's compute stream when it begins (each P2P op a transfer
on its P2P stream when posted), taking what ``kernel_ns`` says. A kernel longer than its
step's host time makes the device fall behind the host (device-bound steps); `NEVER` makes
it hang, so everything queued after it on that stream never completes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipetrace.recorder.device.timer import TimerSettings
from pipetrace.recorder.recorder import Recorder
from pipetrace.schedule.ir import Step, format_step
from pipetrace.testing.cluster import FakeCluster
from pipetrace.testing.fake_device import NEVER, FakeDevice
from pipetrace.testing.replay import Player, VirtualClock

KernelTime = Callable[[int, int, str], float]
"""(rank, iteration, step text) -> device ns of the step's kernel."""
TRANSFER_NS = 500
SLOW_F_NS = 3_000_000
"""The device time of rank 1's forwards in `slow_forward_on_rank_1`."""


def quick(rank: int, iteration: int, text: str) -> float:
    """Kernels that keep up with the host: a quarter of a compute step, 1 µs per P2P step."""
    return 1_000 if "SEND" in text or "RECV" in text else 250_000


def slow_forward_on_rank_1(rank: int, iteration: int, text: str) -> float:
    """As `quick`, but rank 1's forwards take the device `SLOW_F_NS` (device-bound)."""
    return SLOW_F_NS if rank == 1 and text.startswith("1F") else quick(rank, iteration, text)


class _VirtualTime:
    """A `VirtualClock` as the fake device reads it (``t``, ``advance``)."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock

    @property
    def t(self) -> int:
        return self.clock.now

    def advance(self, ns: int) -> None:
        self.clock.now += ns


class _DeviceRecorder:
    """The player's recorder: a real Recorder with a fake device, launching the device work
    of each step and P2P op between the recorder's device begin and end marks. A recv's
    transfer ends when its data arrives, as an NCCL recv kernel waits for its send: never
    before the peer's send began on its device."""

    def __init__(self, recorder: Recorder, device: FakeDevice, player: DevicePlayer):
        self.recorder = recorder
        self.device = device
        self.compute = device.new_stream()  # the first stream: the device's current stream
        self.p2p = device.new_stream()
        self.recvs = device.new_stream()  # sends never queue behind a recv waiting for data
        self.player = player
        self.rank = player.job.rank
        self.iteration = -1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.recorder, name)

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.recorder.begin_iteration(iteration)

    def begin_step(self, position: int, step: Step, thread: str = "main") -> Any:
        token = self.recorder.begin_step(position, step, thread)
        if not step.sub_steps:
            kernel_ns = self.player.kernel_ns(self.rank, self.iteration, format_step(step))
            self.compute.launch(kernel_ns)
        return token

    def end_run(self) -> None:
        """The device finishes the last iteration's work before the recorder's drain gives
        up (virtual time does not pass while it waits)."""
        busy = max(self.compute.busy_until, self.p2p.busy_until, self.recvs.busy_until)
        if busy != NEVER:
            self.clock.now = max(self.clock.now, int(self.device.host_time_of(busy)) + 1)
        self.recorder.end_run()

    def p2p_posted(self, **fields: Any) -> Any:
        arrives = self.player.arrives
        if fields["op"] == "recv" and arrives is not None:
            stream = self.recvs
            start = max(stream.busy_until, self.device.device_now())
            duration = max(TRANSFER_NS, self.device.device_time_of(arrives) - start)
        else:
            stream, duration = self.p2p, TRANSFER_NS
        token = self.recorder.p2p_posted(**fields, stream=stream)
        stream.launch(duration)
        self.recorder.p2p_enqueued(token)
        return token


class DevicePlayer(Player):
    """Plays a rank of the fake cluster into a Recorder that has a fake device."""

    def __init__(self, job: Any, kernel_ns: KernelTime) -> None:
        super().__init__(job)
        device = FakeDevice(_VirtualTime(self.clock))  # type: ignore[arg-type]
        recorder = Recorder(
            self.recorder.config,
            framework=self.run.framework,
            framework_version="0",
            clock=self.clock,
            device=device,
            device_timing=TimerSettings(poller=False),
        )
        self.kernel_ns = kernel_ns
        self.recorder = _DeviceRecorder(recorder, device, self)  # type: ignore[assignment]


def record_device_run(run_dir: Path, kernel_ns: KernelTime, **cluster: Any) -> None:
    """A 2-rank 1F1B run (4 micro-batches, 3 iterations unless ``cluster`` says otherwise)
    recorded with device timing."""
    options = {"ranks": 2, "microbatches": 4, "iterations": 3, **cluster}
    for job in FakeCluster.of(**options).jobs(str(run_dir)):
        DevicePlayer(job, kernel_ns).play()
