"""Where verdicts go: the console, a JSONL file, W&B. Each sink has ``emit(verdict)`` and
``close()``; a failing sink is contained and never stops the others."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ccld_plugin.config import SinksConfig
from ccld_plugin.diagnose.records import Verdict
from ccld_plugin.sinks.console import ConsoleSink, render_verdict
from ccld_plugin.sinks.jsonl import JsonlSink

__all__ = ["ConsoleSink", "JsonlSink", "Sink", "build_sinks", "render_verdict"]


class Sink(Protocol):
    def emit(self, verdict: Verdict) -> None: ...

    def close(self) -> None: ...


def build_sinks(cfg: SinksConfig) -> list[Sink]:
    sinks: list[Sink] = []
    if cfg.console:
        sinks.append(ConsoleSink())
    if cfg.jsonl:
        path = Path(cfg.jsonl)
        sinks.append(JsonlSink(path / "verdicts.jsonl" if path.is_dir() or not path.suffix
                               else path))
    return sinks
