"""How long a thread has waited runnable for a CPU (Linux ``schedstat``).

On a host with more busy threads than cores, the scheduler holds each thread back a
stretch at a time: wall time a rank spends queued for a core, which is the host's doing,
not the rank's. A slow device or kernel keeps the rank busy or asleep, not queued (on a
GPU node with a core per rank this wait is ~0). The step clock leaves it out of a step's
compute; the fault injector sizes its stretch on compute without it.
"""

from __future__ import annotations

import os

__all__ = ["ThreadCpuWait"]


class ThreadCpuWait:
    """The runnable wait of the thread that made this object (its schedstat is opened
    then, and read with one ``pread`` a call); 0 where the kernel keeps none."""

    def __init__(self) -> None:
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = -1

    def ns(self) -> int:
        """Nanoseconds the thread has spent runnable, waiting for a CPU, since it began."""
        if self._fd < 0:
            return 0
        try:
            return int(os.pread(self._fd, 96, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return 0
