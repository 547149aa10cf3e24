"""Channel evidence of hangs: what each rank's TCP connections say about where data waits.

Every agent tick a rank sends, inside its summary, one compact entry per peer rank it has
connections to (``wire.peer_channels``, filled by ``agent.tcp_channels``): bytes moved
each way in the interval, bytes queued, RTT and its floor, retransmissions, the
share of the interval the sender was stalled by the peer's receive window or its own send
buffer, the wait class of ``agent.tcp_wait.classify_wait`` and how long queued data has not
moved. Entries of source "nccl" come from the NCCL profiler plugin's channel records
instead (``ccld_plugin.agent.nccl_channels``); their wait states are read by
``diagnose.nccl_waits``.

This module is pure (no torch, no native code). It answers,
for a hang (:func:`channel_evidence`, :func:`cut_off_rank`), which connections are
stalled and which rank (or link) is common to them: a sender whose bytes are not even
acknowledged waits on the network, one whose peer's receive window stays closed waits for
a receiver that does not read. Slow links over a window are ``diagnose.slow_links``'.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from ccld_plugin.diagnose.records import Cause
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.wire.peer_channels import ChannelReport, PeerChannel, decode_channels
from ccld_plugin.wire.topology import GroupInfo

__all__ = [
    "Located",
    "channel_evidence",
    "common_culprit",
    "cut_off_rank",
    "cut_off_ranks",
    "fmt_bytes",
    "is_silent",
    "report_of",
    "toward_lines",
]

# --- thresholds of the diagnoser ----------------------------------------------------------
#
# A hang's stalled connection: bytes queued and not acknowledged (or not let through by
# the receive window) for this long. Healthy connections acknowledge within milliseconds;
# one second of nothing is far outside that and well inside any hang threshold.
STALL_S = 1.0
# A rank whose summaries are this many agent intervals old has gone silent (its control
# plane may cross the same link as its data).
SILENT_INTERVALS = 2.5


@dataclass(frozen=True, slots=True)
class Located:
    """Where channel evidence puts a hang: the ranks (or the link) to name, the lines that
    say why, and whether the culprit is the compute side or communication."""

    ranks: list[int]
    link: list[int] | None
    lines: list[str]
    cause: Cause = Cause.COMMUNICATION


def report_of(view: JobView, rank: int) -> ChannelReport | None:
    """The rank's channel report in this view (decoded once per view)."""
    cache = view.__dict__.setdefault("_channel_reports", {})
    if rank not in cache:
        s = view.summaries.get(rank)
        cache[rank] = (
            decode_channels(rank, s.time_ns, s.channels) if s is not None and s.channels else None
        )
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
        return (
            f"rank {rank} -> {e.peer}: {fmt_bytes(e.queued)} queued, the receiver's "
            f"window closed {e.rwnd_share:.0%} of the last interval, nothing moved for "
            f"{e.stalled_s:.1f} s: rank {e.peer} does not read"
        )
    rto = f", {e.rtos} retransmission timeouts in a row" if e.rtos else ""
    return (
        f"rank {rank} -> {e.peer}: {fmt_bytes(e.queued)} queued, unacknowledged for "
        f"{e.stalled_s:.1f} s{rto}, {_fmt_rtt(e)}"
    )


def _stalled_links(view: JobView, members: Iterable[int]) -> list[tuple[int, PeerChannel, str]]:
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


def common_culprit(
    links: list[tuple[int, int]], silent: set[int]
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
    lines = [
        _stall_line(r, e, why) for r, e, why in sorted(stalls, key=lambda x: -x[1].stalled_s)[:4]
    ]
    lines += _silent_lines(view, sorted(silent & set(ranks)))
    kinds = {why for _, _, why in stalls}
    if kinds == {"network"}:
        lines.append(
            "the peers' kernels acknowledge nothing: a live kernel acknowledges "
            "even when its process stalls, so the path itself is down"
        )
    return Located(ranks, link, lines)


def _silent_lines(view: JobView, ranks: list[int]) -> list[str]:
    return [
        f"rank {r}'s summaries stopped arriving {_silent_s(view, r):.1f} s ago while its "
        f"process runs: its control-plane traffic crosses the same link"
        for r in ranks
    ]


def cut_off_rank(view: JobView, rank: int, peers: Iterable[int]) -> Located | None:
    """Whether ``rank``, silent and seemingly absent from a stuck op, is cut off: its
    summaries stopped while its peers' connections to it stall unacknowledged. Then its
    stale summary says nothing about what it does, and the hang is on its link."""
    interval = _interval_s(view)
    if not is_silent(view, rank, interval):
        return None
    ps = [p for p in peers if p != rank]
    to_it = [
        (r, e, why)
        for r, e, why in _stalled_links(view, [rank, *ps])
        if e.peer == rank and why == "network"
    ]
    if not to_it:
        return None
    lines = [
        _stall_line(r, e, why) for r, e, why in sorted(to_it, key=lambda x: -x[1].stalled_s)[:4]
    ]
    lines += _silent_lines(view, [rank])
    lines.append(
        "the peers' kernels get no acknowledgement from it: a live kernel "
        "acknowledges even when its process stalls, so its link is down"
    )
    senders = sorted({r for r, _, _ in to_it})
    return Located(
        [rank], [senders[0], rank] if len(senders) == 1 and len(ps) == 1 else None, lines
    )


def cut_off_ranks(view: JobView) -> list[int]:
    """Every rank of the view that :func:`cut_off_rank` finds cut off."""
    interval = _interval_s(view)
    return [
        r
        for r in sorted(view.summaries)
        if is_silent(view, r, interval) and cut_off_rank(view, r, view.summaries) is not None
    ]


def toward_lines(view: JobView, root: int, waiters: Iterable[int]) -> list[str]:
    """What the waiting ranks' connections to a compute-hung ``root`` show: data held by
    a receiver that does not read, or idle and healthy links (the network is not it)."""
    reports = {r: report_of(view, r) for r in waiters}
    reports = {r: rep for r, rep in reports.items() if rep is not None}
    if not reports:
        return []
    blocked = [
        (r, e)
        for r, rep in reports.items()
        for e in rep.entries
        if e.peer == root and e.queued > 0 and e.wait == "peer"
    ]
    if blocked:
        r, e = max(blocked, key=lambda x: x[1].queued)
        return [
            f"ranks {sorted({r for r, _ in blocked})} have data queued for rank {root} "
            f"that it does not read: e.g. rank {r}: {fmt_bytes(e.queued)} queued, "
            f"receive window closed {e.rwnd_share:.0%} of the interval"
        ]
    net = [
        (r, e)
        for r, rep in reports.items()
        for e in rep.entries
        if e.peer == root and _stalled(e) == "network"
    ]
    if net:
        return [_stall_line(r, e, "network") for r, e in net[:2]]
    entries = [e for rep in reports.values() for e in rep.entries if e.peer == root]
    if entries:
        rtt = max(e.rtt_us for e in entries)
        state = f"{sum(e.retrans for e in entries)} retransmits, max RTT {rtt / 1000:.2f} ms"
    else:  # idle connections are left out of the summaries
        state = "idle, nothing outstanding either way"
    return [
        f"connections of ranks {sorted(reports)} to rank {root}: nothing queued toward it "
        f"({state}): the links are healthy; rank {root} has not asked for the data (it "
        f"has not posted its receives)"
    ]
