"""How many ranks of a demo this host can run now: its free memory over a rank's measured
footprint, and the processes and threads it may still start over a rank's threads.

Each rank is a whole Python process with torch (and its framework) loaded; past this bound
ranks are killed by the kernel for memory, or fail to start, long before any diagnosis.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RANK_RSS_MIB", "RANK_THREADS", "Capacity", "host_capacity", "ranks_that_fit"]

# The resident memory of one rank (rank 0, which also runs the diagnoser and the W&B sink:
# the largest), training at step 15 of a healthy 4-rank demo on a 2-core x86_64 host (torch
# 2.13, megatron-core 0.16.1, deepspeed 0.19.8): 353, 388 and 489 MiB, rounded up. Measured
# with `ccld demo --framework F --world 4 --fault none --steps 400 --out /tmp/m` running and
# `grep VmRSS /proc/$(pgrep -f board.dir=/tmp/m | head -1)/status`.
RANK_RSS_MIB = {"torch": 360, "megatron": 400, "deepspeed": 500}
# The threads of one rank in the same runs (`grep Threads` in the same file): 10-16 for
# torch and deepspeed, 64-73 for megatron; each takes a pid of the kernel's pid space.
RANK_THREADS = {"torch": 16, "megatron": 80, "deepspeed": 16}
# cgroup v1 writes "no limit" as a page-rounded 2**63 - 1.
_NO_LIMIT = 1 << 62


@dataclass(frozen=True)
class Capacity:
    """The most ranks that fit, and why no more, in words."""

    ranks: int
    why: str


def ranks_that_fit(framework: str, memory_bytes: int, tasks_free: int) -> Capacity:
    """The ranks of ``framework`` that ``memory_bytes`` of free memory and ``tasks_free``
    more processes or threads hold."""
    rss, threads = RANK_RSS_MIB[framework], RANK_THREADS[framework]
    by_memory = max(0, memory_bytes) // (rss << 20)
    by_tasks = max(0, tasks_free) // threads
    if by_memory <= by_tasks:
        gib = memory_bytes / (1 << 30)
        return Capacity(by_memory, f"{gib:.1f} GiB of memory available, {rss} MiB per rank")
    return Capacity(by_tasks, f"room for {tasks_free:,} more processes/threads, {threads} per rank")


def host_capacity(framework: str) -> Capacity:
    """:func:`ranks_that_fit` with this host's (and its cgroup's) free memory and tasks."""
    return ranks_that_fit(framework, memory_available(), tasks_free())


def memory_available() -> int:
    """Bytes of memory that new processes can use: the kernel's MemAvailable, or what the
    cgroup's limit leaves, whichever is less."""
    available = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    room = _cgroup_room("memory", ("memory.max", "memory.current"))
    room_v1 = _cgroup_room("memory", ("memory.limit_in_bytes", "memory.usage_in_bytes"), v1=True)
    return min(x for x in (available, room, room_v1) if x is not None)


def tasks_free() -> int:
    """How many more processes or threads the kernel (and the cgroup) lets start: every
    task takes a pid, root is not held to RLIMIT_NPROC."""
    in_use = int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    limits = [_read_int("/proc/sys/kernel/pid_max"), _read_int("/proc/sys/kernel/threads-max")]
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY:
        limits.append(soft)
    free = min(x for x in limits if x is not None) - in_use
    for room in (
        _cgroup_room("pids", ("pids.max", "pids.current")),
        _cgroup_room("pids", ("pids.max", "pids.current"), v1=True),
    ):
        if room is not None:
            free = min(free, room)
    return free


def _cgroup_room(controller: str, files: tuple[str, str], v1: bool = False) -> int | None:
    """The limit less the use of this process's cgroup (v2, or v1's ``controller``
    hierarchy), None where there is no such cgroup or no limit."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if v1 == (hierarchy == "0") or (v1 and controller not in controllers.split(",")):
            continue
        root = Path("/sys/fs/cgroup") / (controller if v1 else "")
        folder = root / path.lstrip("/")
        limit, used = (_read_int(folder / name) for name in files)
        if limit is not None and used is not None and limit < _NO_LIMIT:
            return limit - used
    return None


def _read_int(path: str | Path) -> int | None:
    """An integer file of /proc or /sys; None when absent or "max" (no limit)."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
