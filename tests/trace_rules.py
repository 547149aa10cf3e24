"""The Trace Event format's rules that Perfetto and chrome://tracing rely on, checked on a
timeline written by ``ccld trace``: the JSON object form, the fields each phase needs,
flows that start once, end once and bind to a slice, instants with a scope."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

PHASES = {"X", "M", "s", "t", "f", "i"}
METADATA = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


def check_trace(doc: Any) -> dict[str, list[dict]]:
    """Assert the rules; the events by phase."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    by_ph: dict[str, list[dict]] = defaultdict(list)
    for e in doc["traceEvents"]:
        assert e["ph"] in PHASES, e
        assert isinstance(e["name"], str) and isinstance(e["pid"], int)
        assert isinstance(e["tid"], int), e
        if e["ph"] == "M":
            assert e["name"] in METADATA and isinstance(e["args"], dict), e
        else:
            assert isinstance(e["ts"], int | float) and e["ts"] >= 0, e
        by_ph[e["ph"]].append(e)
    for e in by_ph["X"]:
        assert isinstance(e["dur"], int | float) and e["dur"] >= 0, e
    for e in by_ph["i"]:
        assert e["s"] in ("t", "p", "g"), e
    slices = defaultdict(list)
    for e in by_ph["X"]:
        slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    flows = defaultdict(list)
    for ph in "stf":
        for e in by_ph[ph]:
            flows[(e["cat"], e["id"])].append(e)
            # bound to the enclosing slice: one must hold the flow point on its track
            assert e.get("bp") == "e", e
            assert any(a <= e["ts"] <= b for a, b in slices[(e["pid"], e["tid"])]), e
    for points in flows.values():
        phases = [p["ph"] for p in sorted(points, key=lambda p: p["ts"])]
        assert phases.count("s") == 1 and phases.count("f") == 1, phases
        assert phases[0] == "s" and phases[-1] == "f", phases
    named = {(e["pid"], e["tid"]) for e in by_ph["M"] if e["name"] == "thread_name"}
    for e in [*by_ph["X"], *by_ph["i"]]:
        assert (e["pid"], e["tid"]) in named, f"event on an unnamed track: {e}"
    return by_ph
