"""Installing late: every reference to a wrapped function that a loaded module (or a known
holder object such as DeepSpeed's ``TorchBackend``) captured at import is rebound to its
wrapper, and back at uninstall."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["rebind"]


def holders() -> list[Any]:
    """Objects known to keep collectives as attributes, captured at their init."""
    found = []
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    cdb = getattr(ds_comm, "cdb", None) if ds_comm is not None else None
    if cdb is not None:
        found.append(cdb)
    return found


def rebind(replacements: dict[int, tuple[Any, Any]]) -> int:
    """Replace every reference to an old function found in loaded modules' globals and in
    known holder objects. Returns how many references were rebound."""
    count = 0
    namespaces = [vars(m) for m in list(sys.modules.values()) if hasattr(m, "__dict__")]
    namespaces += [vars(h) for h in holders() if hasattr(h, "__dict__")]
    for ns in namespaces:
        try:
            items = list(ns.items())
        except Exception:  # noqa: BLE001 - a module with an odd namespace
            continue
        for key, value in items:
            hit = replacements.get(id(value))
            if hit is not None and hit[0] is value:
                ns[key] = hit[1]
                count += 1
    return count
