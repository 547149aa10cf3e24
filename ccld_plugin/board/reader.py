"""Reading boards: a zero-copy numpy view of a rank's board file, from any process.

The dtypes are derived from the offsets that the native extension exports, so the layout
is defined once, in ``csrc/board.h``. Records that can change while a rank runs (op ring,
channel table) are copied with the native seqlock copy, which never returns a torn record;
the header and group table are read in place.

Works on the board of a live rank, of a hung rank, and of a rank that was killed: the file
stays in shared memory until it is removed.

Nothing read is taken on trust: a header whose layout or values are impossible is refused
(:class:`BoardError`), and records that fail their own checks (the seqlock, codes and
ranges, agreement with the header and the group table) are left out and counted in
``BoardReader.corrupt``, never returned as data.
"""

from __future__ import annotations

import mmap
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import ccld_plugin._native as _native
from ccld_plugin.files import FileError, OneLineError, open_regular, os_problem
from ccld_plugin.topology import GROUP_ROLES, GroupInfo, role_name
from ccld_plugin.wire.codes import (
    DIRECTION_NAMES,
    FLAG_ASYNC,
    FLAG_CUDA,
    FLAG_DEVICE,
    FLAG_P2P,
    FLAG_SEND,
    OP_NAMES,
    SOURCE_NCCL,
    SOURCE_TCP,
    STATE_ERROR,
    STATE_IN_FLIGHT,
    TIME_POLL,
    WAIT_NAMES,
)

__all__ = [
    "BoardError",
    "BoardReader",
    "CHANNEL_DTYPE",
    "GROUP_DTYPE",
    "HEADER_DTYPE",
    "OP_DTYPE",
    "board_files",
]

_LAYOUT = _native.layout()
MAGIC: int = _LAYOUT["magic"]
VERSION: int = _LAYOUT["version"]


def _dtype(name: str) -> np.dtype:
    size, fields = _LAYOUT[name]
    return np.dtype(
        {
            "names": [f[0] for f in fields],
            "formats": [f[2] for f in fields],
            "offsets": [f[1] for f in fields],
            "itemsize": size,
        }
    )


HEADER_DTYPE = _dtype("header")
GROUP_DTYPE = _dtype("group")
OP_DTYPE = _dtype("op")
CHANNEL_DTYPE = _dtype("channel")

# Bounds of what a writer can give; a value beyond is a corrupt record (or header). They
# also keep every sum the readers make within 64 bits: a ring of MAX_RING ops of
# MAX_OP_BYTES each, differences of two times each shifted by a clock offset.
MAX_COUNT = 1 << 48  # seqs, counters, microseconds
MAX_OP_BYTES = 1 << 40  # one op's bytes: more than any device holds
MAX_RING = 1 << 20  # ops (board.ring_size's largest)
MAX_CHANNELS = 1 << 16  # channel records (board.max_channels' largest)
MAX_STEP = 2**31 - 1  # an op record keeps its step in 32 bits
MAX_TIME_NS = 1 << 60  # 36 years of a monotonic clock; also the largest clock offset
MAX_WALL_NS = 1 << 62  # the year 2116
LATE_NS = 1_000_000_000  # a local board's times may pass the reader's clock by this much
_OP_FLAGS = FLAG_ASYNC | FLAG_P2P | FLAG_SEND | FLAG_CUDA | FLAG_DEVICE
_COUNTS = (
    "steps_posted",
    "steps_done",
    "bytes_done",
    "bytes_queued",
    "rwnd_limited_us",
    "sndbuf_limited_us",
    "busy_us",
    "delivery_rate",
)  # the channel record's counters


def _align64(v: int) -> int:
    return (v + 63) & ~63


class BoardError(OneLineError):
    """A file that is not a readable board; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class BoardHeader:
    rank: int
    world: int
    pid: int
    host: str
    job: str
    start_wall_ns: int
    start_mono_ns: int
    heartbeat_ns: int
    step: int
    step_start_ns: int
    ops_written: int
    errors: int
    clock_offset_ns: int
    closed: bool


class BoardReader:
    """A read-only view of one board file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            fd = open_regular(self.path, "a board file")
        except FileError as exc:
            raise BoardError(str(exc)) from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_DTYPE.itemsize:
                raise BoardError(
                    f"{self.path}: {size} bytes is too small for a board "
                    f"(header alone is {HEADER_DTYPE.itemsize}); the file is truncated or foreign"
                )
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except OSError as exc:
            raise BoardError(os_problem(self.path, exc)) from None
        finally:
            os.close(fd)
        self._buf = np.frombuffer(self._map, dtype=np.uint8)
        hdr = self._buf[: HEADER_DTYPE.itemsize].view(HEADER_DTYPE)[0]
        if int(hdr["magic"]) != MAGIC:
            raise BoardError(f"{self.path}: not a ccld board (bad magic number)")
        if int(hdr["version"]) != VERSION:
            raise BoardError(
                f"{self.path}: board version {int(hdr['version'])}, this reader knows {VERSION};"
                " read it with the ccld_plugin release that wrote it"
            )
        if int(hdr["file_size"]) != size:
            raise BoardError(
                f"{self.path}: file is {size} bytes but its header says {int(hdr['file_size'])};"
                " the file is truncated"
            )
        self._hdr = self._buf[: HEADER_DTYPE.itemsize].view(HEADER_DTYPE)
        h = self._hdr[0]
        self._local = bytes(h["host"]).split(b"\0")[0] == socket.gethostname().encode()
        problem = _header_problem(h, size, self._latest())
        if problem is not None:
            raise BoardError(
                f"{self.path}: corrupt header ({problem}); the board cannot be trusted, "
                "read the other ranks' boards"
            )
        # records left out of the last read of each table, as failing their checks
        self.corrupt: dict[str, int] = {"groups": 0, "ops": 0, "channels": 0}
        self.ring_size = int(h["ring_size"])
        self.max_groups = int(h["max_groups"])
        self.max_channels = int(h["max_channels"])
        self._groups = self._table(int(h["groups_off"]), self.max_groups, GROUP_DTYPE)
        self._ring = self._buf[
            int(h["ring_off"]) : int(h["ring_off"]) + self.ring_size * OP_DTYPE.itemsize
        ]
        self._channels = self._buf[
            int(h["channels_off"]) : int(h["channels_off"])
            + self.max_channels * CHANNEL_DTYPE.itemsize
        ]
        pool_off = int(h["rank_pool_off"])
        self._rank_pool = self._buf[pool_off : pool_off + 4 * int(h["rank_pool_size"])].view("<i4")

    def _table(self, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
        end = offset + count * dtype.itemsize
        if end > len(self._buf):
            raise BoardError(f"{self.path}: table past the end of the file; the file is corrupt")
        return self._buf[offset:end].view(dtype)

    def close(self) -> None:
        # The views into the map go first (an mmap does not close while buffers into it are
        # exported). Deleted rather than set to None, so that they stay typed as arrays: a
        # closed reader has none, and using it raises AttributeError.
        for view in ("_hdr", "_groups", "_ring", "_channels", "_rank_pool", "_buf"):
            self.__dict__.pop(view, None)
        self._map.close()

    def __enter__(self) -> BoardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def header(self) -> BoardHeader:
        h = self._hdr[0]
        return BoardHeader(
            rank=int(h["rank"]),
            world=int(h["world"]),
            pid=int(h["pid"]),
            host=bytes(h["host"]).decode(errors="replace"),
            job=bytes(h["job"]).decode(errors="replace"),
            start_wall_ns=int(h["start_wall_ns"]),
            start_mono_ns=int(h["start_mono_ns"]),
            heartbeat_ns=int(h["heartbeat_ns"]),
            step=int(h["step"]),
            step_start_ns=int(h["step_start_ns"]),
            ops_written=int(h["ops_written"]),
            errors=int(h["errors"]),
            clock_offset_ns=int(h["clock_offset_ns"]),
            closed=bool(h["closed"]),
        )

    def group_table(self) -> np.ndarray:
        """A copy of the registered groups' records, in slot order up to the first that
        fails its checks (the table is append-only: the slots after a corrupt one are left
        out with it, so that every row returned is at its slot)."""
        n = min(int(self._hdr[0]["num_groups"]), self.max_groups)
        table = self._groups[:n].copy()
        bad = np.flatnonzero(~self._groups_ok(table))
        keep = int(bad[0]) if len(bad) else n
        self.corrupt["groups"] = n - keep
        return table[:keep]

    def groups(self) -> list[GroupInfo]:
        out = []
        for g in self.group_table():
            off, size = int(g["ranks_off"]), int(g["size"])
            ranks = tuple(int(r) for r in self._rank_pool[off : off + size])
            out.append(GroupInfo(int(g["group_id"]), role_name(int(g["role"])), ranks))
        return out

    def ops(self) -> np.ndarray:
        """Consistent op records, oldest first; torn or empty slots are dropped, and those
        that fail their checks are counted in ``corrupt["ops"]``."""
        copy = np.empty_like(self._ring)
        _native.copy_records(self._ring, copy, OP_DTYPE.itemsize)
        recs = copy.view(OP_DTYPE)
        used = ((recs["lock"] & 1) == 0) & (recs["state"] != 0)
        keep = used & self._ops_ok(recs)  # the table after the copy: it covers the records
        self.corrupt["ops"] = int((used & ~keep).sum())
        recs = recs[keep]
        # Ring order: the low 32 bits of the ring index, unwrapped against the newest.
        written = int(self._hdr[0]["ops_written"])
        age = (np.uint32(written & 0xFFFFFFFF) - recs["index_lo"]).astype(np.uint32)
        return recs[np.argsort(-age.astype(np.int64), kind="stable")]

    def channels(self) -> np.ndarray:
        """Consistent channel records that are in use."""
        copy = np.empty_like(self._channels)
        _native.copy_records(self._channels, copy, CHANNEL_DTYPE.itemsize)
        recs = copy.view(CHANNEL_DTYPE)
        used = ((recs["lock"] & 1) == 0) & (recs["source"] != 0)
        keep = used & self._channels_ok(recs)
        self.corrupt["channels"] = int((used & ~keep).sum())
        return recs[keep]

    # ------------------------------------------------------------------ record checks
    def _latest(self) -> int:
        """The latest time this board's clock can show: the reader's now for a board of
        this host (the same clock), else MAX_TIME_NS."""
        return time.monotonic_ns() + LATE_NS if self._local else MAX_TIME_NS

    def _when_ok(self, t: np.ndarray, unset_ok: bool = False) -> np.ndarray:
        """Times on this board's clock: after its start, not after :meth:`_latest` (0
        means unset where ``unset_ok``)."""
        ok = (t >= int(self._hdr[0]["start_mono_ns"])) & (t <= self._latest())
        return ok | (t == 0) if unset_ok else ok

    def _groups_ok(self, table: np.ndarray) -> np.ndarray:
        h = self._hdr[0]
        world, rank = int(h["world"]), int(h["rank"])
        pool = self._rank_pool[: min(int(h["rank_pool_used"]), len(self._rank_pool))]
        off, size = table["ranks_off"].astype(np.int64), table["size"].astype(np.int64)
        me = table["my_index"].astype(np.int64)
        fits = (size >= 1) & (size <= world) & (off + size <= len(pool)) & (me >= 0) & (me < size)
        in_world = np.concatenate(([0], np.cumsum((pool >= 0) & (pool < world))))
        start, end = np.where(fits, off, 0), np.where(fits, off + size, 0)
        padded = np.append(pool, -1)  # at len(pool): a rank that is never this one
        return (
            fits
            & (in_world[end] - in_world[start] == size)
            & (padded[np.where(fits, off + me, len(pool))] == rank)
            & (table["role"] >= 0)
            & (table["role"] < len(GROUP_ROLES))
            & (table["entered_seq"] < MAX_COUNT)
            & (table["completed_seq"] < MAX_COUNT)
            & self._when_ok(table["last_enter_ns"], unset_ok=True)
            & self._when_ok(table["last_exit_ns"], unset_ok=True)
        )

    def _ops_ok(self, recs: np.ndarray) -> np.ndarray:
        table = self.group_table()
        n = len(table)
        slot = np.minimum(recs["group_slot"].astype(np.int64), n)  # n: no such group
        group_id = np.append(table["group_id"], 0)[slot]
        entered = np.append(table["entered_seq"], 0)[slot]
        p2p = (recs["flags"] & FLAG_P2P) != 0
        peer, state = recs["peer"], recs["state"]
        position = np.arange(len(recs), dtype=np.uint32)
        return (
            (slot < n)
            & (group_id == recs["group_id"])
            & (recs["op"] < len(OP_NAMES))
            & (state <= STATE_ERROR)
            & ((recs["flags"] & np.uint8(0xFF ^ _OP_FLAGS)) == 0)
            & (p2p | ((recs["flags"] & FLAG_SEND) == 0))
            & ((recs["index_lo"] & np.uint32(self.ring_size - 1)) == position)
            & np.where(p2p, (peer >= -1) & (peer < int(self._hdr[0]["world"])), peer == -1)
            & (recs["seq"] >= 1)
            & (recs["seq"] < MAX_COUNT)
            & (p2p | (recs["seq"] <= entered))  # a collective's seq was entered first
            & (recs["step"] >= 0)
            & (recs["bytes"] < MAX_OP_BYTES)
            & self._when_ok(recs["enter_ns"])
            & np.where(
                state == STATE_IN_FLIGHT,
                recs["exit_ns"] == 0,
                (recs["exit_ns"] >= recs["enter_ns"]) & self._when_ok(recs["exit_ns"]),
            )
            & self._device_ok(recs)
        )

    def _device_ok(self, recs: np.ndarray) -> np.ndarray:
        """Device times: each unset or on this board's clock, from a known source, and an
        end not before its start."""
        start, end = recs["dev_start_ns"], recs["dev_end_ns"]
        src = recs["dev_source"]
        return (
            ((src & 0xF) <= TIME_POLL)
            & ((src >> 4) <= TIME_POLL)
            & self._when_ok(start, unset_ok=True)
            & self._when_ok(end, unset_ok=True)
            & ((start == 0) | (end == 0) | (end >= start))
        )

    def _channels_ok(self, recs: np.ndarray) -> np.ndarray:
        ok = (
            ((recs["source"] == SOURCE_TCP) | (recs["source"] == SOURCE_NCCL))
            & (recs["direction"] < len(DIRECTION_NAMES))
            & (recs["wait"] < len(WAIT_NAMES))
            & (recs["peer"] >= -1)
            & (recs["peer"] < int(self._hdr[0]["world"]))
            & self._when_ok(recs["first_ns"], unset_ok=True)
            & self._when_ok(recs["last_progress_ns"], unset_ok=True)
        )
        for name in (*_COUNTS, "seq"):
            ok &= recs[name] < MAX_COUNT
        return ok


def _header_problem(h: np.void, size: int, latest: int) -> str | None:
    """What is impossible in a header whose magic, version and size are right (None:
    nothing found): a layout other than the writer's, or values no writer gives (times
    after ``latest``, the latest its clock can show)."""
    ring, groups = int(h["ring_size"]), int(h["max_groups"])
    channels, pool = int(h["max_channels"]), int(h["rank_pool_size"])
    if int(h["header_size"]) != HEADER_DTYPE.itemsize or not _power_of_two(ring, MAX_RING):
        return f"header size {int(h['header_size'])}, ring of {ring} records"
    if channels > MAX_CHANNELS:
        return f"{channels} channel records"
    if not (1 <= groups <= 65535 and pool >= 1):
        return f"{groups} groups, a rank pool of {pool}"
    offsets = [_align64(HEADER_DTYPE.itemsize)]
    for n, dtype in ((groups, GROUP_DTYPE), (ring, OP_DTYPE), (channels, CHANNEL_DTYPE)):
        offsets.append(offsets[-1] + _align64(n * dtype.itemsize))
    found = [int(h[k]) for k in ("groups_off", "ring_off", "channels_off", "rank_pool_off")]
    if found != offsets or offsets[-1] + _align64(4 * pool) != size:
        return f"table offsets {found}, expected {offsets}"
    world, rank = int(h["world"]), int(h["rank"])
    if not (world >= 1 and 0 <= rank < world and int(h["pid"]) > 0):
        return f"rank {rank} of {world}, pid {int(h['pid'])}"
    if int(h["num_groups"]) > groups or int(h["rank_pool_used"]) > pool:
        return f"{int(h['num_groups'])} groups registered, {int(h['rank_pool_used'])} ranks"
    start, step = int(h["start_mono_ns"]), int(h["step"])
    times = (int(h["heartbeat_ns"]), int(h["step_start_ns"]) or start)
    if start <= 0 or min(times) < start or max(times) > latest:
        return f"start {start} ns, heartbeat {times[0]} ns, step start {times[1]} ns"
    counts, closed = (int(h["ops_written"]), int(h["errors"])), int(h["closed"])
    if not (0 <= step <= MAX_STEP and max(counts) < MAX_COUNT and closed <= 1):
        return f"step {step}, {counts[0]} ops written, {counts[1]} errors, closed {closed}"
    offset, wall = int(h["clock_offset_ns"]), int(h["start_wall_ns"])
    if abs(offset) > MAX_TIME_NS or not 0 < wall <= MAX_WALL_NS:
        return f"clock offset {offset} ns, started at {wall} ns (wall clock)"
    return None


def _power_of_two(n: int, most: int) -> bool:
    return 1 <= n <= most and not n & (n - 1)


def board_files(path: str | os.PathLike[str], skipped: list[str] | None = None) -> list[Path]:
    """The board files at ``path``: the path itself when it is not a folder, else every
    entry named ``*.board`` in it and in its sub-folders (of any kind: the reader refuses
    what is not a board). A folder that cannot be listed raises BoardError; a sub-folder,
    when ``skipped`` is given, is left out with a line appended there."""
    p = Path(path)
    try:
        is_dir = stat.S_ISDIR(os.stat(p).st_mode)
    except OSError:
        is_dir = False  # the reader says why it cannot be opened
    if not is_dir:
        return [p]
    found: list[Path] = []
    folders = [p]
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(folder) as entries:
                for e in entries:
                    if e.name.endswith(".board"):
                        found.append(Path(e.path))
                    elif e.is_dir(follow_symlinks=False):
                        folders.append(Path(e.path))
        except OSError as exc:
            problem = os_problem(folder, exc, "listed")
            if folder == p or skipped is None:
                raise BoardError(problem) from None
            skipped.append(f"{problem}; the boards in it are left out")
    return sorted(found, key=lambda f: (len(f.name), f.name))
