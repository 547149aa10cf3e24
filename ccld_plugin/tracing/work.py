"""What a traced op leaves behind it: the training thread's state around its ops
(``ThreadState``: inside a traced call, its wait for a CPU), and async work whose exit is
stamped when it completes (``TracedWork``, watched by the ``CompletionPoller``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ccld_plugin.errors import report_error
from ccld_plugin.tracing.cpu_wait import ThreadCpuWait
from ccld_plugin.wire.codes import STATE_DONE, STATE_ERROR

if TYPE_CHECKING:
    from ccld_plugin.tracing.timeline import DeviceOp
    from ccld_plugin.tracing.tracer import Tracer

__all__ = [
    "CompletionPoller",
    "ThreadState",
    "TracedWork",
    "book_cpu_wait",
    "cpu_wait_now",
    "succeeded",
]


class ThreadState(threading.local):
    """The training thread's state around its traced ops (one per thread)."""

    busy = False  # inside a traced call: nested calls are part of it, not new ops
    coalesced_index = -1  # ring index of the open coalescing block, if any
    # The thread's wait for a CPU, followed from its first step mark, and how much of it
    # fell inside blocking communication (booked there, as communication); the time and
    # the wait at its last mark; whether its blocking ops read the wait around them now.
    cpu_wait: ThreadCpuWait | None = None
    cpu_wait_in_ops_ns = 0
    marked_ns = 0
    marked_wait_ns = 0
    watch_ops = False


def cpu_wait_now(local: ThreadState) -> int:
    """The thread's wait for a CPU so far (-1: not read now), read before blocking."""
    return local.cpu_wait.ns() if local.watch_ops and local.cpu_wait is not None else -1


def book_cpu_wait(local: ThreadState, before: int) -> None:
    """Book the thread's wait for a CPU since ``before`` (cpu_wait_now) to communication."""
    if before >= 0 and local.cpu_wait is not None:
        # (a read that failed says 0: never book less than nothing)
        local.cpu_wait_in_ops_ns += max(0, local.cpu_wait.ns() - before)


class TracedWork:
    """Delegates to the real work object; stamps the op's exit when it completes (or the
    device timeline does, for an op it follows: ``dev``)."""

    __slots__ = ("_work", "_indices", "_tracer", "_cuda", "_done", "_dev")

    def __init__(
        self,
        work: Any,
        indices: tuple[int, ...],
        tracer: Tracer,
        cuda: bool,
        dev: DeviceOp | None = None,
    ) -> None:
        self._work = work
        self._indices = indices
        self._tracer = tracer
        self._cuda = cuda
        self._done = False
        self._dev = dev

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic_ns()
        tracer = self._tracer
        local = tracer._local
        queued = -1 if self._cuda else cpu_wait_now(local)
        # On a device, wait() makes the current stream wait: events around it tell how long
        timeline = tracer.timeline if self._dev is not None else None
        w0 = timeline.arrive(tracer.current_step) if timeline is not None else -1
        try:
            result = self._work.wait(*args, **kwargs)
        except BaseException:
            self._finish(STATE_ERROR)
            raise
        finally:
            tracer.add_wait(time.monotonic_ns() - t0)
            book_cpu_wait(local, queued)
            if timeline is not None:
                timeline.waited_from(tracer.current_step, w0)
        if not self._cuda:  # on GPU, wait() only orders streams: the poller stamps exit
            self._finish(STATE_DONE)
        return result

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self._finish(STATE_DONE if succeeded(self._work) else STATE_ERROR)
        return done

    def _finish(self, state: int) -> None:
        if not self._done:
            self._done = True
            self._tracer.exit_many(self._indices, state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CompletionPoller:
    """A daemon thread that stamps the exit of async work when ``is_completed()`` turns true
    (the only faithful completion time of a GPU collective)."""

    def __init__(self, interval_s: float) -> None:
        self._interval = interval_s
        self._pending: list[Any] = []
        self._also: list[Callable[[], None]] = []  # polled too: device timelines
        self._also_s = float("inf")  # ... this often
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ccld-poller", daemon=True)
        self._thread.start()

    def watch(self, work: Any) -> None:
        with self._lock:
            self._pending.append(work)
        self._wake.set()

    def add(self, poll: Callable[[], None], period_s: float) -> None:
        """Call ``poll`` about every ``period_s`` from now on (it must never block)."""
        self._also.append(poll)
        self._also_s = min(self._also_s, max(period_s, self._interval))
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop:
            with self._lock:
                pending = self._pending
                self._pending = []
            for poll in self._also:
                try:
                    poll()
                except Exception as exc:  # noqa: BLE001
                    report_error("tracer.device_poll", exc)
            if not pending and not self._also:
                self._wake.wait()
                self._wake.clear()
                continue
            still = []
            for w in pending:
                try:
                    if not w._done and not w.is_completed():
                        still.append(w)
                except Exception as exc:  # noqa: BLE001
                    report_error("tracer.poller", exc)
            with self._lock:
                self._pending.extend(still)
            # nothing left to poll and no timeline: sleep until woken (an infinite timeout
            # overflows the wait)
            self._wake.wait(self._interval if still else self._also_s if self._also else None)
            self._wake.clear()


def succeeded(work: Any) -> bool:
    try:
        return bool(work.is_success())
    except Exception:  # noqa: BLE001 - not every work type answers; completion is enough
        return True
