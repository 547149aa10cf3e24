"""Verdicts as JSON lines: appended and flushed one record at a time, so a crash loses
nothing already written."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ccld_plugin.diagnose.records import MEASURE_FIELDS, MEASURES, Verdict
from ccld_plugin.files import make_private_dirs, open_private

__all__ = ["JsonlSink", "read_verdicts", "upgraded"]


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
    """Records of a verdicts file as written, each in the current shape (:func:`upgraded`);
    a torn last line (the writer died) is skipped."""
    out: list[dict] = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            v = json.loads(line)
        except json.JSONDecodeError:
            continue
        out.append(upgraded(v))
    return out


def upgraded(v: dict) -> dict:
    """A verdict record of an older schema in the current shape, so that readers handle
    one: schema 1's evidence sentences as ``{"fact": "note", "text": ..., "data": {}}``;
    schema 2's ``severity`` under its kind's measure (``ratio``, ``stuck_s``,
    ``lasted_s``), and who and where as not known (null; ``culprits`` by rank alone).
    The record's ``schema`` stays as written; a record that is none is left as it is."""
    schema, kind, ranks = v.get("schema", 1), v.get("kind"), v.get("ranks")
    if not (isinstance(schema, int) and isinstance(kind, str) and isinstance(ranks, list)):
        return v
    if schema < 2:
        v["evidence"] = [{"fact": "note", "text": e, "data": {}} for e in v.get("evidence", [])]
    if schema < 3:
        severity = v.pop("severity", None)
        for name in MEASURE_FIELDS:
            v.setdefault(name, None)
        measure = MEASURES.get(kind)
        if measure is not None and severity is not None:
            v[measure] = severity
        for name in ("id", "resumes", "time", "job"):
            v.setdefault(name, None)
        v.setdefault(
            "culprits",
            [{"rank": r, "host": None, "local_rank": None, "device": None} for r in ranks],
        )
    return v
