"""Channel evidence: what each rank's TCP connections say about where data waits.

Every agent tick a rank sends, inside its summary, one compact entry per peer rank it has
connections to (``RankSummary.channels``, encoded here and filled by
``ccld_plugin.channels``): bytes moved each way in the interval, bytes queued, RTT and its
floor, retransmissions, the share of the interval the sender was stalled by the peer's
receive window or its own send buffer, the wait class of ``transport.classify_wait`` and
how long queued data has not moved. Entries of source "nccl" come from the NCCL profiler
plugin's channel records instead (``ccld_plugin.nccl_channels``); their wait states are
read by ``diagnose.nccl_waits``.

This module is pure (no torch, no native code). It decodes those entries and answers,
for a hang (:func:`channel_evidence`, :func:`cut_off_rank`), which connections are
stalled and which rank (or link) is common to them: a sender whose bytes are not even
acknowledged waits on the network, one whose peer's receive window stays closed waits for
a receiver that does not read. Slow links over a window are ``diagnose.slow_links``'.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ccld_plugin.diagnose.records import Cause
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.summary import RankSummary
from ccld_plugin.topology import GroupInfo

__all__ = [
    "CHANNELS_VERSION",
    "ChannelReport",
    "ChannelRows",
    "Located",
    "PeerChannel",
    "WAIT_NAMES",
    "WAIT_ORDER",
    "channel_evidence",
    "common_culprit",
    "cut_off_rank",
    "cut_off_ranks",
    "channel_rows",
    "decode_channels",
    "encode_channels",
    "entry_order",
    "fmt_bytes",
    "is_silent",
    "report_of",
    "toward_lines",
]

CHANNELS_VERSION = 3
WAIT_NAMES = ("none", "local", "peer", "network")  # enum ccld_wait of board.h
_WAIT_CODE = {name: i for i, name in enumerate(WAIT_NAMES)}
WAIT_ORDER = {"none": 0, "local": 1, "peer": 2, "network": 3}  # which wait an entry shows
DIRECTIONS = ("send", "recv")
SOURCES = ("tcp", "nccl")

# A value: the head (version, entries, NCCL entries among them, interval ms, connections
# mapped to ranks), the entries, then the NCCL entries' wait times in their order. Fixed
# size entries side by side let the diagnoser decode every rank's at once (ChannelRows).
_HEAD = struct.Struct("<BBBHH")
_ENTRY_FIELDS = (  # (name, struct code); shares are x/255, stalled in 10 ms units
    ("peer", "i"), ("wait", "B"), ("direction", "B"), ("conns", "B"), ("rtos", "B"),
    ("sent", "I"), ("received", "I"), ("queued", "I"), ("rtt_us", "I"), ("min_rtt_us", "I"),
    ("retrans", "H"), ("rwnd", "B"), ("sndbuf", "B"), ("busy", "B"), ("stalled", "H"),
    ("source", "B"))
_ENTRY = struct.Struct("<" + "".join(code for _, code in _ENTRY_FIELDS))
_NCCL_WAITS = struct.Struct("<III")  # local, peer and network wait (us)
_WAIT_FIELDS = ("local_wait_us", "peer_wait_us", "net_wait_us")
ENTRY_DTYPE = np.dtype([(name, "<" + code) for name, code in _ENTRY_FIELDS])
ROW_DTYPE = np.dtype([("rank", "<i4"), ("mid_ns", "<i8"), ("interval_s", "<f8"),
                      *ENTRY_DTYPE.descr, *((w, "<u4") for w in _WAIT_FIELDS)])
SOURCE_TCP, SOURCE_NCCL = 0, 1
MAX_ENTRIES = 12  # keeps a rank's channel evidence under ~450 bytes per tick

# --- thresholds of the diagnoser ----------------------------------------------------------
#
# A hang's stalled connection: bytes queued and not acknowledged (or not let through by
# the receive window) for this long. Healthy connections acknowledge within milliseconds;
# one second of nothing is far outside that and well inside any hang threshold.
STALL_S = 1.0
# A rank whose summaries are this many agent intervals old has gone silent (its control
# plane may cross the same link as its data).
SILENT_INTERVALS = 2.5


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
class Located:
    """Where channel evidence puts a hang: the ranks (or the link) to name, the lines that
    say why, and whether the culprit is the compute side or communication."""

    ranks: list[int]
    link: list[int] | None
    lines: list[str]
    cause: Cause = Cause.COMMUNICATION


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
    parts = [_HEAD.pack(CHANNELS_VERSION, len(rows), len(nccl),
                        min(int(interval_s * 1000), 0xFFFF), min(conns, 0xFFFF))]
    for e in rows:
        parts.append(_ENTRY.pack(
            e.peer, _WAIT_CODE[e.wait], DIRECTIONS.index(e.direction), min(e.conns, 255),
            min(e.rtos, 255), _u32(e.sent), _u32(e.received), _u32(e.queued), _u32(e.rtt_us),
            _u32(e.min_rtt_us), min(e.retrans, 0xFFFF), _share(e.rwnd_share),
            _share(e.sndbuf_share), _share(e.busy_share),
            min(round(e.stalled_s * 100), 0xFFFF), SOURCES.index(e.source)))
    for e in nccl:
        parts.append(_NCCL_WAITS.pack(_u32(e.local_wait_us), _u32(e.peer_wait_us),
                                      _u32(e.net_wait_us)))
    return b"".join(parts)


def _layout(data: bytes) -> tuple[int, int, float, int] | None:
    """(entries, NCCL entries, interval s, connections) of a well-formed value, else None."""
    if len(data) < _HEAD.size or data[0] != CHANNELS_VERSION:
        return None
    _, n, k, interval_ms, conns = _HEAD.unpack_from(data)
    if k > n or len(data) != _HEAD.size + n * _ENTRY.size + k * _NCCL_WAITS.size:
        return None
    return n, k, interval_ms / 1000, conns


def decode_channels(rank: int, time_ns: int, data: bytes) -> ChannelReport | None:
    """Inverse of :func:`encode_channels`; None for an empty or foreign value."""
    layout = _layout(data)
    if layout is None:
        return None
    n, k, interval_s, conns = layout
    waits = list(_NCCL_WAITS.iter_unpack(data[_HEAD.size + n * _ENTRY.size:]))
    entries = []
    for (peer, wait, direction, nconn, rtos, sent, received, queued, rtt, min_rtt, retrans,
         rwnd, sndbuf, busy, stalled, source) in _ENTRY.iter_unpack(
            data[_HEAD.size:_HEAD.size + n * _ENTRY.size]):
        src = SOURCES[source] if source < len(SOURCES) else "tcp"
        if src == "nccl" and not waits:
            return None  # more NCCL entries than the head said
        local_w, peer_w, net_w = waits.pop(0) if src == "nccl" else (0, 0, 0)
        entries.append(PeerChannel(
            peer=peer, wait=WAIT_NAMES[wait] if wait < len(WAIT_NAMES) else "none",
            direction=DIRECTIONS[direction & 1], conns=nconn, rtos=rtos, sent=sent,
            received=received, queued=queued, rtt_us=rtt, min_rtt_us=min_rtt, retrans=retrans,
            rwnd_share=rwnd / 255, sndbuf_share=sndbuf / 255, busy_share=busy / 255,
            stalled_s=stalled / 100, source=src, local_wait_us=local_w,
            peer_wait_us=peer_w, net_wait_us=net_w))
    if waits:
        return None
    return ChannelReport(rank, time_ns, interval_s, conns, tuple(entries))


@dataclass(frozen=True, slots=True)
class ChannelRows:
    """The channel evidence of many summaries at once, for windows over thousands of ranks:
    ``reports`` one row per summary (rank, mid_ns: the middle of its interval), ``entries``
    one ROW_DTYPE row per entry (raw codes: shares x/255, waits as in WAIT_NAMES)."""

    reports: np.ndarray
    entries: np.ndarray

    @staticmethod
    def concat(parts: list[ChannelRows]) -> ChannelRows:
        if not parts:
            return channel_rows([])
        return ChannelRows(np.concatenate([p.reports for p in parts]),
                           np.concatenate([p.entries for p in parts]))

    def between(self, t0: int, t1: int) -> ChannelRows:
        """The reports whose interval lies mostly in (t0, t1] and their entries."""
        keep = (self.reports["mid_ns"] > t0) & (self.reports["mid_ns"] <= t1)
        mid = self.entries["mid_ns"]
        return ChannelRows(self.reports[keep], self.entries[(mid > t0) & (mid <= t1)])


_REPORT_DTYPE = np.dtype([("rank", "<i4"), ("mid_ns", "<i8"), ("interval_s", "<f8")])


def channel_rows(summaries: Iterable[RankSummary]) -> ChannelRows:
    """The channel evidence of ``summaries`` as rows (values not well formed are left out,
    as :func:`decode_channels` leaves them)."""
    reports, counts, nccl_counts, entry_parts, wait_parts = [], [], [], [], []
    for s in summaries:
        layout = _layout(s.channels) if s.channels else None
        if layout is None:
            continue
        n, k, interval_s, _ = layout
        end = _HEAD.size + n * _ENTRY.size
        reports.append((s.rank, s.time_ns - int(interval_s * 5e8), interval_s))
        counts.append(n)
        nccl_counts.append(k)
        entry_parts.append(s.channels[_HEAD.size:end])
        wait_parts.append(s.channels[end:])
    head = np.array(reports, dtype=_REPORT_DTYPE)
    raw = np.frombuffer(b"".join(entry_parts), ENTRY_DTYPE)
    which = np.repeat(np.arange(len(reports)), counts)
    nccl = raw["source"] == SOURCE_NCCL
    ok = np.bincount(which, weights=nccl, minlength=len(reports)) == nccl_counts
    if not ok.all():  # a value whose head miscounts its NCCL entries is left out
        keep = ok[which]
        raw, which, nccl = raw[keep], which[keep], nccl[keep]
        wait_parts = [w for w, good in zip(wait_parts, ok, strict=True) if good]
        head = head[ok]
        which = np.cumsum(ok)[which] - 1  # renumbered among the reports kept
    rows = np.zeros(len(raw), ROW_DTYPE)
    for name in ENTRY_DTYPE.names:
        rows[name] = raw[name]
    for name in _REPORT_DTYPE.names:
        rows[name] = head[name][which]
    waits = np.frombuffer(b"".join(wait_parts), "<u4").reshape(-1, 3)
    for i, name in enumerate(_WAIT_FIELDS):
        rows[name][nccl] = waits[:, i]
    return ChannelRows(head, rows)


def report_of(view: JobView, rank: int) -> ChannelReport | None:
    """The rank's channel report in this view (decoded once per view)."""
    cache = view.__dict__.setdefault("_channel_reports", {})
    if rank not in cache:
        s = view.summaries.get(rank)
        cache[rank] = decode_channels(rank, s.time_ns, s.channels) \
            if s is not None and s.channels else None
    return cache[rank]


# --- hangs ----------------------------------------------------------------------------------


def _silent_s(view: JobView, rank: int) -> float:
    s = view.summaries.get(rank)
    return (view.now_ns - s.time_ns) / 1e9 if s is not None else float("inf")


def is_silent(view: JobView, rank: int, interval_s: float) -> bool:
    return rank not in view.gone and _silent_s(view, rank) >= SILENT_INTERVALS * interval_s


def _interval_s(view: JobView) -> float:
    for rank in view.summaries:
        r = report_of(view, rank)
        if r is not None and r.interval_s > 0:
            return r.interval_s
    return 1.0


def _stalled(e: PeerChannel) -> str | None:
    """'network' or 'peer' when this entry shows data that has stopped moving."""
    if e.wait == "network" and e.queued > 0 and (e.stalled_s >= STALL_S or e.rtos > 0):
        return "network"
    if e.wait == "peer" and e.queued > 0 and e.stalled_s >= STALL_S:
        return "peer"
    return None


def fmt_bytes(n: float) -> str:
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _fmt_rtt(e: PeerChannel) -> str:
    return f"RTT {e.rtt_us / 1000:.1f} ms (floor {e.min_rtt_us / 1000:.2f} ms)"


def _stall_line(rank: int, e: PeerChannel, why: str) -> str:
    if why == "peer":
        return (f"rank {rank} -> {e.peer}: {fmt_bytes(e.queued)} queued, the receiver's "
                f"window closed {e.rwnd_share:.0%} of the last interval, nothing moved for "
                f"{e.stalled_s:.1f} s: rank {e.peer} does not read")
    rto = f", {e.rtos} retransmission timeouts in a row" if e.rtos else ""
    return (f"rank {rank} -> {e.peer}: {fmt_bytes(e.queued)} queued, unacknowledged for "
            f"{e.stalled_s:.1f} s{rto}, {_fmt_rtt(e)}")


def _stalled_links(view: JobView, members: Iterable[int]
                   ) -> list[tuple[int, PeerChannel, str]]:
    ms = set(members)
    out = []
    for rank in sorted(ms):
        rep = report_of(view, rank)
        if rep is None or is_silent(view, rank, rep.interval_s):
            continue  # a silent rank's last report predates the stall
        for e in rep.entries:
            why = _stalled(e)
            if why is not None and e.peer in ms:
                out.append((rank, e, why))
    return out


def common_culprit(links: list[tuple[int, int]], silent: set[int]
                   ) -> tuple[list[int], list[int] | None]:
    """The rank common to all links (ranks, None), or one link's ends (ranks, link)."""
    pairs = {tuple(sorted(p)) for p in links}
    if len(pairs) == 1:
        a, b = next(iter(pairs))
        lonely = [r for r in (a, b) if r in silent]
        # Of the two ends, the one whose own summaries stopped has lost its connectivity:
        # its whole link, not this one connection of it.
        return (lonely, None) if len(lonely) == 1 else ([a, b], [a, b])
    common = set.intersection(*(set(p) for p in pairs))
    if len(common) == 1:
        return sorted(common), None
    count: dict[int, int] = defaultdict(int)
    for p in pairs:
        for r in p:
            count[r] += 1
    top = max(count.values())
    return sorted(r for r, c in count.items() if c == top), None


def channel_evidence(view: JobView, group: GroupInfo, members: list[int]) -> Located | None:
    """For a hang in ``group`` where nobody is missing: the rank (or link) common to the
    stalled connections among ``members``, and evidence lines; None without stalls."""
    stalls = _stalled_links(view, members)
    if not stalls:
        return None
    interval = _interval_s(view)
    silent = {r for r in members if is_silent(view, r, interval)}
    ranks, link = common_culprit([(r, e.peer) for r, e, _ in stalls], silent)
    lines = [_stall_line(r, e, why) for r, e, why in
             sorted(stalls, key=lambda x: -x[1].stalled_s)[:4]]
    lines += _silent_lines(view, sorted(silent & set(ranks)))
    kinds = {why for _, _, why in stalls}
    if kinds == {"network"}:
        lines.append("the peers' kernels acknowledge nothing: a live kernel acknowledges "
                     "even when its process stalls, so the path itself is down")
    return Located(ranks, link, lines)


def _silent_lines(view: JobView, ranks: list[int]) -> list[str]:
    return [f"rank {r}'s summaries stopped arriving {_silent_s(view, r):.1f} s ago while its "
            f"process runs: its control-plane traffic crosses the same link" for r in ranks]


def cut_off_rank(view: JobView, rank: int, peers: Iterable[int]) -> Located | None:
    """Whether ``rank``, silent and seemingly absent from a stuck op, is cut off: its
    summaries stopped while its peers' connections to it stall unacknowledged. Then its
    stale summary says nothing about what it does, and the hang is on its link."""
    interval = _interval_s(view)
    if not is_silent(view, rank, interval):
        return None
    ps = [p for p in peers if p != rank]
    to_it = [(r, e, why) for r, e, why in _stalled_links(view, [rank, *ps])
             if e.peer == rank and why == "network"]
    if not to_it:
        return None
    lines = [_stall_line(r, e, why) for r, e, why in
             sorted(to_it, key=lambda x: -x[1].stalled_s)[:4]]
    lines += _silent_lines(view, [rank])
    lines.append("the peers' kernels get no acknowledgement from it: a live kernel "
                 "acknowledges even when its process stalls, so its link is down")
    senders = sorted({r for r, _, _ in to_it})
    return Located([rank], [senders[0], rank] if len(senders) == 1 and len(ps) == 1 else None,
                   lines)


def cut_off_ranks(view: JobView) -> list[int]:
    """Every rank of the view that :func:`cut_off_rank` finds cut off."""
    interval = _interval_s(view)
    return [r for r in sorted(view.summaries) if is_silent(view, r, interval)
            and cut_off_rank(view, r, view.summaries) is not None]


def toward_lines(view: JobView, root: int, waiters: Iterable[int]) -> list[str]:
    """What the waiting ranks' connections to a compute-hung ``root`` show: data held by
    a receiver that does not read, or idle and healthy links (the network is not it)."""
    reports = {r: report_of(view, r) for r in waiters}
    reports = {r: rep for r, rep in reports.items() if rep is not None}
    if not reports:
        return []
    blocked = [(r, e) for r, rep in reports.items() for e in rep.entries
               if e.peer == root and e.queued > 0 and e.wait == "peer"]
    if blocked:
        r, e = max(blocked, key=lambda x: x[1].queued)
        return [f"ranks {sorted({r for r, _ in blocked})} have data queued for rank {root} "
                f"that it does not read: e.g. rank {r}: {fmt_bytes(e.queued)} queued, "
                f"receive window closed {e.rwnd_share:.0%} of the interval"]
    net = [(r, e) for r, rep in reports.items() for e in rep.entries
           if e.peer == root and _stalled(e) == "network"]
    if net:
        return [_stall_line(r, e, "network") for r, e in net[:2]]
    entries = [e for rep in reports.values() for e in rep.entries if e.peer == root]
    if entries:
        rtt = max(e.rtt_us for e in entries)
        state = (f"{sum(e.retrans for e in entries)} retransmits, max RTT "
                 f"{rtt / 1000:.2f} ms")
    else:  # idle connections are left out of the summaries
        state = "idle, nothing outstanding either way"
    return [f"connections of ranks {sorted(reports)} to rank {root}: nothing queued toward it "
            f"({state}): the links are healthy; rank {root} has not asked for the data (it "
            f"has not posted its receives)"]
