"""Where verdicts go: the console, a JSONL file, W&B, a webhook, Prometheus' ``/metrics``
and the sinks installed packages declare, as configured (``build_sinks``); and the
functions given to ``ccld_plugin.on_verdict`` (``CallbackSink``, which every diagnoser
feeds). Each sink has ``emit(verdict)`` and ``close()``, and may have
``observe(view, analyzer, round_s)``, called once per diagnoser round (the W&B sink draws
its panels from it); a failing sink is contained and never stops the others."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Protocol

from ccld_plugin.config import SinksConfig
from ccld_plugin.diagnose.records import Verdict
from ccld_plugin.errors import report_error
from ccld_plugin.sinks.console import ConsoleSink, render_verdict
from ccld_plugin.sinks.hooks import CallbackSink, on_verdict, plugin_sinks
from ccld_plugin.sinks.jsonl import JsonlSink

__all__ = [
    "CallbackSink",
    "ConsoleSink",
    "JsonlSink",
    "Sink",
    "build_sinks",
    "close_sinks",
    "on_verdict",
    "render_verdict",
]


class Sink(Protocol):
    def emit(self, verdict: Verdict) -> None: ...

    def close(self) -> None: ...


def build_sinks(cfg: SinksConfig, boards: Path | None = None) -> list[Sink]:
    """The configured sinks; one that cannot be opened is left out (the config checked its
    path at start, so this is a folder that went away since; a port taken), the others
    run."""
    sinks: list[Sink] = []
    if cfg.console:
        sinks.append(ConsoleSink())
    jsonl = cfg.jsonl_file()
    if jsonl is not None:
        try:
            sinks.append(JsonlSink(jsonl))
        except OSError as exc:
            report_error("sinks.jsonl", exc)
    if cfg.wandb.enabled:
        try:
            # Imported here: the module never imports wandb itself, but the sink is
            # optional and nothing about it may stop the job from starting.
            from ccld_plugin.sinks.wandb.sink import WandbSink

            sinks.append(WandbSink(cfg.wandb, boards=boards))
        except Exception as exc:  # noqa: BLE001
            report_error("sinks.wandb", exc)
    if cfg.webhook.url:
        from ccld_plugin.sinks.webhook import WebhookSink

        sinks.append(WebhookSink(cfg.webhook))
    if cfg.prometheus.port:
        try:  # prometheus_client is optional (the extra ccld-plugin[prometheus])
            from ccld_plugin.sinks.prometheus import PrometheusSink

            sinks.append(PrometheusSink(cfg.prometheus))
        except Exception as exc:  # noqa: BLE001 - not installed, or the port is taken
            report_error("sinks.prometheus", exc)
    if cfg.plugins:
        sinks += plugin_sinks()
    return sinks


def close_sinks(sinks: list[Sink], within_s: float | None = None) -> None:
    """Close each sink (each failure contained), one after the other, or, ``within_s``
    given, all at once, waiting for them that long at most."""
    if within_s is None:
        for sink in sinks:
            _close(sink)
        return
    threads = [threading.Thread(target=_close, args=(s,), daemon=True) for s in sinks]
    for t in threads:
        t.start()
    deadline = time.monotonic() + within_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def _close(sink: Sink) -> None:
    try:
        sink.close()
    except Exception as exc:  # noqa: BLE001
        report_error(f"sinks.{type(sink).__name__}", exc)
