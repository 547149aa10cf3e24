"""A simulated device with CUDA's ordering, so that device time is tested on CPU machines.

One device per process (rank). A stream is a thread that runs what is launched on it in
order, from a bounded launch queue: a launch returns at once unless the queue is full
(then the host blocks, as CUDA's does). Kernels are Python functions run on the stream's
thread, padded to a nominal duration (a sleep: the cores stay free for the other ranks);
a device-slow fault stretches compute kernels, a device-hang fault makes one never end.
Events (:class:`SimEvent`) have ``torch.cuda.Event``'s semantics: ``record`` enqueues,
``query`` never blocks, ``synchronize`` is a host sync point, ``elapsed_time`` works only
between completed events. The device clock is the host's monotonic clock from another
epoch (a per-rank offset), with an optional drift and jump, like a GPU's timer.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["SimClock", "SimDevice", "SimEvent", "SimStream"]

QUEUE_DEPTH = 1024  # CUDA's launch queue holds about this many entries


@dataclass
class SimClock:
    """The device's clock: the host's monotonic nanoseconds plus ``offset_ns``, running
    ``drift_ppm`` fast, and moved by ``jump_ns`` from host time ``jump_at_ns`` on."""

    offset_ns: int = 0
    drift_ppm: float = 0.0
    jump_ns: int = 0
    jump_at_ns: int = 0

    def __post_init__(self) -> None:
        self._t0 = time.monotonic_ns()

    def now_ns(self) -> int:
        host = time.monotonic_ns()
        t = host + self.offset_ns + int((host - self._t0) * self.drift_ppm * 1e-6)
        return t + self.jump_ns if self.jump_ns and host >= self.jump_at_ns else t


class SimEvent:
    """A timing event on the simulated device (``torch.cuda.Event(enable_timing=True)``)."""

    __slots__ = ("_device", "_done", "_gen", "device_ns")

    def __init__(self, device: SimDevice) -> None:
        self._device = device
        self._done = threading.Event()
        self._done.set()  # as CUDA's: an event never recorded queries complete
        self._gen = 0
        self.device_ns = 0  # the device clock when its stream reached it

    def record(self, stream: SimStream | None = None) -> None:
        """Enqueue on ``stream`` (default: the current stream); returns at once unless
        the launch queue is full."""
        self._gen += 1
        self._done.clear()
        (stream or self._device.current_stream()).enqueue(("record", self, self._gen))

    def reached(self, gen: int, device_ns: int) -> None:
        if gen == self._gen:  # a record superseded by a later one does not complete it
            self.device_ns = device_ns
            self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        """A host sync point: block until the device has reached the event."""
        self._done.wait()

    def elapsed_time(self, end: SimEvent) -> float:
        """Device milliseconds from this event to ``end``; both must have completed."""
        if not (self.query() and end.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end.device_ns - self.device_ns) / 1e6


class SimStream:
    """A stream: one thread running its queue in order."""

    def __init__(self, device: SimDevice, name: str, depth: int = QUEUE_DEPTH) -> None:
        self.device = device
        self.name = name
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name=f"sim-{name}", daemon=True)
        self._thread.start()

    def enqueue(self, item: tuple) -> None:
        self._queue.put(item)  # a full queue blocks the host, as CUDA's launch queue does

    def launch(self, fn: Callable[[], Any] | None, seconds: float, compute: bool = True) -> None:
        """A kernel: ``fn`` run on the device, taking at least ``seconds`` (times the
        device-slow factor for a compute kernel)."""
        self.enqueue(("kernel", fn, seconds, compute))

    def wait_event(self, event: SimEvent) -> None:
        """Later work on this stream waits until the device has reached ``event``."""
        self.enqueue(("wait", event, event._gen))

    def synchronize(self) -> None:
        event = SimEvent(self.device)
        event.record(self)
        event.synchronize()

    def stop(self, join_s: float = 5.0) -> None:
        """Stop after what is queued (waiting ``join_s`` for it at most: a hung kernel
        never ends, and its thread stays, a daemon)."""
        try:
            self._queue.put(("stop",), timeout=join_s)
        except queue.Full:
            return
        self._thread.join(timeout=join_s)

    def _run(self) -> None:
        device = self.device
        while True:
            item = self._queue.get()
            kind = item[0]
            if kind == "stop":
                return
            if kind == "record":
                item[1].reached(item[2], device.clock.now_ns())
            elif kind == "wait":
                event, gen = item[1], item[2]
                while gen == event._gen and not event._done.wait(0.5):
                    pass
            else:
                _, fn, seconds, compute = item
                start = time.monotonic()
                if compute and device.take_hang():
                    threading.Event().wait()  # device-hang: this kernel never ends
                try:
                    if fn is not None:
                        fn()
                except Exception as exc:  # noqa: BLE001 - a failed kernel ends; the run is told
                    device.errors.append(f"{self.name}: {type(exc).__name__}: {exc}")
                factor = device.slow_factor if compute else 1.0
                left = start + seconds * factor - time.monotonic()
                if left > 0:
                    time.sleep(left)


class SimDevice:
    """The process's simulated device: a compute stream (the current stream) and the
    streams made for it (collectives', the anchor's)."""

    _instance: SimDevice | None = None

    def __init__(self, clock: SimClock | None = None, depth: int = QUEUE_DEPTH) -> None:
        self.clock = clock or SimClock()
        self.depth = depth
        self.slow_factor = 1.0  # device-slow: compute kernels take this many times as long
        self._hang = False  # device-hang: the next compute kernel never ends
        self._lock = threading.Lock()
        self.errors: list[str] = []  # kernels that raised
        self.streams: list[SimStream] = []
        self.compute = self.new_stream("compute")

    @classmethod
    def get(cls) -> SimDevice:
        """This process's device (made on first use)."""
        if cls._instance is None:
            cls._instance = SimDevice()
        return cls._instance

    def new_stream(self, name: str) -> SimStream:
        stream = SimStream(self, name, self.depth)
        with self._lock:
            self.streams.append(stream)
        return stream

    def current_stream(self) -> SimStream:
        return self.compute

    def event(self) -> SimEvent:
        return SimEvent(self)

    def launch(self, fn: Callable[[], Any] | None, seconds: float) -> None:
        """A compute kernel on the current stream."""
        self.compute.launch(fn, seconds)

    def hang_next_kernel(self) -> None:
        self._hang = True

    def take_hang(self) -> bool:
        with self._lock:
            hang, self._hang = self._hang, False
        return hang

    def synchronize(self) -> None:
        """``cudaDeviceSynchronize``: the host waits until every stream is idle."""
        with self._lock:
            streams = list(self.streams)
        for stream in streams:
            stream.synchronize()

    def close(self, join_s: float = 5.0) -> None:
        """Stop every stream (after a synchronize: nothing is left in them)."""
        with self._lock:
            streams, self.streams = self.streams, []
        for stream in streams:
            stream.stop(join_s)
