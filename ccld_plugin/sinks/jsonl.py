"""Verdicts as JSON lines: appended and flushed one record at a time, so a crash loses
nothing already written."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ccld_plugin.config import make_private_dirs
from ccld_plugin.diagnose.records import Verdict
from ccld_plugin.files import open_private

__all__ = ["JsonlSink", "read_verdicts"]


class JsonlSink:
    def __init__(self, path: Path) -> None:
        self.path = path
        make_private_dirs(path.parent)  # verdicts hold stacks and op names: the user's own
        self._fh = open(open_private(path, append=True), "a", encoding="utf-8")  # noqa: SIM115 - held for the run

    def emit(self, verdict: Verdict) -> None:
        self._fh.write(json.dumps(verdict.to_dict()) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()


def read_verdicts(path: Path) -> list[dict]:
    """Records of a verdicts file as written; a torn last line (the writer died) is
    skipped. Evidence items of schema 1 (sentences only) are read as schema 2's
    ``{"fact": "note", "text": ..., "data": {}}``, so readers handle one shape; the
    record's ``schema`` stays as written."""
    out: list[dict] = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            v = json.loads(line)
        except json.JSONDecodeError:
            continue
        if v.get("schema", 1) < 2:
            v["evidence"] = [{"fact": "note", "text": e, "data": {}} for e in v.get("evidence", [])]
        out.append(v)
    return out
