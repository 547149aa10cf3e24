"""Channel evidence of hangs: what each rank's TCP connections say about where data waits.

Every agent tick a rank sends, inside its summary, one compact entry per peer rank it has
connections to (``wire.peer_channels``, filled by ``probes.tcp_channels``): bytes moved
each way in the interval, bytes queued, RTT and its floor, retransmissions, the
share of the interval the sender was stalled by the peer's receive window or its own send
buffer, the wait class of ``probes.tcp_wait.classify_wait`` and how long queued data has not
moved. Entries of source "nccl" come from the NCCL profiler plugin's channel records
instead (``ccld_plugin.probes.nccl_channels``); their wait states are read by
``diagnose.links.nccl_evidence``.

This module is pure (no torch, no native code). It answers,
for a hang (:func:`channel_evidence`, :func:`cut_off_rank`), which connections are
stalled and which rank (or link) is common to them: a sender whose bytes are not even
acknowledged waits on the network, one whose peer's receive window stays closed waits for
a receiver that does not read. Slow links over a window are ``diagnose.links.slow_links``'.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ccld_plugin.diagnose.records import Cause, Evidence
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.topology import GroupInfo
from ccld_plugin.wire.peer_channels import ChannelReport, PeerChannel, decode_channels

__all__ = [
    "Located",
    "channel_evidence",
    "common_culprit",
    "cut_off_rank",
    "cut_off_ranks",
    "interval_s",
    "is_silent",
    "peers_reported_since",
    "report_of",
    "speaking",
    "stall_evidence",
    "stalled_links",
    "toward_evidence",
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
    """Where channel evidence puts a hang: the ranks (or the link) to name, the evidence
    that says why, and whether the culprit is the compute side or communication."""

    ranks: list[int]
    link: list[int] | None
    evidence: list[Evidence]
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


def interval_s(view: JobView) -> float:
    """The agent interval of the lowest rank whose channel report gives one (1 s without)."""
    given = view.columns.channel_rows().reports["interval_s"]
    given = given[given > 0]  # the reports are in rank order
    return float(given[0]) if len(given) else 1.0


def _stalled(e: PeerChannel) -> str | None:
    """'network' or 'peer' when this entry shows data that has stopped moving."""
    if e.wait == "network" and e.queued > 0 and (e.stalled_s >= STALL_S or e.rtos > 0):
        return "network"
    if e.wait == "peer" and e.queued > 0 and e.stalled_s >= STALL_S:
        return "peer"
    return None


def stall_evidence(rank: int, e: PeerChannel, why: str) -> Evidence:
    if why == "peer":
        return Evidence.of(
            "peer_not_reading",
            "rank {rank} -> {peer}: {queued:bytes} queued, the receiver's window closed "
            "{window_closed_share:.0%} of the last interval, nothing moved for "
            "{stalled_s:.1f} s: rank {peer} does not read",
            rank=rank,
            peer=e.peer,
            queued=e.queued,
            window_closed_share=e.rwnd_share,
            stalled_s=e.stalled_s,
        )
    rto = ", {rtos} retransmission timeouts in a row" if e.rtos else ""
    return Evidence.of(
        "link_stalled",
        "rank {rank} -> {peer}: {queued:bytes} queued, unacknowledged for {stalled_s:.1f} s"
        + rto
        + ", RTT {rtt_ms:.1f} ms (floor {floor_ms:.2f} ms)",
        rank=rank,
        peer=e.peer,
        queued=e.queued,
        stalled_s=e.stalled_s,
        rtos=e.rtos,
        rtt_ms=e.rtt_us / 1000,
        floor_ms=e.min_rtt_us / 1000,
    )


def stalled_links(
    view: JobView, members: Iterable[int], to_anyone: bool = False
) -> list[tuple[int, PeerChannel, str]]:
    """The stalled connections of ``members`` (as (rank, entry, why)): those toward other
    members, or toward any peer with ``to_anyone``."""
    ms = set(members)
    out = []
    for rank in sorted(ms):
        rep = report_of(view, rank)
        if rep is None or is_silent(view, rank, rep.interval_s):
            continue  # a silent rank's last report predates the stall
        for e in rep.entries:
            why = _stalled(e)
            if why is not None and (to_anyone or e.peer in ms):
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
    stalled connections among ``members``, and the evidence; None without stalls."""
    stalls = stalled_links(view, members)
    if not stalls:
        return None
    interval = interval_s(view)
    silent = {r for r in members if is_silent(view, r, interval)}
    ranks, link = common_culprit([(r, e.peer) for r, e, _ in stalls], silent)
    evidence = [
        stall_evidence(r, e, why) for r, e, why in sorted(stalls, key=lambda x: -x[1].stalled_s)[:4]
    ]
    evidence += _silent(view, sorted(silent & set(ranks)))
    kinds = {why for _, _, why in stalls}
    if kinds == {"network"}:
        evidence.append(
            Evidence.of(
                "path_down",
                "the peers' kernels acknowledge nothing: a live kernel acknowledges "
                "even when its process stalls, so the path itself is down",
            )
        )
    return Located(ranks, link, evidence)


def _silent(view: JobView, ranks: list[int]) -> list[Evidence]:
    return [
        Evidence.of(
            "summaries_stopped",
            "rank {rank}'s summaries stopped arriving {silent_s:.1f} s ago while its "
            "process runs: its control-plane traffic crosses the same link",
            rank=r,
            silent_s=_silent_s(view, r),
        )
        for r in ranks
    ]


def cut_off_rank(view: JobView, rank: int, peers: Iterable[int]) -> Located | None:
    """Whether ``rank``, silent and seemingly absent from a stuck op, is cut off: its
    summaries stopped while its peers' connections to it stall unacknowledged, or, where
    the peers have nothing outstanding toward it, while its host does not answer the
    observer's handshake. Then its stale summary says nothing about what it does, and the
    hang is on its link."""
    interval = interval_s(view)
    if not is_silent(view, rank, interval):
        return None
    ps = [p for p in peers if p != rank]
    to_it = [
        (r, e, why)
        for r, e, why in stalled_links(view, [rank, *ps])
        if e.peer == rank and why == "network"
    ]
    if not to_it:
        return _unreachable(view, rank, interval)
    evidence = [
        stall_evidence(r, e, why) for r, e, why in sorted(to_it, key=lambda x: -x[1].stalled_s)[:4]
    ]
    evidence += _silent(view, [rank])
    evidence.append(
        Evidence.of(
            "link_down",
            "the peers' kernels get no acknowledgement from it: a live kernel "
            "acknowledges even when its process stalls, so its link is down",
            rank=rank,
        )
    )
    senders = sorted({r for r, _, _ in to_it})
    obs = view.observer
    if obs is not None and senders == [obs] and not speaking(view, {obs, rank}, interval):
        # Only the diagnoser's rank lost it, and no third rank speaks to show that the
        # diagnoser's own link works: either end's port may be the one down.
        return _either_end(rank, obs, evidence)
    return Located(
        [rank], [senders[0], rank] if len(senders) == 1 and len(ps) == 1 else None, evidence
    )


def _either_end(rank: int, observer: int, evidence: list[Evidence]) -> Located:
    """The link between ``rank`` and the diagnoser's ``observer``, both ends named."""
    pair = sorted([observer, rank])
    either = Evidence.of(
        "either_end",
        "no rank but {rank} and {observer} (the diagnoser's) is there to tell which end of "
        "link {a}<->{b} is cut off",
        rank=rank,
        observer=observer,
        a=pair[0],
        b=pair[1],
    )
    return Located(pair, pair, [*evidence, either])


def speaking(view: JobView, besides: set[int], interval_s: float) -> bool:
    """Whether a rank not in ``besides`` still reports: one that has not left, whose last
    summary is under SILENT_INTERVALS agent intervals old (checked on the columns: every
    summary is read)."""
    t = view.columns
    fresh = (view.now_ns - t.heads["time_ns"]) / 1e9 < SILENT_INTERVALS * interval_s
    return bool((fresh & ~t.exited & ~np.isin(t.ranks, list(besides))).any())


def _unreachable(view: JobView, rank: int, interval: float) -> Located | None:
    """``rank`` cut off, by the observer's handshake to its host (``control.reach``): no
    answer, while the store answers the observer and other ranks report (else the
    observer's own link is as likely down: ``diagnose.stalls.isolation``); in a job of two, the
    link between them."""
    if view.reach.get(rank) is not False or view.store_failed is not None:
        return None
    silent = view.silent(SILENT_INTERVALS * interval)
    heard = len(view.summaries) - len(silent | view.gone) - (view.observer in view.summaries)
    s = view.summaries[rank]
    obs = view.observer
    # No rank but the diagnoser's heard from: where others are silent too, its own
    # isolation (diagnose.stalls.isolation); where the job is two ranks (the others left), nobody
    # is there to tell whose link it is, and both ends are named.
    alone = heard < 1
    if alone and (
        obs is None
        or obs not in view.summaries
        or any(not o.exited for r, o in view.summaries.items() if r not in (obs, rank))
    ):
        return None
    evidence = [
        Evidence.of(
            "host_unreachable",
            "rank {rank}'s host {host} does not answer a TCP handshake from the diagnoser "
            "(rank {observer})"
            + ("" if alone else " while the other ranks report")
            + ": a live kernel answers even when its process is stuck, so "
            + ("a link between them" if alone else "its link")
            + " (or the host) is down",
            rank=rank,
            host=s.host,
            observer=obs,
        ),
        *_silent(view, [rank]),
    ]
    if alone and obs is not None:
        return _either_end(rank, obs, evidence)
    return Located([rank], None, evidence)


def peers_reported_since(view: JobView, rank: int, since_ns: int) -> bool:
    """Whether ``rank``'s group peers have reported late enough after ``since_ns`` (when
    it fell silent) for a link cut then to show in their channel evidence. A connection
    shows a cut once data sent on it has waited STALL_S unacknowledged, and a peer sends
    to the rank only in an op with it: so every peer must have reported STALL_S and one
    agent interval past the later of the silence and its entering its first op with the
    rank. Until then the absence of stalled links says nothing (under load the peers'
    reports lag too, and the one peer that sends to the rank may be the last to enter).
    Peers that trace no channels, or are silent or gone themselves, are not waited for."""
    interval = interval_s(view)
    margin = int((STALL_S + interval) * 1e9)
    for peer in {p for g in view.groups_at(rank) for p in g.ranks} - {rank}:
        s = view.summaries.get(peer)
        if s is None or s.exited or report_of(view, peer) is None:
            continue
        if peer in view.gone or is_silent(view, peer, interval):
            continue
        entered = [op.enter_ns for op, g in view.ops_of(peer) if rank in g.ranks]
        if s.time_ns < max(since_ns, min(entered, default=since_ns)) + margin:
            return False
    return True


def cut_off_ranks(view: JobView) -> list[int]:
    """Every rank of the view that :func:`cut_off_rank` finds cut off."""
    interval = interval_s(view)
    return [
        r
        for r in sorted(view.summaries)
        if is_silent(view, r, interval) and cut_off_rank(view, r, view.summaries) is not None
    ]


def toward_evidence(view: JobView, root: int, waiters: Iterable[int]) -> list[Evidence]:
    """What the waiting ranks' connections to a compute-hung ``root`` show: data held by
    a receiver that does not read, or idle and healthy links (the network is not it)."""
    reports = {r: rep for r in waiters if (rep := report_of(view, r)) is not None}
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
            Evidence.of(
                "data_not_read",
                "ranks {ranks} have data queued for rank {rank} that it does not read: "
                "e.g. rank {example}: {queued:bytes} queued, receive window closed "
                "{window_closed_share:.0%} of the interval",
                ranks=sorted({r for r, _ in blocked}),
                rank=root,
                example=r,
                queued=e.queued,
                window_closed_share=e.rwnd_share,
            )
        ]
    net = [
        (r, e)
        for r, rep in reports.items()
        for e in rep.entries
        if e.peer == root and _stalled(e) == "network"
    ]
    if net:
        return [stall_evidence(r, e, "network") for r, e in net[:2]]
    entries = [e for rep in reports.values() for e in rep.entries if e.peer == root]
    # One fact either way; retransmits and max_rtt_ms are None when the connections are
    # idle (idle connections are left out of the summaries).
    state = (
        "{retransmits} retransmits, max RTT {max_rtt_ms:.2f} ms"
        if entries
        else "idle, nothing outstanding either way"
    )
    return [
        Evidence.of(
            "links_healthy",
            "connections of ranks {ranks} to rank {rank}: nothing queued toward it ("
            + state
            + "): the links are healthy; rank {rank} has not asked for the data (it has not "
            "posted its receives)",
            ranks=sorted(reports),
            rank=root,
            retransmits=sum(e.retrans for e in entries) if entries else None,
            max_rtt_ms=max(e.rtt_us for e in entries) / 1000 if entries else None,
        )
    ]
