"""The device timeline on the simulated device (ccld_harness.simdev): events recorded on its
streams, mapped to the host's monotonic clock through the anchor, whatever the device's
epoch; events polled out of order or late; a device clock that jumps; an op the device
never reaches; a ring with no free event; a step's compute outside communication; and the
tracer reading a registered device through the same event interface as CUDA's.

The simulated device knows the true device time of every event (``SimEvent.device_ns``,
its clock an offset from the host's), so each mapped time is checked against the truth
within the error the timeline states for it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ccld_plugin._native as _native
from ccld_harness.simdev.device import SimClock, SimDevice
from ccld_plugin.agent.board_summary import BoardSnapshot, summarize_board
from ccld_plugin.board.reader import BoardReader
from ccld_plugin.tracing.device import DeviceKind, device_kind, register_device
from ccld_plugin.tracing.timeline import DeviceOp, DeviceTimeline
from ccld_plugin.wire.codes import (
    FLAG_ASYNC,
    FLAG_CUDA,
    FLAG_DEVICE,
    OP_CODES,
    STATE_DONE,
    STATE_IN_FLIGHT,
    TIME_EVENTS,
    TIME_WORK,
)

GID = 0xABC
OFFSET = 1_700_000_000_000_000_000  # the device counts from another epoch
MS = 1_000_000


class Rig:
    """A simulated device, a board with one group, and the timeline between them."""

    def __init__(self, tmp_path: Path, clock: SimClock, ring: int = 4096) -> None:
        self.clock = clock
        self.device = SimDevice(clock)
        anchor = self.device.new_stream("anchor")
        kind = DeviceKind("sim-unit", self.device.event, lambda: anchor)
        self.path = tmp_path / "rank0.board"
        self.board = _native.Board(str(self.path), 0, 2, "j", "h", 64, 4, 4, 16)
        self.slot = self.board.register_group(GID, 3, [0, 1], 0)
        self.timeline = DeviceTimeline(kind, self.board, self._exit, ring)
        self.events: dict[int, object] = {}  # slot -> the event, kept to read the truth

    def _exit(self, indices: tuple[int, ...], state: int) -> None:
        for i in indices:
            self.board.exit(i, state)

    def arrive(self, step: int = 0) -> int:
        slot = self.timeline.arrive(step)
        if slot >= 0:
            self.events[slot] = self.timeline._events[slot]
        return slot

    def op(self, kernel_ms: float = 1.0, step: int = 0) -> tuple[int, object, object]:
        """A blocking device op taking ``kernel_ms`` on the device; its board index and
        its two events."""
        index = self.board.enter(self.slot, OP_CODES["all_reduce"], FLAG_CUDA | FLAG_DEVICE, 64)
        pre = self.arrive(step)
        self.device.launch(None, kernel_ms / 1000)
        post = self.arrive(step)
        return index, DeviceOp((index,), step, pre, post), (self.events[pre], self.events[post])

    def truth(self, event: object) -> int:
        """The host time the device reached ``event``."""
        t = event.device_ns - self.clock.offset_ns  # type: ignore[attr-defined]
        jumped = self.clock.jump_ns and t - self.clock.jump_ns >= self.clock.jump_at_ns
        return t - self.clock.jump_ns if jumped else t

    def settle(self, until, timeout_s: float = 20.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            self.timeline.poll()
            if until():
                return
            time.sleep(0.002)
        raise AssertionError("the device timeline did not resolve")

    def mapped(self, index: int) -> bool:
        """Whether both device times of the op are the events' (not yet: none, or the
        provisional host times of a poll before the first anchor)."""
        return int(self.record(index)["dev_source"]) == TIME_EVENTS | TIME_EVENTS << 4

    def record(self, index: int):
        with BoardReader(self.path) as r:
            (rec,) = [o for o in r.ops() if int(o["index_lo"]) == index]
        return rec

    def close(self) -> None:
        self.device.close(join_s=0)  # a hung kernel's stream is left to end with the process
        self.board.close()


@pytest.fixture
def rig(tmp_path):
    made = []

    def make(clock: SimClock | None = None, ring: int = 4096) -> Rig:
        made.append(Rig(tmp_path, clock or SimClock(offset_ns=OFFSET), ring))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _mapped_within_error(rec, pre, post, rig: Rig) -> None:
    err = int(rec["dev_err_ns"])
    assert abs(int(rec["dev_start_ns"]) - rig.truth(pre)) <= err
    assert abs(int(rec["dev_end_ns"]) - rig.truth(post)) <= err


def test_an_op_is_mapped_to_the_host_clock_whatever_the_devices_epoch(rig):
    r = rig()
    r.device.launch(None, 0.02)  # the device is busy: the host runs ahead of it
    index, op, (pre, post) = r.op(kernel_ms=10)
    r.timeline.follow(op)
    r.settle(lambda: r.mapped(index))
    rec = r.record(index)
    assert rec["state"] == STATE_DONE
    _mapped_within_error(rec, pre, post, r)
    # the device reached the op after the host entered it (the host ran ahead)
    assert rec["dev_start_ns"] > rec["enter_ns"]


def test_events_polled_out_of_order_and_late_map_the_same(rig):
    r = rig()
    made = [r.op(kernel_ms=2) for _ in range(4)]
    r.device.compute.synchronize()  # all complete before the first poll: seen late
    for _, op, _ in reversed(made):  # handed over, and polled, newest first
        r.timeline.follow(op)
    r.settle(lambda: all(r.mapped(i) for i, _, _ in made))
    starts = []
    for index, _, (pre, post) in made:
        rec = r.record(index)
        _mapped_within_error(rec, pre, post, r)
        starts.append(int(rec["dev_start_ns"]))
    assert starts == sorted(starts)  # the device ran them in order


def test_a_device_clock_that_jumps_is_caught_and_the_anchor_taken_again(rig):
    jump_at = time.monotonic_ns() + 300 * MS
    r = rig(SimClock(offset_ns=OFFSET, jump_ns=50 * MS, jump_at_ns=jump_at))
    before, op, events = r.op()
    r.timeline.follow(op)
    r.settle(lambda: r.mapped(before))
    _mapped_within_error(r.record(before), *events, r)
    time.sleep(max(0.0, (jump_at - time.monotonic_ns()) / 1e9) + 0.05)
    jumped, op, events = r.op()
    r.timeline.follow(op)
    r.settle(lambda: r.mapped(jumped))
    assert r.timeline.jumps >= 1  # mapped through the old anchor, 50 ms outside its bounds
    _mapped_within_error(r.record(jumped), *events, r)  # clamped into them
    seen = r.timeline.jumps
    after, op, events = r.op()
    r.timeline.follow(op)
    r.settle(lambda: r.mapped(after))
    assert r.timeline.jumps == seen  # the new anchor maps it
    rec = r.record(after)
    _mapped_within_error(rec, *events, r)
    assert rec["dev_err_ns"] < 50 * MS


def _summary(r: Rig):
    with BoardReader(r.path) as reader:
        snap = BoardSnapshot.read(reader)
    return summarize_board(snap, time.monotonic_ns(), 0, 0, 1)


def test_an_op_the_device_never_reaches_is_not_entered(rig):
    r = rig()
    r.device.hang_next_kernel()
    r.device.launch(None, 0.001)  # this kernel never ends: the device stops before the op
    index, op, _ = r.op()
    r.timeline.follow(op)
    for _ in range(20):  # polls return: none of them waits for the device
        r.timeline.poll()
        time.sleep(0.005)
    rec = r.record(index)
    assert rec["state"] == STATE_IN_FLIGHT and rec["dev_start_ns"] == 0
    s = _summary(r)
    # the host entered seq 1; the device did not: to its peers this rank is missing
    assert s.in_flight == [] and s.groups[r.slot].entered_seq == 0


def test_an_op_the_device_reached_and_never_finishes_is_in_flight_from_then(rig):
    r = rig()
    index = r.board.enter(r.slot, OP_CODES["all_reduce"], FLAG_CUDA | FLAG_DEVICE, 64)
    pre = r.arrive()
    r.device.hang_next_kernel()
    r.device.launch(None, 0.001)  # the collective's kernel never ends
    post = r.arrive()
    r.timeline.follow(DeviceOp((index,), 0, pre, post))
    r.settle(lambda: int(r.record(index)["dev_source"]) & 0xF == TIME_EVENTS)
    (flight,) = _summary(r).in_flight
    assert flight.seq == 1 and flight.enter_ns == r.record(index)["dev_start_ns"]
    assert abs(flight.enter_ns - r.truth(r.events[pre])) <= r.record(index)["dev_err_ns"]


def test_a_step_is_its_span_on_the_device_less_its_waits_in_communication(rig):
    r = rig()
    tl = r.timeline
    tl.mark(0)
    r.device.launch(None, 0.010)
    first, op1, (pre1, post1) = r.op(kernel_ms=5, step=0)
    tl.follow(op1)
    r.device.launch(None, 0.004)
    w0 = tl.arrive(0)  # an async op's wait() on the current stream
    r.device.launch(None, 0.003)
    tl.waited_from(0, w0)
    tl.mark(1)
    r.device.launch(None, 0.002)
    tl.mark(2)
    steps = []
    r.settle(lambda: steps.extend(tl.take_steps()) or len(steps) >= 2)
    s0 = steps[0]
    assert s0.step == 0
    assert s0.blocked_ns >= (r.truth(post1) - r.truth(pre1)) + 3 * MS
    assert s0.span_ns - s0.blocked_ns >= 14 * MS  # its own kernels: 10 + 4 ms at least
    assert steps[1].step == 1 and steps[1].blocked_ns == 0


def test_with_no_free_event_an_op_goes_untimed_and_its_step_unmeasured(rig):
    r = rig(ring=2)
    tl = r.timeline
    tl.mark(0)
    index = r.board.enter(r.slot, OP_CODES["all_reduce"], FLAG_CUDA, 64)
    pre = tl.arrive(0)
    assert pre >= 0 and tl.arrive(0) == -1 and tl.skipped == 1
    tl.follow(DeviceOp((index,), 0, pre, -1, [(index, None)]))  # done when it returned
    tl.mark(1)
    r.settle(lambda: r.record(index)["state"] == STATE_DONE)
    tl.mark(2)
    r.device.compute.synchronize()
    for _ in range(5):
        tl.poll()
    assert 0 not in [s.step for s in tl.take_steps()]


def test_device_kinds_are_found_by_backend_and_cuda_is_never_touched_without_it():
    register_device("unit-dev", object, object)
    assert device_kind("unit-dev").name == "unit-dev"
    assert device_kind("cpu:gloo,cuda:unit-dev").name == "unit-dev"
    assert device_kind("gloo") is None
    if not torch.cuda.is_available():
        assert device_kind("nccl") is None
    with pytest.raises(ValueError, match="empty"):
        register_device(" ", object, object)


def test_the_tracer_reads_a_registered_device_through_its_events(tmp_path):
    from ccld_harness.simdev.backend import close_groups, register
    from ccld_plugin.tracing.tracer import Tracer

    device = SimDevice._instance = SimDevice(SimClock(offset_ns=OFFSET))
    register()
    dist.init_process_group("sim", store=dist.HashStore(), rank=0, world_size=1)
    path = tmp_path / "rank0.board"
    board = _native.Board(str(path), 0, 1, "j", "h", 64, 4, 4, 16)
    tracer = Tracer(board, 0, 0.002)
    tracer.register_group(None, "world")
    tracer.install()
    t = torch.ones(64)
    try:
        for step in range(3):
            tracer.mark_step(step)
            device.launch(None, 0.005)
            dist.all_reduce(t)  # returns at once; the current stream waits for it
            dist.all_reduce(t, async_op=True).wait()
            device.launch(None, 0.002)
        tracer.mark_step(3)
        device.synchronize()
        assert tracer.timeline is not None
        steps = []
        end = time.monotonic() + 20
        while len(steps) < 3 and time.monotonic() < end:
            steps += tracer.timeline.take_steps()
            time.sleep(0.01)
        with BoardReader(path) as r:
            ops = r.ops()
    finally:
        tracer.uninstall()
        close_groups()
        dist.destroy_process_group()
        board.close()
    assert [s.step for s in steps] == [0, 1, 2]
    assert all(s.span_ns - s.blocked_ns >= 7 * MS for s in steps)  # its kernels, 5 + 2 ms
    assert len(ops) == 6 and (ops["state"] == STATE_DONE).all()
    assert ((ops["flags"] & FLAG_DEVICE) != 0).all()
    assert (ops["dev_start_ns"] > 0).all() and (ops["dev_end_ns"] >= ops["dev_start_ns"]).all()
    blocking = (ops["flags"] & FLAG_ASYNC) == 0
    assert (ops["dev_source"][blocking] == TIME_EVENTS | TIME_EVENTS << 4).all()
    # an async op ends at its start plus the work's own device duration
    assert (ops["dev_source"][~blocking] == TIME_EVENTS | TIME_WORK << 4).all()
