"""SIGTERM, SIGINT and SIGHUP as a request to stop, which a launcher checks at safe points.

An exception raised from a signal handler lands wherever the main thread happens to be:
in the at-fork hooks that run in the parent after each rank is forked (logging's, where
Python prints "Exception ignored" and drops it: a SIGTERM during a launch was lost), or
inside the ``finally`` that is stopping the job. So the handler only records the signal;
the launcher looks between the ranks it starts, while it follows the job, and between its
own steps, and then stops the job in order (ranks, network, diagnoser). A second signal
does not cut that short: each of its waits is bounded.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["STOP_SIGNALS", "StopRequest", "Stopped", "stop_on_signals"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stopped(Exception):
    """Raised by :meth:`StopRequest.check` once a stop signal came."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StopRequest:
    """The first stop signal received (None: none yet)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __bool__(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + (self.signum or 0)

    def check(self) -> None:
        """Raise :class:`Stopped` if a stop signal came."""
        if self.signum is not None:
            raise Stopped(self.signum)

    def record(self, signum: int, frame: FrameType | None = None) -> None:
        """The signal handler: remembers the first signal, and nothing else (it may run
        anywhere in the main thread: see the module's docstring)."""
        if self.signum is None:
            self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """While inside, STOP_SIGNALS only record a stop request. Handlers can be set only in
    the main thread; elsewhere the request is never made (the caller's thread is not the
    one signals reach)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request.record) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
