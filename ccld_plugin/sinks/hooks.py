"""Verdicts handed to code: a function registered with ``ccld_plugin.on_verdict(fn)`` in the
process that runs the diagnoser, and the sinks that installed packages declare in the entry
point group ``ccld_plugin.sinks``. Each gets every verdict record (a dict, as in
verdicts.jsonl) on a thread of its own (``sinks.delivery``): a slow or failing hook never
holds up a diagnoser round, nor another hook."""

from __future__ import annotations

import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from ccld_plugin.diagnose.records import Verdict
from ccld_plugin.errors import log, report_error
from ccld_plugin.sinks.delivery import Delivery

__all__ = ["ENTRY_POINTS", "CallbackSink", "PluginSink", "on_verdict", "plugin_sinks"]

ENTRY_POINTS = "ccld_plugin.sinks"
CLOSE_WAIT_S = 5.0  # what a hook or plugin is given to finish at the job's end

_callbacks: list[Callable[[dict], Any]] = []
_lock = threading.Lock()


def on_verdict(fn: Callable[[dict], Any]) -> Callable[[dict], Any]:
    """Call ``fn(record)`` with every verdict this process's diagnoser emits from now on
    (``record``: the verdict as in verdicts.jsonl, schema 3). Returns ``fn``, so it works
    as a decorator. Only the process that runs the diagnoser (rank ``diagnoser.rank``, its
    standby once it took over, or ``ccld diagnoser``) emits verdicts."""
    if not callable(fn):
        raise TypeError(f"ccld_plugin.on_verdict takes a function, not {type(fn).__name__}")
    with _lock:
        _callbacks.append(fn)
    return fn


class CallbackSink:
    """The functions registered with :func:`on_verdict`, as they are when a verdict comes."""

    def __init__(self) -> None:
        self._delivery = Delivery("on_verdict", self._call)

    def emit(self, verdict: Verdict) -> None:
        if _callbacks:
            self._delivery.put(verdict.to_dict())

    def close(self) -> None:
        self._delivery.close(CLOSE_WAIT_S)

    @staticmethod
    def _call(record: dict) -> None:
        with _lock:
            callbacks = list(_callbacks)
        for fn in callbacks:
            try:
                fn(dict(record))  # each its own copy: one hook's changes are not the next's
            except Exception as exc:  # noqa: BLE001
                report_error(f"sinks.on_verdict.{getattr(fn, '__qualname__', 'hook')}", exc)


class PluginSink:
    """A sink of an installed package: its object's ``emit(record)`` for every verdict
    record, and its ``close()`` (if it has one) at the end."""

    def __init__(self, name: str, target: Any) -> None:
        self.name = name
        self.target = target
        self._delivery = Delivery(f"plugin.{name}", target.emit)

    def emit(self, verdict: Verdict) -> None:
        self._delivery.put(verdict.to_dict())

    def close(self) -> None:
        self._delivery.close(CLOSE_WAIT_S)
        close = getattr(self.target, "close", None)
        if callable(close):
            try:
                close()
            except Exception as exc:  # noqa: BLE001
                report_error(f"sinks.plugin.{self.name}", exc)


def plugin_sinks() -> list[PluginSink]:
    """The sinks of the installed packages: each entry point of the group ENTRY_POINTS
    names a factory (a class or function, called with no arguments) of an object with
    ``emit(record: dict)`` and, optionally, ``close()``. One that fails to load or make is
    said once and left out."""
    sinks = []
    for ep in entry_points(group=ENTRY_POINTS):
        try:
            target = ep.load()()
            if not callable(getattr(target, "emit", None)):
                raise TypeError(f"{ep.value} made a {type(target).__name__}, which has no emit()")
        except Exception as exc:  # noqa: BLE001 - a broken plugin never stops the job
            report_error(f"sinks.plugin.{ep.name}", exc)
            continue
        log.info("ccld: verdicts also go to the sink %r (%s)", ep.name, ep.value)
        sinks.append(PluginSink(ep.name, target))
    return sinks
