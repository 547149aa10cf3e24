"""Per-peer channel records and their wire codec, shared by the agents and the diagnoser.

Every agent tick a rank puts, inside its summary (``RankSummary.channels``), one compact
entry per peer rank it exchanges data with: from its TCP connections
(``ccld_plugin.probes.tcp_channels``) or from the NCCL profiler plugin's channel records
(``ccld_plugin.probes.nccl_channels``). The diagnoser decodes them one rank at a time for a
hang's evidence (:func:`decode_channels`) and all ranks at once, as numpy rows, for slow
links over a window (:func:`channel_rows`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ccld_plugin.wire.codes import (
    DIRECTION_NAMES,
    SOURCE_NAMES,
    SOURCE_NCCL,
    SOURCE_TCP,
    WAIT_CODES,
    WAIT_NAMES,
    wait_name,
)
from ccld_plugin.wire.packed import gather, opaque, records
from ccld_plugin.wire.summary import RankSummary

__all__ = [
    "CHANNELS_VERSION",
    "MAX_ENTRIES",
    "ChannelReport",
    "ChannelRows",
    "PeerChannel",
    "WAIT_ORDER",
    "channel_rows",
    "channel_rows_at",
    "decode_channels",
    "encode_channels",
    "entry_order",
]

# v4: sources use the board's codes (tcp 2, nccl 1; v3 had tcp 0, nccl 1)
CHANNELS_VERSION = 4
WAIT_ORDER = WAIT_CODES  # the wait codes also rank them: which wait an entry shows

# A value: the head (version, entries, NCCL entries among them, interval ms, connections
# mapped to ranks), the entries, then the NCCL entries' wait times in their order. Fixed
# size entries side by side let the diagnoser decode every rank's at once (ChannelRows).
_HEAD = struct.Struct("<BBBHH")
_ENTRY_FIELDS = (  # (name, struct code); shares are x/255, stalled in 10 ms units
    ("peer", "i"),
    ("wait", "B"),
    ("direction", "B"),
    ("conns", "B"),
    ("rtos", "B"),
    ("sent", "I"),
    ("received", "I"),
    ("queued", "I"),
    ("rtt_us", "I"),
    ("min_rtt_us", "I"),
    ("retrans", "H"),
    ("rwnd", "B"),
    ("sndbuf", "B"),
    ("busy", "B"),
    ("stalled", "H"),
    ("source", "B"),
)
_ENTRY = struct.Struct("<" + "".join(code for _, code in _ENTRY_FIELDS))
_NCCL_WAITS = struct.Struct("<III")  # local, peer and network wait (us)
_WAIT_FIELDS = ("local_wait_us", "peer_wait_us", "net_wait_us")
ENTRY_DTYPE = np.dtype([(name, "<" + code) for name, code in _ENTRY_FIELDS])
ROW_DTYPE = np.dtype(
    [
        ("rank", "<i4"),
        ("mid_ns", "<i8"),
        ("interval_s", "<f8"),
        *ENTRY_DTYPE.descr,
        *((w, "<u4") for w in _WAIT_FIELDS),
    ]
)
_SOURCE_CODES = {name: code for code, name in SOURCE_NAMES.items()}
MAX_ENTRIES = 12  # keeps a rank's channel evidence under ~450 bytes per tick


class PeerChannel(NamedTuple):
    """One rank's connections to one peer rank over one agent interval.

    Source "tcp": the rank's TCP connections to the peer. Source "nccl": the NCCL channels
    of one direction to the peer (``conns`` counts channels, ``queued`` is the bytes of
    steps posted and not done, the TCP-only fields are 0)."""

    peer: int
    wait: str  # none / local / peer / network: the worst of its connections
    direction: str  # send or recv: the side the wait is about (else the busier one)
    conns: int
    rtos: int  # consecutive retransmission timeouts (worst connection)
    sent: int  # bytes acknowledged by the peer in the interval
    received: int  # bytes received in the interval
    queued: int  # bytes written and not yet acknowledged (recv side: not yet read)
    rtt_us: int  # smoothed RTT (worst connection that carried data)
    min_rtt_us: int  # the path's floor
    retrans: int  # segments retransmitted in the interval
    rwnd_share: float  # share of the interval stalled by the peer's receive window
    sndbuf_share: float  # ... by our own send buffer
    busy_share: float  # ... with a non-empty send queue
    stalled_s: float  # how long queued bytes have not moved (0: nothing queued)
    source: str = "tcp"
    # NCCL only: time the steps of this direction spent waiting in the interval, summed
    # over steps (pipelined steps overlap), from the plugin's per-link totals.
    local_wait_us: int = 0  # on this rank's GPU
    peer_wait_us: int = 0  # on the peer's credit
    net_wait_us: int = 0  # handed to the network (send) / for data (recv)


@dataclass(frozen=True, slots=True)
class ChannelReport:
    """The channel evidence of one rank's summary."""

    rank: int
    time_ns: int  # the summary's time (diagnoser clock): end of the interval
    interval_s: float
    conns: int  # connections mapped to peer ranks
    entries: tuple[PeerChannel, ...]

    def to(self, peer: int) -> PeerChannel | None:
        return next((e for e in self.entries if e.peer == peer), None)


def _share(x: float) -> int:
    return max(0, min(255, round(x * 255)))


def _u32(v: int) -> int:
    return max(0, min(int(v), 0xFFFFFFFF))


def entry_order(e: PeerChannel) -> tuple[int, float, int]:
    """Sort key of a summary's entries: the worst waits, the longest stalls, the busiest
    links first (what survives the MAX_ENTRIES cut)."""
    return (-WAIT_ORDER[e.wait], -e.stalled_s, -(e.sent + e.received))


def encode_channels(entries: Iterable[PeerChannel], interval_s: float, conns: int) -> bytes:
    """The ``channels`` bytes of a summary (at most MAX_ENTRIES entries, in order)."""
    rows = list(entries)[:MAX_ENTRIES]
    nccl = [e for e in rows if e.source == "nccl"]
    parts = [
        _HEAD.pack(
            CHANNELS_VERSION,
            len(rows),
            len(nccl),
            min(int(interval_s * 1000), 0xFFFF),
            min(conns, 0xFFFF),
        )
    ]
    for e in rows:
        parts.append(
            _ENTRY.pack(
                e.peer,
                WAIT_CODES[e.wait],
                DIRECTION_NAMES.index(e.direction),
                min(e.conns, 255),
                min(e.rtos, 255),
                _u32(e.sent),
                _u32(e.received),
                _u32(e.queued),
                _u32(e.rtt_us),
                _u32(e.min_rtt_us),
                min(e.retrans, 0xFFFF),
                _share(e.rwnd_share),
                _share(e.sndbuf_share),
                _share(e.busy_share),
                min(round(e.stalled_s * 100), 0xFFFF),
                _SOURCE_CODES[e.source],
            )
        )
    for e in nccl:
        parts.append(
            _NCCL_WAITS.pack(_u32(e.local_wait_us), _u32(e.peer_wait_us), _u32(e.net_wait_us))
        )
    return b"".join(parts)


def _layout(data: bytes) -> tuple[int, int, float, int] | None:
    """(entries, NCCL entries, interval s, connections) of a well-formed value, else None."""
    if len(data) < _HEAD.size or data[0] != CHANNELS_VERSION:
        return None
    _, n, k, interval_ms, conns = _HEAD.unpack_from(data)
    if k > n or n > MAX_ENTRIES or len(data) != _HEAD.size + n * _ENTRY.size + k * _NCCL_WAITS.size:
        return None
    return n, k, interval_ms / 1000, conns


def _entries_ok(raw: np.ndarray) -> np.ndarray:
    """Per entry (ENTRY_DTYPE): its codes are ones the encoder writes (a value with any
    other is corrupt or foreign, and is left out whole)."""
    return (
        (raw["peer"] >= 0)
        & (raw["wait"] < len(WAIT_NAMES))
        & (raw["direction"] < len(DIRECTION_NAMES))
        & ((raw["source"] == SOURCE_TCP) | (raw["source"] == SOURCE_NCCL))
    )


def decode_channels(rank: int, time_ns: int, data: bytes) -> ChannelReport | None:
    """Inverse of :func:`encode_channels`; None for an empty, foreign or corrupt value."""
    layout = _layout(data)
    if layout is None:
        return None
    n, k, interval_s, conns = layout
    if not _entries_ok(np.frombuffer(data, ENTRY_DTYPE, n, _HEAD.size)).all():
        return None
    waits = list(_NCCL_WAITS.iter_unpack(data[_HEAD.size + n * _ENTRY.size :]))
    entries = []
    for (
        peer,
        wait,
        direction,
        nconn,
        rtos,
        sent,
        received,
        queued,
        rtt,
        min_rtt,
        retrans,
        rwnd,
        sndbuf,
        busy,
        stalled,
        source,
    ) in _ENTRY.iter_unpack(data[_HEAD.size : _HEAD.size + n * _ENTRY.size]):
        src = "nccl" if source == SOURCE_NCCL else "tcp"
        if src == "nccl" and not waits:
            return None  # more NCCL entries than the head said
        local_w, peer_w, net_w = waits.pop(0) if src == "nccl" else (0, 0, 0)
        entries.append(
            PeerChannel(
                peer=peer,
                wait=wait_name(wait),
                direction=DIRECTION_NAMES[direction],
                conns=nconn,
                rtos=rtos,
                sent=sent,
                received=received,
                queued=queued,
                rtt_us=rtt,
                min_rtt_us=min_rtt,
                retrans=retrans,
                rwnd_share=rwnd / 255,
                sndbuf_share=sndbuf / 255,
                busy_share=busy / 255,
                stalled_s=stalled / 100,
                source=src,
                local_wait_us=local_w,
                peer_wait_us=peer_w,
                net_wait_us=net_w,
            )
        )
    if waits:
        return None
    return ChannelReport(rank, time_ns, interval_s, conns, tuple(entries))


@dataclass(frozen=True, slots=True)
class ChannelRows:
    """The channel evidence of many summaries at once, for windows over thousands of ranks:
    ``reports`` one row per summary (rank, mid_ns: the middle of its interval), ``entries``
    one ROW_DTYPE row per entry (raw values: shares x/255, codes as in ``wire.codes``)."""

    reports: np.ndarray
    entries: np.ndarray

    @staticmethod
    def concat(parts: list[ChannelRows]) -> ChannelRows:
        if not parts:
            return channel_rows([])
        if len(parts) == 1:
            return parts[0]
        return ChannelRows(
            _rows_concat([p.reports for p in parts]), _rows_concat([p.entries for p in parts])
        )

    def between(self, t0: int, t1: int) -> ChannelRows:
        """The reports whose interval lies mostly in (t0, t1] and their entries."""
        keep = (self.reports["mid_ns"] > t0) & (self.reports["mid_ns"] <= t1)
        mid = self.entries["mid_ns"]
        entries = (mid > t0) & (mid <= t1)
        if keep.all() and entries.all():
            return self  # a batch inside the window (most of them): not copied
        return ChannelRows(_rows_take(self.reports, keep), _rows_take(self.entries, entries))


# Rows copied as opaque records (3x faster for a window of 16,384 ranks' entries).
def _rows_take(rows: np.ndarray, keep: np.ndarray) -> np.ndarray:
    return rows.view(opaque(rows.dtype))[keep].view(rows.dtype)


def _rows_concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([p.view(opaque(p.dtype)) for p in parts]).view(parts[0].dtype)


_REPORT_DTYPE = np.dtype([("rank", "<i4"), ("mid_ns", "<i8"), ("interval_s", "<f8")])
_HEAD_DTYPE = np.dtype(
    [("version", "u1"), ("n", "u1"), ("k", "u1"), ("interval_ms", "<u2"), ("conns", "<u2")]
)
_WAITS_DTYPE = np.dtype([(w, "<u4") for w in _WAIT_FIELDS])
assert _HEAD_DTYPE.itemsize == _HEAD.size and _WAITS_DTYPE.itemsize == _NCCL_WAITS.size


def _offset_in_row(dtype: np.dtype) -> int:
    """Where ``dtype``'s fields lie in a ROW_DTYPE row, laid out as in ``dtype`` (checked)."""
    fields, row = dtype.fields, ROW_DTYPE.fields
    assert dtype.names is not None and fields is not None and row is not None
    at = row[dtype.names[0]][1]
    for name in dtype.names:
        assert row[name][:2] == (fields[name][0], at + fields[name][1]), name
    return at


_ENTRY_AT, _WAITS_AT = _offset_in_row(ENTRY_DTYPE), _offset_in_row(_WAITS_DTYPE)


def channel_rows(summaries: Iterable[RankSummary]) -> ChannelRows:
    """The channel evidence of ``summaries`` as rows (values not well formed, or with an
    entry that is not, are left out, as :func:`decode_channels` leaves them)."""
    objs = list(summaries)
    sizes = np.array([len(s.channels) for s in objs], np.int64)
    starts = np.cumsum(sizes) - sizes
    return channel_rows_at(
        b"".join(s.channels for s in objs),
        starts,
        sizes,
        np.array([s.rank for s in objs], np.int64),
        np.array([s.time_ns for s in objs], np.int64),
    )


def channel_rows_at(
    blob: bytes, at: np.ndarray, size: np.ndarray, ranks: np.ndarray, time_ns: np.ndarray
) -> ChannelRows:
    """The channel evidence values of ``size`` bytes at ``at`` in ``blob`` (of the
    summaries of ``ranks``, made at ``time_ns``) as rows, read in a few gathers; the values
    that :func:`decode_channels` refuses are left out."""
    head = gather(blob, np.where(size >= _HEAD.size, at, 0), _HEAD_DTYPE)
    n, k = head["n"].astype(np.int64), head["k"].astype(np.int64)
    ok = (
        (size >= _HEAD.size)
        & (head["version"] == CHANNELS_VERSION)
        & (k <= n)
        & (n <= MAX_ENTRIES)
        & (size == _HEAD.size + n * _ENTRY.size + k * _NCCL_WAITS.size)
    )
    n, k = np.where(ok, n, 0), np.where(ok, k, 0)
    entries_at = at + _HEAD.size
    raw, which = records(blob, entries_at, n, ENTRY_DTYPE)
    waits, _ = records(blob, entries_at + n * _ENTRY.size, k, _WAITS_DTYPE)
    nccl = raw["source"] == SOURCE_NCCL
    bad = np.bincount(which, weights=~_entries_ok(raw), minlength=len(ok))
    ok &= (np.bincount(which, weights=nccl, minlength=len(ok)) == k) & (bad == 0)
    keep = ok[which]
    if not keep.all():  # (a copy of ~200,000 entries at 65,536 ranks: only when needed)
        raw, which, nccl = raw[keep], which[keep], nccl[keep]
        waits = waits[np.repeat(ok, k)]
    interval_s = head["interval_ms"][ok] / 1000
    reports = np.zeros(int(ok.sum()), _REPORT_DTYPE)
    reports["rank"] = ranks[ok]
    reports["mid_ns"] = time_ns[ok] - (interval_s * 5e8).astype(np.int64)
    reports["interval_s"] = interval_s
    which = (np.cumsum(ok) - 1)[which]  # renumbered among the reports kept
    rows = np.zeros(len(raw), ROW_DTYPE)
    assert _REPORT_DTYPE.names is not None
    cells = rows.view(np.uint8).reshape(len(rows), ROW_DTYPE.itemsize)
    # the entries' and waits' bytes as sent: one copy each, not one per field
    cells[:, _ENTRY_AT : _ENTRY_AT + ENTRY_DTYPE.itemsize] = _bytes_of(raw)
    cells[nccl, _WAITS_AT : _WAITS_AT + _WAITS_DTYPE.itemsize] = _bytes_of(waits)
    for name in _REPORT_DTYPE.names:
        rows[name] = reports[name][which]
    return ChannelRows(reports, rows)


def _bytes_of(rows: np.ndarray) -> np.ndarray:
    """Packed records as a matrix of their bytes, one row each."""
    size = rows.dtype.itemsize
    return np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), size)
