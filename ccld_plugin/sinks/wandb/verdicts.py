"""Verdicts in W&B: a row of the verdict table, and the ``run.alert`` of a verdict."""

from __future__ import annotations

import dataclasses
import json

from ccld_plugin.diagnose.records import Verdict

__all__ = ["VERDICT_COLUMNS", "alert_message", "verdict_row"]

_STUCK_KINDS = {"hang", "deadlock", "unresponsive", "mismatch", "crash"}

VERDICT_COLUMNS: list[str] = [
    *(f.name for f in dataclasses.fields(Verdict) if f.name != "group"),
    "group_role",
    "group_ranks",
    "group_id",
    "schema",
]


def verdict_row(v: dict) -> list:
    """A verdict record as a table row in :data:`VERDICT_COLUMNS` order: lists of numbers
    as JSON, lines of text (each evidence item's text, the stack) one per line, the group
    in three columns."""
    g = v.get("group") or {}
    cells = {
        **v,
        "evidence": [e["text"] for e in v.get("evidence", [])],
        "group_role": g.get("role"),
        "group_ranks": g.get("ranks"),
        "group_id": g.get("group_id"),
    }
    row = []
    for col in VERDICT_COLUMNS:
        x = cells.get(col)
        if isinstance(x, list):
            x = "\n".join(map(str, x)) if x and isinstance(x[0], str) else json.dumps(x)
        row.append(x)
    return row


def alert_message(v: dict) -> dict:
    """The writer's ``alert`` message for a verdict record (ERROR for a stuck job, INFO for
    one that resumed)."""
    g = v.get("group") or {}
    ranks = ", ".join(map(str, v["ranks"]))
    where = f" in {g['role']}{g['ranks']}" if g else ""
    title = f"ccld {v['kind']}: rank {ranks} ({v['cause']})"
    lines = [
        f"{v['kind']} verdict, {v['cause']}-bound: rank {ranks}{where}"
        + (f" at {v['op']}" if v.get("op") else "")
        + (f", {v['severity']}x" if v.get("severity") and v["kind"] == "slow" else "")
        + (f" (step {v['step']}, " if v.get("step") is not None else " (")
        + f"detected {v.get('detected_s')} s)",
        *[f"- {e['text']}" for e in v.get("evidence", [])[:6]],
    ]
    return {
        "op": "alert",
        "title": title,
        "text": "\n".join(lines),
        "level": "ERROR"
        if v["kind"] in _STUCK_KINDS
        else ("INFO" if v["kind"] == "resumed" else "WARN"),
    }
