"""A sink's own thread: the diagnoser's round hands a verdict record over and goes on,
whatever the receiver does with it (a user's hook that blocks, a web server that does not
answer). What the thread cannot keep up with is dropped, counted and said once."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from ccld_plugin.errors import log, report_error

__all__ = ["Delivery"]

MAX_QUEUE = 1024  # verdict records waiting for the thread; a job makes a handful
_CLOSE = object()


class Delivery:
    """Records handed to ``deliver`` on a thread of their own (started at the first),
    in order. ``deliver`` may raise: counted as a contained error of ``name``."""

    def __init__(self, name: str, deliver: Callable[[dict], None], maxsize: int = MAX_QUEUE):
        self.name = name
        self.deliver = deliver
        self.dropped = 0
        self.closing = threading.Event()  # set by close: the deliverer should hurry
        self._queue: queue.Queue[object] = queue.Queue(maxsize)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, record: dict) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"ccld-{self.name}")
                self._thread.daemon = True
                self._thread.start()
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "ccld: %s cannot keep up: a verdict is dropped (%d waiting); further "
                    "drops are counted, not said",
                    self.name,
                    self._queue.qsize(),
                )

    def pending(self) -> int:
        return self._queue.qsize()

    def close(self, wait_s: float) -> None:
        """Deliver what is queued, waiting for it at most ``wait_s``."""
        self.closing.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        deadline = time.monotonic() + wait_s
        try:
            self._queue.put(_CLOSE, timeout=wait_s)
        except queue.Full:
            return
        thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            record = self._queue.get()
            if record is _CLOSE:
                return
            try:
                self.deliver(record)  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - the receiver's failure, contained
                report_error(f"sinks.{self.name}", exc)
