"""Channel evidence: what each rank's TCP connections say about where data waits.

Every agent tick a rank sends, inside its summary, one compact entry per peer rank it has
connections to (``RankSummary.channels``, encoded here and filled by
``ccld_plugin.channels``): bytes moved each way in the interval, bytes queued, RTT and its
floor, retransmissions, the share of the interval the sender was stalled by the peer's
receive window or its own send buffer, the wait class of ``transport.classify_wait`` and
how long queued data has not moved. Entries of source "nccl" come from the NCCL profiler
plugin's channel records instead (``ccld_plugin.nccl_channels``); their wait states are
read by ``diagnose.nccl_waits``.

This module is pure (no torch, no native code). It decodes those entries and answers two
questions for the diagnoser:

- for a hang (:func:`channel_evidence`, :func:`cut_off_rank`): which connections are
  stalled and which rank (or link) is common to them; a sender whose bytes are not even
  acknowledged waits on the network, one whose peer's receive window stays closed waits
  for a receiver that does not read;
- for slowness (:class:`ChannelHistory`): over a window of time, which links are slow
  against their sibling links (RTT and send-queue time per byte) and which rank they
  have in common.
"""

from __future__ import annotations

import statistics
import struct
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from ccld_plugin.diagnose.records import Cause
from ccld_plugin.diagnose.robust import RankedValues
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.topology import GroupInfo

__all__ = [
    "CHANNELS_VERSION",
    "ChannelHistory",
    "ChannelReport",
    "LinkFinding",
    "LinkStats",
    "Located",
    "PeerChannel",
    "WAIT_NAMES",
    "WAIT_ORDER",
    "channel_evidence",
    "cut_off_rank",
    "cut_off_ranks",
    "decode_channels",
    "encode_channels",
    "entry_order",
    "fmt_bytes",
    "is_silent",
    "link_role",
    "report_of",
    "toward_lines",
]

CHANNELS_VERSION = 2
WAIT_NAMES = ("none", "local", "peer", "network")  # enum ccld_wait of board.h
_WAIT_CODE = {name: i for i, name in enumerate(WAIT_NAMES)}
WAIT_ORDER = {"none": 0, "local": 1, "peer": 2, "network": 3}  # which wait an entry shows
DIRECTIONS = ("send", "recv")
SOURCES = ("tcp", "nccl")

_HEAD = struct.Struct("<BBHH")  # version, entries, interval ms, connections mapped to ranks
# peer, wait, direction, conns, rtos, sent, received, queued, rtt, min rtt, retrans,
# rwnd share, sndbuf share, busy share (x/255), stalled (10 ms units), source
_ENTRY = struct.Struct("<iBBBBIIIIIHBBBHB")
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
# Slow links (see ChannelHistory). Only intervals in which a link moved SLOW_MIN_BYTES
# count, at least SLOW_MIN_TICKS of them per window. Absolute RTTs do not separate a slow
# link from a healthy one: on a loaded host a one-way flow's smoothed RTT reaches several
# ms from delayed ACKs alone (measured 3-11 ms on healthy veth links), as much as a link
# shaped to 50 Mbit/s shows. Against its sibling links (same traffic pattern), a shaped
# link's send-queue time per byte was 8-100x higher here (50 Mbit/s on a TP link: 8-27x;
# on a DP ring: ~100x), a healthy link's at most 5.2x (median 1.0x) over ~120 windows of
# six healthy runs: SLOW_RATIO. The RTT must agree (RTT_RATIO; healthy siblings differ
# up to 8x in RTT alone, a shaped link's RTT was 3-250x its siblings'), and the link must
# be busy SLOW_BUSY_SHARE of the time (it costs the job; the 5.2x healthy case was 11%).
SLOW_MIN_BYTES = 32 * 1024
SLOW_MIN_TICKS = 3
SLOW_RATIO = 6.0
RTT_RATIO = 3.0
SLOW_RTT_EXCESS_US = 1_000
SLOW_BUSY_SHARE = 0.2
# Once one link is slow, its two ends are told apart with softer evidence: the end whose
# other links are slow by LOCATE_RATIO in time per byte (and RTT_RATIO in RTT) while the
# other end's are not is named, however little those links are used (a PP link of a
# TP-heavy job is busy ~10%).
LOCATE_RATIO = 3.0
JIFFY_S = 0.004  # the coarsest kernel timer resolution in use (HZ=250)
HISTORY_TICKS = 600  # per rank; ~10 minutes at the default interval
FORGET_S = 60.0  # reports this much older than the window being evaluated are dropped


@dataclass(frozen=True, slots=True)
class PeerChannel:
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
    parts = [_HEAD.pack(CHANNELS_VERSION, len(rows), min(int(interval_s * 1000), 0xFFFF),
                        min(conns, 0xFFFF))]
    for e in rows:
        parts.append(_ENTRY.pack(
            e.peer, _WAIT_CODE[e.wait], DIRECTIONS.index(e.direction), min(e.conns, 255),
            min(e.rtos, 255), _u32(e.sent), _u32(e.received), _u32(e.queued), _u32(e.rtt_us),
            _u32(e.min_rtt_us), min(e.retrans, 0xFFFF), _share(e.rwnd_share),
            _share(e.sndbuf_share), _share(e.busy_share),
            min(round(e.stalled_s * 100), 0xFFFF), SOURCES.index(e.source)))
    return b"".join(parts)


def decode_channels(rank: int, time_ns: int, data: bytes) -> ChannelReport | None:
    """Inverse of :func:`encode_channels`; None for an empty or foreign value."""
    if len(data) < _HEAD.size or data[0] != CHANNELS_VERSION:
        return None
    _, n, interval_ms, conns = _HEAD.unpack_from(data)
    if len(data) != _HEAD.size + n * _ENTRY.size:
        return None
    entries = []
    for (peer, wait, direction, nconn, rtos, sent, received, queued, rtt, min_rtt, retrans,
         rwnd, sndbuf, busy, stalled, source) in _ENTRY.iter_unpack(data[_HEAD.size:]):
        entries.append(PeerChannel(
            peer=peer, wait=WAIT_NAMES[wait] if wait < len(WAIT_NAMES) else "none",
            direction=DIRECTIONS[direction & 1], conns=nconn, rtos=rtos, sent=sent,
            received=received, queued=queued, rtt_us=rtt, min_rtt_us=min_rtt, retrans=retrans,
            rwnd_share=rwnd / 255, sndbuf_share=sndbuf / 255, busy_share=busy / 255,
            stalled_s=stalled / 100, source=SOURCES[source] if source < len(SOURCES) else "tcp"))
    return ChannelReport(rank, time_ns, interval_ms / 1000, conns, tuple(entries))


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


def _common(links: list[tuple[int, int]], silent: set[int]) -> tuple[list[int], list[int] | None]:
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
    ranks, link = _common([(r, e.peer) for r, e, _ in stalls], silent)
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


# --- slowness -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkFinding:
    """Communication-bound slowness located by channel evidence over a window."""

    ranks: list[int]
    link: list[int] | None
    group: GroupInfo | None  # the group the slowest link belongs to
    severity: float  # the slow links' time per byte over their references'
    lines: list[str]


@dataclass(frozen=True)
class LinkStats:
    """One directed link (a sends to b) over a window: what a reported about it."""

    src: int
    dst: int
    ticks: int  # intervals in which it moved at least SLOW_MIN_BYTES
    rtt_us: float  # median smoothed RTT over those intervals
    floor_us: int
    s_per_mb: float  # seconds of non-empty send queue per MB acknowledged
    busy: float  # mean share of the intervals with a non-empty send queue
    queued: int  # most bytes queued at a sample
    retrans: int
    sent: int

    @property
    def pair(self) -> tuple[int, int]:
        return (min(self.src, self.dst), max(self.src, self.dst))


def _link_stats(src: int, dst: int, got: list[tuple[float, PeerChannel]]) -> LinkStats:
    # The kernel counts busy time in jiffies: an interval that moved data was busy for at
    # least about one, however little it shows.
    busy_s = sum(max(dt * e.busy_share, JIFFY_S) for dt, e in got)
    sent = sum(e.sent for _, e in got)
    return LinkStats(src, dst, len(got), statistics.median(e.rtt_us for _, e in got),
                     min(e.min_rtt_us for _, e in got), busy_s / (sent / 1e6),
                     statistics.fmean(e.busy_share for _, e in got),
                     max(e.queued for _, e in got), sum(e.retrans for _, e in got), sent)


def link_role(view: JobView, a: int, b: int) -> GroupInfo | None:
    """The smallest group holding both ranks (world only when no other does)."""
    of_b = {g.group_id for g in view.topology.groups_of(b)}  # not `b in g.ranks`: O(world)
    groups = [g for g in view.topology.groups_of(a) if g.group_id in of_b]
    if not groups:
        return None
    return min(groups, key=lambda g: (g.role == "world", g.size))


def _fmt_link(st: LinkStats) -> str:
    return (f"rank {st.src} -> {st.dst}: RTT {st.rtt_us / 1000:.1f} ms (floor "
            f"{st.floor_us / 1000:.2f} ms), send queue busy {st.busy:.0%}, "
            f"{st.s_per_mb * 1000:.0f} ms per MB ({1 / st.s_per_mb:.1f} MB/s while busy), "
            f"up to {fmt_bytes(st.queued)} queued, {st.retrans} retransmits")


class _SiblingMedians:
    """Median RTT and time per byte of a role's links, leaving out the links that share a
    rank with the one being judged: a few lookups per link instead of a pass over all of
    them (a pass per link made a window quadratic in the links: ~50 s at 2,048 ranks)."""

    def __init__(self, links: dict[tuple[int, int], LinkStats]) -> None:
        self.touching: dict[int, set[tuple[int, int]]] = defaultdict(set)
        for k in links:
            self.touching[k[0]].add(k)
            self.touching[k[1]].add(k)
        self.count = len(links)
        self.rtt = RankedValues({k: st.rtt_us for k, st in links.items()})
        self.spm = RankedValues({k: st.s_per_mb for k, st in links.items()})

    def without(self, k: tuple[int, int]) -> tuple[float, float] | None:
        """(median RTT, median s per MB) of the links sharing no rank with ``k``; None
        when every link does."""
        left_out = self.touching[k[0]] | self.touching[k[1]]
        if len(left_out) >= self.count:
            return None
        return self.rtt.median_without(left_out), self.spm.median_without(left_out)


class ChannelHistory:
    """Every rank's channel reports over time, for the slow detector's windows.

    A directed link is slow in a window when, against the links of the same role that
    share no rank with it (they carry the same traffic pattern, so protocol effects such
    as delayed ACKs on one-way flows are in the reference too) or, without such siblings,
    against its own history, its send-queue time per byte is SLOW_RATIO times higher and
    its RTT RTT_RATIO times (by at least SLOW_RTT_EXCESS_US), and its send queue is busy
    SLOW_BUSY_SHARE of the time. The rank common to the slow links is named; a single
    slow link is named as a link unless one end's other links are slow too.
    """

    def __init__(self) -> None:
        self.reports: dict[int, deque[ChannelReport]] = defaultdict(
            lambda: deque(maxlen=HISTORY_TICKS))
        self.history: dict[tuple[int, int], deque[LinkStats]] = defaultdict(
            lambda: deque(maxlen=8))

    def ingest(self, view: JobView) -> None:
        for rank in view.summaries:
            rep = report_of(view, rank)
            mine = self.reports[rank]
            if rep is not None and (not mine or rep.time_ns > mine[-1].time_ns):
                mine.append(rep)

    def between(self, t0: int, t1: int) -> list[ChannelReport]:
        # A report covers the interval that ends at its time: keep those mostly in [t0, t1].
        return [rep for reps in self.reports.values() for rep in reps
                if t0 < rep.time_ns - rep.interval_s * 5e8 <= t1]

    def forget_before(self, t_ns: int) -> None:
        """Drop reports older than ``t_ns`` (windows only go forward)."""
        for reps in self.reports.values():
            while reps and reps[0].time_ns < t_ns:
                reps.popleft()

    def window_links(self, t0: int, t1: int) -> dict[tuple[int, int], LinkStats]:
        got: dict[tuple[int, int], list[tuple[float, PeerChannel]]] = defaultdict(list)
        for rep in self.between(t0, t1):
            for e in rep.entries:
                if e.sent >= SLOW_MIN_BYTES and e.rtt_us > 0:
                    got[(rep.rank, e.peer)].append((rep.interval_s, e))
        return {k: _link_stats(*k, v) for k, v in got.items() if len(v) >= SLOW_MIN_TICKS}

    def slow_links(self, view: JobView, t0: int, t1: int) -> LinkFinding | None:
        """Links that were slow on the network during [t0, t1] (diagnoser clock) and the
        rank or link they have in common; None when every link is healthy."""
        links = self.window_links(t0, t1)
        self.forget_before(t0 - int(FORGET_S * 1e9))
        roles = {k: link_role(view, *k) for k in links}
        by_role: dict[str | None, dict[tuple[int, int], LinkStats]] = defaultdict(dict)
        for k, st in links.items():
            by_role[roles[k].role if roles[k] is not None else None][k] = st
        siblings = {role: _SiblingMedians(ls) for role, ls in by_role.items()}
        slow: list[tuple[LinkStats, float, float, str]] = []
        softer: list[tuple[LinkStats, float, float, str]] = []
        for k, st in links.items():
            role = roles[k].role if roles[k] is not None else None
            ref = siblings[role].without(k)
            source = "links of the same role that share no rank with it"
            if ref is None and self.history[k]:
                hist = self.history[k]
                ref = (statistics.median(o.rtt_us for o in hist),
                       statistics.median(o.s_per_mb for o in hist))
                source = "its own history"
            if ref is None:
                continue
            ref_rtt, ref_spm = ref
            if (st.rtt_us < RTT_RATIO * ref_rtt
                    or st.rtt_us - ref_rtt < SLOW_RTT_EXCESS_US):
                continue
            if st.s_per_mb >= SLOW_RATIO * ref_spm and st.busy >= SLOW_BUSY_SHARE:
                slow.append((st, ref_rtt, ref_spm, source))
            if st.s_per_mb >= LOCATE_RATIO * ref_spm:
                softer.append((st, ref_rtt, ref_spm, source))
        slow_keys = {(st.src, st.dst) for st, *_ in softer}
        for k, st in links.items():
            if k not in slow_keys:
                self.history[k].append(st)
        if not slow:
            return None
        ranks, link = _common([(st.src, st.dst) for st, *_ in slow], set())
        shown = list(slow)
        if link is not None:
            # One slow link: is one end slow on its other links too (its NIC)?
            other = {r: [x for x in softer if r in x[0].pair and x[0].pair != tuple(link)]
                     for r in link}
            ends = [r for r in link if other[r]]
            if len(ends) == 1:
                ranks, link = ends, None
                shown += other[ends[0]]
        worst, ref_rtt, ref_spm, source = max(slow, key=lambda x: x[0].s_per_mb / x[2])
        lines = [_fmt_link(st) + f"; {st.rtt_us / r_rtt:.0f}x the RTT and "
                 f"{st.s_per_mb / r_spm:.0f}x the time per byte of {src}"
                 for st, r_rtt, r_spm, src in sorted(shown, key=lambda x: (x[0].src,
                                                                           x[0].dst))[:4]]
        if link is None and len(ranks) == 1:
            lines.append(f"every slow link has rank {ranks[0]} at one end: its NIC or link")
        elif link is not None:
            lines.append(f"one link is slow ({link[0]}<->{link[1]}); the other links of "
                         f"both ranks are not")
        severity = round(worst.s_per_mb / ref_spm, 2) if ref_spm > 0 else 0.0
        return LinkFinding(ranks, link, roles.get((worst.src, worst.dst)), severity, lines)
