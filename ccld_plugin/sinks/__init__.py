"""Where verdicts go: the console, a JSONL file, W&B. Each sink has ``emit(verdict)`` and
``close()``, and may have ``observe(view, analyzer)``, called once per diagnoser round
(the W&B sink draws its panels from it); a failing sink is contained and never stops the
others."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ccld_plugin.config import SinksConfig
from ccld_plugin.diagnose.records import Verdict
from ccld_plugin.errors import report_error
from ccld_plugin.sinks.console import ConsoleSink, render_verdict
from ccld_plugin.sinks.jsonl import JsonlSink

__all__ = ["ConsoleSink", "JsonlSink", "Sink", "build_sinks", "render_verdict"]


class Sink(Protocol):
    def emit(self, verdict: Verdict) -> None: ...

    def close(self) -> None: ...


def build_sinks(cfg: SinksConfig, boards: Path | None = None) -> list[Sink]:
    """The configured sinks; one that cannot be opened is left out (the config checked its
    path at start, so this is a folder that went away since), the others run."""
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
    return sinks
