"""Verdicts as JSON lines: appended and flushed one record at a time, so a crash loses
nothing already written."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ccld_plugin.diagnose.records import Verdict

__all__ = ["JsonlSink", "read_verdicts"]


class JsonlSink:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held for the run

    def emit(self, verdict: Verdict) -> None:
        self._fh.write(json.dumps(verdict.to_dict()) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()


def read_verdicts(path: Path) -> list[dict]:
    """Records of a verdicts file; a torn last line (the writer died) is skipped."""
    out: list[dict] = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
