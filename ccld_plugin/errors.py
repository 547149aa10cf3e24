"""Containment of the plugin's own failures: log once, count, and let training go on."""

from __future__ import annotations

import logging
import threading
from collections import Counter

__all__ = ["CONTAINED", "contained_errors", "log", "report_error"]

log = logging.getLogger("ccld")
CONTAINED = "ccld: contained error"  # how each place's first error is logged

_lock = threading.Lock()
_counts: Counter[str] = Counter()
_on_error: list = []  # callbacks (the board's error counter) registered by the session


def report_error(where: str, exc: BaseException) -> None:
    """Record an exception raised inside the plugin. Logged once per place; never raises."""
    try:
        with _lock:
            _counts[where] += 1
            first = _counts[where] == 1
        if first:
            log.warning(
                CONTAINED + " in %s: %s: %s (training continues; "
                "further errors here are counted, not logged)",
                where,
                type(exc).__name__,
                exc,
            )
        for callback in list(_on_error):
            callback()
    except Exception:  # noqa: BLE001 - the error path itself must never fail
        pass


def contained_errors() -> dict[str, int]:
    """How many errors each part of the plugin has contained so far."""
    with _lock:
        return dict(_counts)


def on_error(callback) -> None:
    _on_error.append(callback)


def clear_callbacks() -> None:
    _on_error.clear()
