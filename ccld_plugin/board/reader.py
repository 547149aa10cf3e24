"""Reading boards: a zero-copy numpy view of a rank's board file, from any process.

The dtypes are derived from the offsets that the native extension exports, so the layout
is defined once, in ``csrc/board.h``. Records that can change while a rank runs (op ring,
channel table) are copied with the native seqlock copy, which never returns a torn record;
the header and group table are read in place.

Works on the board of a live rank, of a hung rank, and of a rank that was killed: the file
stays in shared memory until it is removed.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import ccld_plugin._native as _native
from ccld_plugin.wire.topology import GroupInfo, role_name

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


class BoardError(ValueError):
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
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise BoardError(f"{self.path}: cannot open board ({exc.strerror})") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_DTYPE.itemsize:
                raise BoardError(
                    f"{self.path}: {size} bytes is too small for a board "
                    f"(header alone is {HEADER_DTYPE.itemsize}); the file is truncated or foreign"
                )
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
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
        self._hdr = self._groups = self._ring = self._channels = self._rank_pool = None
        self._buf = None
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
        """A copy of the registered groups' records."""
        n = min(int(self._hdr[0]["num_groups"]), self.max_groups)
        return self._groups[:n].copy()

    def groups(self) -> list[GroupInfo]:
        out = []
        for g in self.group_table():
            off, size = int(g["ranks_off"]), int(g["size"])
            ranks = tuple(int(r) for r in self._rank_pool[off : off + size])
            out.append(GroupInfo(int(g["group_id"]), role_name(int(g["role"])), ranks))
        return out

    def ops(self) -> np.ndarray:
        """Consistent op records, oldest first; torn or empty slots are dropped."""
        copy = np.empty_like(self._ring)
        _native.copy_records(self._ring, copy, OP_DTYPE.itemsize)
        recs = copy.view(OP_DTYPE)
        keep = ((recs["lock"] & 1) == 0) & (recs["state"] != 0)
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
        return recs[((recs["lock"] & 1) == 0) & (recs["source"] != 0)]


def board_files(path: str | os.PathLike[str]) -> list[Path]:
    """The board files at ``path``: the file itself, or every ``*.board`` below a directory."""
    p = Path(path)
    if p.is_dir():
        return sorted(p.rglob("*.board"), key=lambda f: (len(f.name), f.name))
    return [p]
