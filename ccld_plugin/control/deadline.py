"""Store requests that give up in time.

torch's TCPStore client waits for the answers to ``check``, ``add``, ``set`` and
``compare_set`` in a plain ``recv()``: only ``get`` and ``wait`` honour its timeout. When
the link to the store's host is cut (no reset comes back), such a request waits until
TCP gives up, many minutes, and the thread that made it (the agent's, the diagnoser's)
stops with it: no summary, no round, no verdict. ``DeadlineStore`` runs a store's requests
one at a time on a worker thread and waits for each at most ``timeout_s``. While one is
stuck the next ones fail at once; once it returns (the link is back) the worker goes on
over the same connection, its answers in order, so nothing needs reconnecting.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["DeadlineStore", "StoreTimeout", "request_timeout_s"]

# On top of a request's own wait (``get`` and ``wait`` time out by themselves, with the
# store's message): the worker hands back their error before the deadline passes.
MARGIN_S = 0.5


# A request of a few hundred keys takes milliseconds; one that waits longer than a few
# agent intervals (and at least this long) waits for a store that is down or cut off.
MIN_TIMEOUT_S = 2.0


def request_timeout_s(interval_s: float, at_most_s: float = float("inf")) -> float:
    """How long a request waits for the store once start-up is over: 4 agent intervals,
    at least MIN_TIMEOUT_S, at most ``at_most_s``."""
    return min(at_most_s, max(MIN_TIMEOUT_S, 4 * interval_s))


class StoreTimeout(RuntimeError):
    """The store did not answer within the deadline."""


class _Request:
    __slots__ = ("args", "done", "error", "fn", "kwargs", "name", "result", "since")

    def __init__(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.name, self.fn, self.args, self.kwargs = name, fn, args, kwargs
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.since = time.monotonic()


class DeadlineStore:
    """``store`` (a torch Store) whose requests give up after ``timeout_s`` once
    :meth:`set_deadline` sets one; before that (start-up, which waits for the other ranks
    on purpose) they run in the caller's thread as they are."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.timeout_s: float | None = None
        self._jobs: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._stuck: _Request | None = None
        self._lock = threading.Lock()

    def set_deadline(self, timeout_s: float) -> None:
        """From now on each request waits at most ``timeout_s`` (the store's own timeout,
        for ``get`` and ``wait``, is set to it too)."""
        self.store.set_timeout(timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.store, name)
        if not callable(fn):
            return fn

        def request(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, fn, args, kwargs)

        return request

    def _call(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.timeout_s is None:
            return fn(*args, **kwargs)
        with self._lock:  # one request in flight per connection: answers come in order
            stuck = self._stuck
            if stuck is not None and not stuck.done.is_set():
                raise StoreTimeout(
                    f"the store has not answered a {stuck.name} for "
                    f"{time.monotonic() - stuck.since:.1f} s"
                )
            self._stuck = None
            req = _Request(name, fn, args, kwargs)
            if self._worker is None:
                # a daemon: a request stuck for good must not hold up the interpreter's exit
                self._worker = threading.Thread(target=self._serve, name="ccld-store", daemon=True)
                self._worker.start()
            self._jobs.put(req)
            if not req.done.wait(self.timeout_s + MARGIN_S):
                self._stuck = req
                raise StoreTimeout(
                    f"the store did not answer a {name} within {self.timeout_s:g} s "
                    "(its host or the link to it is down)"
                )
        if req.error is not None:
            raise req.error
        return req.result

    def _serve(self) -> None:
        while True:
            req = self._jobs.get()
            try:
                req.result = req.fn(*req.args, **req.kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                req.error = exc
            req.done.set()
