"""A node's summaries in shared memory, and who of the node publishes them.

Every rank's agent writes its packed summary each tick beside its board
(``rank<r>.summary``, in the board folder in /dev/shm): the whole summary, because three of
its parts exist only in the rank's own process (the step times of its Python step clock and
its tracer's async waits, the TCP probe of its own sockets, its main thread's stack). The
node leader, the lowest local rank that is alive, fresh and able to publish, reads them and
publishes the node's frame (``wire.node_summary``); the others make no store request per
tick. A leader that dies, freezes or loses the store stops being chosen at the next tick of
the others, and the next local rank leads.

Where a rank cannot see a lower rank of its node (no summary file: it has not started, it
left, or its /dev/shm is not this rank's, as with one container per GPU), or sees it in
another network namespace (another host as far as the network goes), the node is not
what the configuration says: the rank publishes its own key, and leads nothing, so that
no two leaders write one node's key.

A summary file starts with a header: its magic, flags (EXITED, STORE_LOST), the writer's
pid, the tick it was written at (agent ticks are aligned on the diagnoser's clock, so all
ranks count the same ticks), the job's start time (which tells a file left by an earlier
run of the same job name from this run's) and the writer's network namespace.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "EXITED",
    "FRESH_TICKS",
    "STORE_LOST",
    "LocalSummary",
    "choose_leader",
    "network_namespace",
    "read_local",
    "remove_local",
    "summary_path",
    "write_local",
]

MAGIC = b"CCLs"
_HEAD = struct.Struct("<4sBxxxiqqQ")  # magic, flags, pid, tick, job start, netns
EXITED = 1  # the rank left through its exit path
STORE_LOST = 2  # the rank's store requests fail: it cannot publish for the node
# A leader whose last summary is older than this many ticks is not leading any more (a
# frozen process, a wedged agent); one tick late is a loaded host.
FRESH_TICKS = 1


@dataclass(frozen=True)
class LocalSummary:
    """One rank's summary file, read back."""

    flags: int
    pid: int
    tick: int
    job_start_ns: int
    net: int  # the writer's network namespace (its inode; 0: unknown)
    summary: bytes

    def of_node(self, job_start_ns: int, net: int) -> bool:
        """Whether the file is of this run and of the network of ``net``."""
        return self.job_start_ns == job_start_ns and (self.net == net or 0 in (self.net, net))


def network_namespace() -> int:
    """This process's network namespace, as the inode of its /proc entry (0: unknown)."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def summary_path(board: Path) -> Path:
    return board.with_suffix(".summary")


def write_local(path: Path, s: LocalSummary) -> None:
    """Replace the file atomically: a reader sees the old summary or the new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        head = _HEAD.pack(MAGIC, s.flags, s.pid, s.tick, s.job_start_ns, s.net)
        os.write(fd, head + s.summary)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_local(path: Path) -> LocalSummary | None:
    """The file's summary, or None when there is none (not written yet, removed at exit)
    or it is not one of ours."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    if len(data) < _HEAD.size:
        return None
    magic, flags, pid, tick, job_start, net = _HEAD.unpack_from(data)
    if magic != MAGIC:
        return None
    return LocalSummary(flags, pid, tick, job_start, net, data[_HEAD.size :])


def remove_local(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.with_name(path.name + ".tmp").unlink(missing_ok=True)


def choose_leader(
    me: int,
    lower: Iterable[int],
    read: Callable[[int], LocalSummary | None],
    tick: int,
    job_start_ns: int,
    net: int,
    alive: Callable[[int], bool | None],
) -> int | None:
    """Who leads ``me``'s node at ``tick``, as ``me`` sees it: the first of the node's
    ranks below ``me`` (``lower``, in order) that can lead, ``me`` when every one of them
    is seen unable to (gone, frozen, left, without the store), or None when one of them
    cannot be seen as of this node (no file of this run, another network namespace):
    ``me`` then publishes its own key. ``alive(pid)`` says whether a process runs (None:
    unknown, taken as alive). Files are read only up to the first rank that decides."""
    for rank in lower:
        s = read(rank)
        if s is None or not s.of_node(job_start_ns, net):
            return None
        if (
            not s.flags & (EXITED | STORE_LOST)
            and s.tick >= tick - FRESH_TICKS
            and alive(s.pid) is not False
        ):
            return rank
    return me
