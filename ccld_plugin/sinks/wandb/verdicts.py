"""Verdicts in W&B: a row of the verdict table, and the ``run.alert`` of a verdict."""

from __future__ import annotations

import json

from ccld_plugin.diagnose.records import RECORD_FIELDS

__all__ = ["VERDICT_COLUMNS", "alert_message", "verdict_row", "where"]

_STUCK_KINDS = {"hang", "deadlock", "unresponsive", "mismatch", "crash"}

VERDICT_COLUMNS: list[str] = [
    *(f for f in RECORD_FIELDS if f not in ("group", "schema")),
    "group_role",
    "group_ranks",
    "group_id",
    "schema",
]


def where(culprit: dict) -> str:
    """Where a culprit runs, in words: ``rank 2 on node-7 (local rank 2, cuda:0 GPU-...)``."""
    device = culprit.get("device")
    details = [
        *([f"local rank {culprit['local_rank']}"] if culprit.get("local_rank") is not None else []),
        *([f"cuda:{device['index']} {device.get('uuid') or ''}".strip()] if device else []),
    ]
    return (
        f"rank {culprit['rank']}"
        + (f" on {culprit['host']}" if culprit.get("host") else "")
        + (f" ({', '.join(details)})" if details else "")
    )


def verdict_row(v: dict) -> list:
    """A verdict record as a table row in :data:`VERDICT_COLUMNS` order: lists of numbers
    as JSON, lines of text (each evidence item's text, the stack, where each culprit runs)
    one per line, the group in three columns."""
    g = v.get("group") or {}
    cells = {
        **v,
        "evidence": [e["text"] for e in v.get("evidence", [])],
        "culprits": [where(c) for c in v.get("culprits") or []],
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
    group = f" in {g['role']}{g['ranks']}" if g else ""
    title = f"ccld {v['kind']}: rank {ranks} ({v['cause']})"
    lines = [
        f"{v['kind']} verdict, {v['cause']}-bound: rank {ranks}{group}"
        + (f" at {v['op']}" if v.get("op") else "")
        + (f", {v['ratio']}x" if v.get("ratio") else "")
        + (f" (step {v['step']}, " if v.get("step") is not None else " (")
        + f"detected {v.get('detected_s')} s)",
        *[where(c) for c in (v.get("culprits") or [])[:8] if c.get("host")],
        f"job {v.get('job')}, at {v.get('time')}, id {v.get('id')}"
        + (f", ends {v['resumes']}" if v.get("resumes") else ""),
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
