"""The completion poller outlives every state it meets: work that is done at its first
look, with no device timeline to poll, must leave it asleep, not dead (its thread is the
only one that stamps an async op's exit)."""

from __future__ import annotations

import threading
import time

from ccld_plugin.tracing.work import CompletionPoller


class _Work:
    """What the poller asks of a traced work: ``_done`` and ``is_completed()``."""

    def __init__(self, done: bool) -> None:
        self._done = False
        self.complete = done
        self.asked = 0

    def is_completed(self) -> bool:
        self.asked += 1
        if self.complete:
            self._done = True
        return self.complete


def test_work_done_at_the_first_look_leaves_the_poller_alive() -> None:
    died: list[BaseException] = []
    before = threading.excepthook
    threading.excepthook = lambda args: died.append(args.exc_value)  # type: ignore[assignment]
    poller = CompletionPoller(0.01)
    try:
        poller.watch(_Work(done=True))
        late = _Work(done=False)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not died:
            time.sleep(0.05)
            if late.asked == 0:
                poller.watch(late)
            elif late.asked >= 3:
                break
        late.complete = True
        assert not died, f"the poller's thread died: {died!r}"
        assert late.asked >= 3, "work watched after the first was never polled"
        assert poller._thread.is_alive()
    finally:
        poller.stop()
        threading.excepthook = before
