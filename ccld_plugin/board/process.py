"""Whether the process that writes a board (or sent a summary) still runs: a rank gone
without leaving through its exit path was killed or crashed. Only a process on this host
can be looked at."""

from __future__ import annotations

import os

__all__ = ["HOST_BYTES", "process_alive"]

HOST_BYTES = 63  # of the host name that a board keeps


def process_alive(pid: int, host: str) -> bool | None:
    """Whether process ``pid`` of ``host`` runs and is not a zombie (a killed child not yet
    reaped); None when it ran on another host."""
    if host and host[:HOST_BYTES] != os.uname().nodename[:HOST_BYTES]:
        return None
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False
