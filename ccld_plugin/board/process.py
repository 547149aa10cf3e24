"""Whether the process that writes a board (or sent a summary) still runs: a rank gone
without leaving through its exit path was killed or crashed. Only a process on this host
can be looked at."""

from __future__ import annotations

import os

__all__ = ["HOST_BYTES", "PF_EXITING", "process_alive", "running"]

HOST_BYTES = 63  # of the host name that a board keeps


# The kernel's task flag for a process in do_exit (include/linux/sched.h). A killed
# process closes its sockets before it becomes a zombie: its peers fail and leave while
# its state still reads running, and a node leader that took it for alive then told the
# rank as its last summary had it, a step before its death.
PF_EXITING = 0x4


def process_alive(pid: int, host: str) -> bool | None:
    """Whether process ``pid`` of ``host`` runs: not a zombie (a killed child not yet
    reaped) and not exiting; None when it ran on another host."""
    if host and host[:HOST_BYTES] != os.uname().nodename[:HOST_BYTES]:
        return None
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return running(fh.read())
    except OSError:
        return False


def running(stat: str) -> bool:
    """Whether a process whose /proc/<pid>/stat reads ``stat`` runs (see process_alive)."""
    try:
        fields = stat.rsplit(")", 1)[1].split()
        return fields[0] not in ("Z", "X") and not int(fields[6]) & PF_EXITING
    except (IndexError, ValueError):
        return False
