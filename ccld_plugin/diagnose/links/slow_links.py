"""Slow links: which links were slow over a window of time, and the rank they share.

Every rank's channel reports (``peer_channels``, as numpy rows) are kept until the slow
detector's windows have passed them; per window each directed link's intervals that moved
data are summarized and compared with its sibling links of the same role that share no
rank with it, or, without siblings, with its own history. TCP links by their RTT and time
of non-empty send queue per byte; NCCL links by the time their send steps spent handed to
the network per byte (the plugin's per-link totals).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ccld_plugin.diagnose.links.link_stats import (
    SLOW_MIN_TICKS,
    LinkHistory,
    LinkStats,
    LinkTable,
    nccl_links,
    sibling_medians,
    spm_floors,
    tcp_links,
)
from ccld_plugin.diagnose.links.tcp_evidence import common_culprit
from ccld_plugin.diagnose.records import Evidence
from ccld_plugin.diagnose.robust import RankedValues
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.topology import GroupInfo, Topology
from ccld_plugin.wire.peer_channels import ChannelRows
from ccld_plugin.wire.summary import RankSummary
from ccld_plugin.wire.summary_batch import table_of

__all__ = [
    "ChannelHistory",
    "LinkFinding",
    "LinkJudgement",
    "MeasuredLinks",
    "common_rank",
    "link_role",
]

# Slow links (see ChannelHistory). Only intervals in which a link moved SLOW_MIN_BYTES
# count, at least SLOW_MIN_TICKS of them per judgement (link_stats): a window of steps shorter than
# that many agent intervals is judged together with the next (0.26 s steps and 0.5 s ticks
# gave windows of two and three reports in turn; each short one broke the streak).
# Absolute RTTs do not separate a slow link from a healthy one: on a loaded host a one-way
# flow's smoothed RTT reaches several ms from delayed ACKs alone (measured 3-11 ms on
# healthy veth links), as much as a link shaped to 50 Mbit/s shows. Against its sibling
# links (same traffic pattern), a shaped link's send-queue time per byte was 8-100x higher
# here (50 Mbit/s on a TP link: 8-27x; on a DP ring: ~100x), a healthy link's at most 5.2x
# (median 1.0x) over ~120 windows of six healthy runs: SLOW_RATIO. The RTT must agree
# (RTT_RATIO; healthy siblings differ up to 8x in RTT alone, a shaped link's RTT was
# 3-250x its siblings'), and the link must be busy SLOW_BUSY_SHARE of the time (it costs
# the job; the 5.2x healthy case was 11%).
SLOW_RATIO = 6.0
RTT_RATIO = 3.0
SLOW_RTT_EXCESS_US = 1_000
SLOW_BUSY_SHARE = 0.2
# A slow port (NIC, cable, switch port) slows every connection of its rank; a slow
# connection slows that one alone. Once the slow links are one connection, its two ends
# are told apart by their other connections: an end is named when more than half of them
# are slower than the same direction of their siblings (the links at the same positions
# in the other groups of the role: stage s to s+1 with stage s to s+1, not with s+1 to s)
# by PORT_RATIO, the geometric mean of the time per byte and RTT ratios of both
# directions, and one direction is busy PORT_MIN_EXCESS of the time more than that
# reference would be for its bytes; and the other end's are not. They are judged on all
# the windows since the slow links appeared (ChannelHistory.episode_start), as the port's
# slowness lasts and noise averages out. A port slows both directions and both measures,
# host noise mostly one: these are often one-way flows (pipeline sends), whose sender
# waits for the receiver's delayed ACK or late read on a healthy link too. RTTs count from
# 1 ms up (PORT_RTT_FLOOR_US: below, host noise).
# Measured on TP2xPP2 (4 ranks, 2-core host, 0.5 s and 1 s intervals): a healthy pipeline
# link's time per byte was 85-650 ms/MB (the TP links' 5-10), so with rank 3's port shaped
# to 30 Mbit/s its PP link 1->3 was only 1.5-2.1x its sibling 0->2 (whose receiver reads
# late too) and 3->1 1.6-8x 2->0; with the two directions in one reference, 1.1-2.5x,
# below a slow link's ratios. The mean of the four ratios, over the windows so far, of the
# other connection of the shaped port's rank (ranks 0, 1 and 3, 30 Mbit/s, 9 runs, 60
# windows): 1.44-2.6, 1.30-1.33 in 2 (the window before had named the rank), 10-29%
# busier; at 60 Mbit/s 1.13-1.29 (the link is named). Of the other ends 0.4-0.8, of both
# ends with only the TP connection shaped or nothing (11 runs, 116 windows) up to 1.26;
# one window alone up to 1.47. Time per byte alone overlapped (port 1.24-8.3x, healthy up
# to 1.46x; a link busy ~1% of the time is at the kernel's jiffy resolution, where
# healthy TP siblings differed up to 2.3x).
PORT_RATIO = 1.4
PORT_MIN_EXCESS = 0.05
PORT_RTT_FLOOR_US = 1_000
# A pipeline's connection (both directions of a point-to-point link) among sibling
# pipelines: its one-way flows wait on delayed ACKs and late reads on healthy links too,
# so one direction's time per byte rarely reaches SLOW_RATIO over links that mix both
# directions (a TP1xPP2xDP2 link shaped to 30 Mbit/s, doubling the step: 2.8x and 2.2x).
# Against the same direction of the sibling pipelines' link at its place, the geometric
# mean of both directions' time per byte and RTT ratios (as PORT_RATIO) read 3.7-3.9
# there; healthy pipeline connections of 166 kept runs (TP2xPP2, TP1xPP2xDP4,
# TP1xPP4xDP2, TP2xPP2xDP2, torch and Megatron, some beside busy processes) at most
# 1.57. Judged where no link is slow by the rule above, on jobs of at most
# PIPE_MAX_LINKS such links (a larger job's are many siblings' worth per place).
PIPE_RATIO = 3.0
PIPE_MAX_LINKS = 8192
# Evidence lines of the links named (one per connection first, its slower direction).
MAX_LINK_LINES = 8
# Reports this much older than the window being evaluated are dropped (windows only go
# forward), and any more than KEEP_S behind the newest: a longer window is judged on its
# last KEEP_S. Each round's reports of 16 k ranks are ~3 MB of rows (rounds come every
# few seconds at that size).
FORGET_S = 10.0
KEEP_S = 30.0
# NCCL links: a link whose send steps spend NCCL_SLOW_RATIO times longer per byte handed to
# the network than its siblings' (or its own history's), adding up to NCCL_MIN_WAIT_SHARE
# of the window, is slow. Not calibrated on real NCCL yet (no GPU machine): the ratio is
# below TCP's because step times carry no delayed-ACK noise.
NCCL_SLOW_RATIO = 4.0
NCCL_MIN_WAIT_SHARE = 0.02


@dataclass(frozen=True)
class LinkFinding:
    """Communication-bound slowness located by channel evidence over a window."""

    ranks: list[int]
    link: list[int] | None
    group: GroupInfo | None  # the group the slowest link belongs to
    severity: float  # the slow links' time per byte over their references'
    evidence: list[Evidence]
    # False: a connection whose ends are not told apart yet (a pipeline connection found
    # by its messages before the channels have enough reports to judge its ends' other
    # links): it counts towards its streak, and is not told.
    settled: bool = True


class MeasuredLinks:
    """Directed links (rank, peer) as two columns: the links a window judged."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, src: Iterable[int] = (), dst: Iterable[int] = ()) -> None:
        self.src = np.fromiter(src, np.int64) if not isinstance(src, np.ndarray) else src
        self.dst = np.fromiter(dst, np.int64) if not isinstance(dst, np.ndarray) else dst

    def within(self, ranks: Iterable[int]) -> bool:
        """Whether a link between two of ``ranks`` was measured."""
        members = np.fromiter(ranks, np.int64)
        return bool((np.isin(self.src, members) & np.isin(self.dst, members)).any())

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self.src.tolist(), self.dst.tolist(), strict=True)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeasuredLinks) and set(self) == set(other)


@dataclass(frozen=True)
class LinkJudgement:
    """What the channel evidence says about one slow-detector window."""

    found: LinkFinding | None
    # False: the reports since the last judgement are too few to judge on; ``found`` is the
    # last judgement's, and the window neither confirms nor clears it.
    fresh: bool
    # The directed links (rank, peer) that moved enough data to be judged (not fresh: the
    # last judgement's): where ``found`` is None they were judged healthy.
    measured: MeasuredLinks = field(default_factory=MeasuredLinks)
    # Not fresh, but this job reports channels: a judgement is on its way.
    pending: bool = False


def link_role(view: JobView, a: int, b: int) -> GroupInfo | None:
    """The smallest group holding both ranks (world only when no other does)."""
    of_b = {g.group_id for g in view.topology.groups_of(b)}  # not `b in g.ranks`: O(world)
    groups = [g for g in view.topology.groups_of(a) if g.group_id in of_b]
    if not groups:
        return None
    return min(groups, key=lambda g: (g.role == "world", g.size))


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


class _LinkRoles:
    """``link_role`` of many links at once: every rank's groups (in the topology's order)
    as one array, kept while the view's topology stays the same object (the diagnoser
    service builds a new one when a group table changes)."""

    def __init__(self) -> None:
        self.topology: object = None
        self.groups: list[GroupInfo] = []
        self.member = np.full((0, 0), -1, np.int64)  # rank x its groups: index into groups
        self.rank_of_group = np.zeros(0, np.int64)  # the order link_role picks by
        self.role_id = np.zeros(0, np.int64)  # per group: its role's number

    def of(self, view: JobView, links: LinkTable) -> np.ndarray:
        """Per link: its group (an index into ``groups``), or -1 for none."""
        if view.topology is not self.topology:
            self._index(view.topology)
        n = len(self.member)
        src, dst = links.src, links.dst
        inside = (src < n) & (dst < n)
        out = np.full(len(links), -1, np.int64)
        if not inside.any() or not self.member.shape[1]:
            return out
        a, b = self.member[src[inside]], self.member[dst[inside]]
        common = (a >= 0) & (a[:, :, None] == b[:, None, :]).any(axis=2)
        rank = np.where(common, self.rank_of_group[np.maximum(a, 0)], np.iinfo(np.int64).max)
        best = np.argmin(rank, axis=1)  # the first of the smallest, as min() picks
        rows = np.arange(len(a))
        out[inside] = np.where(common[rows, best], a[rows, best], -1)
        return out

    def _index(self, topo: Topology) -> None:
        self.topology = topo
        self.groups = list(topo.groups.values())
        # Every (rank, group) membership at once, groups in the topology's order: a rank's
        # row lists its groups as Topology.groups_of does (a pass per rank cost ~150 ms at
        # 16,384 ranks).
        sizes = np.fromiter((len(g.ranks) for g in self.groups), np.int64, len(self.groups))
        ranks = np.fromiter(
            itertools.chain.from_iterable(g.ranks for g in self.groups), np.int64, sizes.sum()
        )
        group = np.repeat(np.arange(len(self.groups)), sizes)
        order = np.argsort(ranks, kind="stable")  # by rank, each rank's groups in order
        by_rank = ranks[order]
        first = np.searchsorted(by_rank, by_rank)  # where each rank's run begins
        column = np.arange(len(by_rank)) - first
        width = int(column.max()) + 1 if len(column) else 0
        self.member = np.full((int(by_rank[-1]) + 1 if len(by_rank) else 0, width), -1, np.int64)
        self.member[by_rank, column] = group[order]
        # link_role's key, (role == "world", size), as one number
        self.rank_of_group = np.array(
            [(g.role == "world") * (1 << 40) + g.size for g in self.groups], np.int64
        )
        roles: dict[str, int] = {}
        self.role_id = np.array([roles.setdefault(g.role, len(roles)) for g in self.groups])
        self.role_id = self.role_id.astype(np.int64)


class ChannelHistory:
    """Every rank's channel reports over time, for the slow detector's windows.

    A directed link is slow in a window when, against the links of the same role that
    share no rank with it (they carry the same traffic pattern, so protocol effects such
    as delayed ACKs on one-way flows are in the reference too) or, without such siblings,
    against its own history, its send-queue time per byte is SLOW_RATIO times higher and
    its RTT RTT_RATIO times (by at least SLOW_RTT_EXCESS_US), and its send queue is busy
    SLOW_BUSY_SHARE of the time. The rank common to the slow links is named; a single
    slow connection is named as a link unless one end's other connections are slow too
    (PORT_RATIO: its port).
    """

    def __init__(self) -> None:
        self.batches: deque[ChannelRows] = deque()  # one per ingest, oldest first
        self.history = LinkHistory()
        self.nccl_history = LinkHistory()
        self.span_start: int | None = None  # of windows not judged yet (too few reports)
        # Start of the first of the consecutive windows with slow links: a port's other
        # connections are judged on all of them (PORT_RATIO).
        self.episode_start: int | None = None
        self.roles = _LinkRoles()
        self.last = LinkJudgement(None, True)

    def ingest(self, fresh: Sequence[RankSummary]) -> None:
        """Keep the channel evidence of ``fresh``, the summaries not seen before."""
        rows = table_of(fresh).channel_rows()
        if len(rows.reports):
            self.batches.append(rows)
            newest = int(rows.reports["mid_ns"].max())
            self.forget_before(newest - int(KEEP_S * 1e9))

    def between(self, t0: int, t1: int) -> ChannelRows:
        """The reports whose interval lies mostly in (t0, t1]."""
        return ChannelRows.concat([b.between(t0, t1) for b in self.batches])

    def forget_before(self, t_ns: int) -> None:
        """Drop the batches whose reports all lie mostly before ``t_ns``."""
        while self.batches and self.batches[0].reports["mid_ns"].max() < t_ns:
            self.batches.popleft()

    def slow_links(
        self, view: JobView, t0: int, t1: int, late: frozenset[int] = frozenset()
    ) -> LinkJudgement:
        """Links that were slow on the network during [t0, t1] (diagnoser clock), with any
        earlier windows too short to judge, and the rank or link they have in common
        (``found`` None: every link is healthy). TCP links first; NCCL links where no TCP
        link is slow. A link into a rank of ``late`` (computing slower than its cohort) is
        not slow on the network: that rank drains its connections late."""
        start = t0 if self.span_start is None else self.span_start
        rows = self.between(start, t1)
        if not _enough(rows):
            self.span_start = start
            return LinkJudgement(
                self.last.found, False, self.last.measured, pending=bool(self.batches)
            )
        self.span_start = None
        tcp, nccl = tcp_links(rows), nccl_links(rows)
        episode = start if self.episode_start is None else self.episode_start
        since = self.between(episode, t1) if episode < start else rows
        found = _locate(view, tcp, self.history, _TCP, self.roles, late, lambda: tcp_links(since))
        if found is None:
            found = _locate(
                view, nccl, self.nccl_history, _NCCL, self.roles, late, lambda: nccl_links(since)
            )
        self.episode_start = episode if found is not None else None
        self.forget_before(min(start, episode) - int(FORGET_S * 1e9))
        self.last = LinkJudgement(
            found,
            True,
            MeasuredLinks(
                np.concatenate([tcp.src, nccl.src]).astype(np.int64),
                np.concatenate([tcp.dst, nccl.dst]).astype(np.int64),
            ),
        )
        return self.last

    def port_end(
        self, view: JobView, link: list[int], t0: int, t1: int
    ) -> tuple[int | None, list[Evidence]] | None:
        """Of a connection found slow by other evidence (a pipeline's messages) over
        [t0, t1], the end whose other connections the channels show slow too (PORT_RATIO,
        as for a slow connection of their own): (its rank, those links and why it is named
        as evidence); (None, [that neither is]) when neither end's are; (None, []) when
        both are, or the job reports no channels; None while they have too few reports of
        [t0, t1] to judge."""
        if not self.batches:
            return None, []
        rows = self.between(t0, t1)
        if not _enough(rows):
            return None
        ports = _Ports(view, tcp_links(rows), self.roles, self.history, rtt=True)
        found = {r: ports.slow_links(r, link) for r in link}
        ends = [r for r in link if found[r]]
        if not ends:
            return None, [_one_link(link)]
        if len(ends) > 1:
            return None, []
        (end,), shown = ends, found[ends[0]]
        (other,) = [r for r in link if r != end]
        lines = [_TCP.line(*x) for x in _lines(shown, len(shown))]
        return end, [*lines, common_rank(end, other)]


def common_rank(rank: int, healthy_end: int | None = None) -> Evidence:
    """Why the rank every slow link has at one end is named: its port (and, where one
    connection was slow, why not its other end)."""
    why = (
        f", and rank {healthy_end}'s other connections are not slow"
        if healthy_end is not None
        else ""
    )
    return Evidence.of(
        "common_rank",
        "every slow link has rank {rank} at one end" + why + ": its NIC or link",
        rank=rank,
    )


def _one_link(link: list[int]) -> Evidence:
    return Evidence.of(
        "one_link",
        "one link is slow ({link[0]}<->{link[1]}); the other links of both ranks are not",
        link=link,
    )


def _enough(rows: ChannelRows) -> bool:
    """Whether the ranks that reported channels did so SLOW_MIN_TICKS times each (the
    median rank: one whose agent lags does not hold the others back)."""
    if not len(rows.reports):
        return False
    counts = np.sort(np.unique(rows.reports["rank"], return_counts=True)[1])
    return int(counts[(len(counts) - 1) // 2]) >= SLOW_MIN_TICKS


@dataclass(frozen=True)
class _Rules:
    """How one transport's links are judged against their reference (siblings or own
    history), and how a finding reads."""

    eligible: Callable[[LinkStats, float], bool]  # (link, reference RTT)
    slow: Callable[[LinkStats, float], bool]  # (link, reference time per MB)
    line: Callable[[LinkStats, float, float, str], Evidence]
    ratio: float  # the least time per byte over the reference that ``slow`` can accept
    rtt: bool  # whether the links have an RTT


# What a slow link is compared with, by the ``reference`` of its evidence.
_REFERENCES = {
    "siblings": "links of the same role that share no rank with it",
    "history": "its own history",
}
# The references of the other connections of a slow port's rank (see PORT_RATIO): in the
# evidence's data they are "siblings" too.
_PORT_REFERENCES = {
    "same direction": "the same direction of the links of its role that share no rank with it",
    "same way around": "the links of its group as far the same way around it (a ring's or a "
    "pipeline's next rank, or previous) that share no rank with it",
}


def _described(ref: str) -> str:
    return _REFERENCES.get(ref) or _PORT_REFERENCES.get(ref, _PORT_REFERENCES["same direction"])


def _tcp_line(st: LinkStats, r_rtt: float, r_spm: float, ref: str) -> Evidence:
    return Evidence.of(
        "link_slow",
        "rank {rank} -> {peer}: RTT {rtt_ms:.1f} ms (floor {floor_ms:.2f} ms), send queue busy "
        "{busy_share:.0%}, {ms_per_mb:.0f} ms per MB ({mb_s:.1f} MB/s while busy), up to "
        "{queued:bytes} queued, {retransmits} retransmits; {rtt_ratio:.1f}x the RTT and "
        "{time_ratio:.1f}x the time per byte of " + _described(ref),
        rank=st.src,
        peer=st.dst,
        rtt_ms=st.rtt_us / 1000,
        floor_ms=st.floor_us / 1000,
        busy_share=st.busy,
        ms_per_mb=st.s_per_mb * 1000,
        mb_s=1 / st.s_per_mb,
        queued=st.queued,
        retransmits=st.retrans,
        rtt_ratio=st.rtt_us / r_rtt if r_rtt > 0 else 0.0,
        time_ratio=st.s_per_mb / r_spm,
        reference=ref if ref in _REFERENCES else "siblings",
    )


def _nccl_line(st: LinkStats, r_rtt: float, r_spm: float, ref: str) -> Evidence:
    return Evidence.of(
        "nccl_link_slow",
        "rank {rank} -> {peer} (NCCL): send steps wait {ms_per_mb:.1f} ms per MB handed to "
        "the network, {time_ratio:.1f}x "
        + _described(ref)
        + " ({ref_ms_per_mb:.2f} ms); {sent:bytes} sent in {intervals} intervals",
        rank=st.src,
        peer=st.dst,
        ms_per_mb=st.s_per_mb * 1000,
        time_ratio=st.s_per_mb / r_spm,
        ref_ms_per_mb=r_spm * 1000,
        reference=ref if ref in _REFERENCES else "siblings",
        sent=st.sent,
        intervals=st.ticks,
    )


_TCP = _Rules(
    eligible=lambda st, r_rtt: (
        st.rtt_us >= RTT_RATIO * r_rtt and st.rtt_us - r_rtt >= SLOW_RTT_EXCESS_US
    ),
    slow=lambda st, r_spm: st.s_per_mb >= SLOW_RATIO * r_spm and st.busy >= SLOW_BUSY_SHARE,
    line=_tcp_line,
    ratio=SLOW_RATIO,
    rtt=True,
)
_NCCL = _Rules(
    eligible=lambda st, r_rtt: True,  # no RTT: the plugin sees steps, not packets
    slow=lambda st, r_spm: (
        st.s_per_mb >= NCCL_SLOW_RATIO * r_spm and st.busy >= NCCL_MIN_WAIT_SHARE
    ),
    line=_nccl_line,
    ratio=NCCL_SLOW_RATIO,
    rtt=False,
)

# A slow directed link as shown: its stats, its reference's (RTT, time per MB), and which
# reference that is ("siblings", "history", or "same direction" for a port's other links).
_Shown = tuple[LinkStats, float, float, str]


def _locate(
    view: JobView,
    links: LinkTable,
    history: LinkHistory,
    rules: _Rules,
    roles: _LinkRoles,
    late: frozenset[int] = frozenset(),
    pooled: Callable[[], LinkTable] | None = None,
) -> LinkFinding | None:
    """The slow links among ``links`` and the rank or link they have in common; a port's
    other connections are judged on ``pooled()`` (the links over every window since the
    slow links appeared) when given, else on ``links``. Links into a rank of ``late`` are
    not judged: a rank that computes late posts its receives late, and its peers' sends
    to it queue (seen: a DDP straggler's peer named for its link into the straggler)."""
    group = roles.of(view, links)
    # links of no group make a role of their own
    role = np.where(group >= 0, roles.role_id[np.maximum(group, 0)], len(roles.groups))
    floor = spm_floors(role, links)
    # under any median its siblings can have: not slow (NaN: maybe no sibling is left)
    cleared = links.s_per_mb < rules.ratio * floor
    slow: list[_Shown] = []
    for i in np.flatnonzero(~cleared).tolist():
        st = links.stats(i)
        if st.dst in late:
            continue
        ref = sibling_medians(role, links, i)
        source = "siblings"
        if ref is None:
            ref, source = history.ref(st.src, st.dst), "history"
        if ref is None or not rules.eligible(st, ref[0]):
            continue
        if rules.slow(st, ref[1]):
            slow.append((st, ref[0], ref[1], source))
    if not slow and rules.rtt:
        slow = _slow_pipe_connections(view, links, roles, history, group, late)
    if not slow:
        history.append(links)
        return None
    ranks, link = common_culprit([(st.src, st.dst) for st, *_ in slow], set())
    ports = _Ports(view, pooled() if pooled is not None else links, roles, history, rules.rtt)
    shown = list(slow)
    healthy_end = None
    if link is not None:
        # One slow connection: the end whose other connections are slow too is its port.
        found = {r: ports.slow_links(r, link) for r in link}
        ends = [r for r in link if found[r]]
        if len(ends) == 1:
            (healthy_end,) = [r for r in link if r != ends[0]]
            ranks, link = ends, None
            shown += found[ends[0]]
    elif len(ranks) == 1:
        pairs = {(st.src, st.dst) for st, *_ in slow}
        shown += [x for x in ports.slow_links(ranks[0]) if (x[0].src, x[0].dst) not in pairs]
    named = {(st.src, st.dst) for st, *_ in shown}
    each = zip(links.src.tolist(), links.dst.tolist(), strict=True)
    history.append(links, np.array([k not in named for k in each], bool))
    worst, ref_rtt, ref_spm, source = max(slow, key=lambda x: x[0].s_per_mb / x[2])
    evidence = [rules.line(*x) for x in _lines(shown, len(slow))]
    if link is None and len(ranks) == 1:
        evidence.append(common_rank(ranks[0], healthy_end))
    elif link is not None:
        evidence.append(_one_link(link))
    severity = round(worst.s_per_mb / ref_spm, 2) if ref_spm > 0 else 0.0
    (i,) = np.flatnonzero((links.src == worst.src) & (links.dst == worst.dst)).tolist()
    worst_group = roles.groups[group[i]] if group[i] >= 0 else None
    return LinkFinding(ranks, link, worst_group, severity, evidence)


def _slow_pipe_connections(
    view: JobView,
    links: LinkTable,
    roles: _LinkRoles,
    history: LinkHistory,
    group: np.ndarray,
    late: frozenset[int],
) -> list[_Shown]:
    """Both directions of each pipeline connection slow by PIPE_RATIO against the same
    direction of its sibling pipelines' link at its place (see PIPE_RATIO)."""
    pp = np.array([g.role == "pp" for g in roles.groups] + [False], bool)[group]
    if not pp.any() or pp.sum() > PIPE_MAX_LINKS:
        return []
    ports = _Ports(view, links.select(pp), roles, history, rtt=True)
    slow: list[_Shown] = []
    for a, b in [k for k in ports.links if k[0] < k[1] and (k[1], k[0]) in ports.links]:
        if a in late or b in late:
            continue
        ways = []
        for k in ((a, b), (b, a)):
            found = ports.reference(k)
            if found is None or found[1] != "same direction" or found[0][1] <= 0:
                break
            (r_rtt, r_spm), source = found
            ways.append((ports.links[k], r_rtt, r_spm, source))
        if len(ways) == 2 and ports.slow(ways, PIPE_RATIO):
            slow += ways
    return slow


def _lines(shown: list[_Shown], strict: int) -> list[_Shown]:
    """The links to show, at most MAX_LINK_LINES: every connection's slower direction
    first (the slow links by the strict test, then a port's other connections, each by
    its ratio), then their other directions."""
    ratio = {(st.src, st.dst): st.s_per_mb / r_spm for st, _, r_spm, _ in shown}
    by_pair: dict[tuple[int, int], list[_Shown]] = defaultdict(list)
    order: dict[tuple[int, int], tuple[int, float]] = {}
    for i, x in enumerate(shown):
        pair = x[0].pair
        by_pair[pair].append(x)
        tier = 0 if i < strict else 1
        key = (tier, -ratio[(x[0].src, x[0].dst)])
        order[pair] = min(order.get(pair, key), key)
    pairs = sorted(by_pair, key=lambda p: (order[p], p))
    for p in pairs:
        by_pair[p].sort(key=lambda x: -ratio[(x[0].src, x[0].dst)])
    picked = [by_pair[p][0] for p in pairs] + [x for p in pairs for x in by_pair[p][1:]]
    return picked[:MAX_LINK_LINES]


def _around(place: tuple) -> tuple:
    """A link's place by how far around its group it goes: (role, size, steps forward)."""
    role, size, src, dst = place
    return (role, size, (dst - src) % size)


class _Ports:
    """A rank's other connections, judged against the same direction of their siblings:
    is the rank's port slow (see PORT_RATIO)? Built only in a window with slow links."""

    def __init__(
        self, view: JobView, table: LinkTable, roles: _LinkRoles, history: LinkHistory, rtt: bool
    ) -> None:
        self.links, self.history, self.rtt = table.as_dict(), history, rtt
        links = self.links
        self.groups = {
            k: roles.groups[g] if g >= 0 else None
            for k, g in zip(links, roles.of(view, table).tolist(), strict=True)
        }
        by_role: dict[str | None, dict[tuple[int, int], LinkStats]] = defaultdict(dict)
        for k, st in links.items():
            g = self.groups[k]
            by_role[g.role if g is not None else None][k] = st
        self.siblings = {role: _SiblingMedians(ls) for role, ls in by_role.items()}
        self.touching: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for k in links:
            self.touching[k[0]].append(k)
            self.touching[k[1]].append(k)
        self._positions: dict[int, dict[int, int]] = {}
        self._by_place: dict[tuple, _SiblingMedians] | None = None

    def place(self, k: tuple[int, int]) -> tuple | None:
        """(role, group size, position of the sender, of the receiver) in its group."""
        g = self.groups.get(k)
        if g is None:
            return None
        pos = self._positions.get(g.group_id)
        if pos is None:
            pos = self._positions[g.group_id] = {r: i for i, r in enumerate(g.ranks)}
        return (g.role, g.size, pos[k[0]], pos[k[1]])

    def reference(self, k: tuple[int, int]) -> tuple[tuple[float, float], str] | None:
        """The same direction of k's siblings (RTT, time per MB); else, in a role of one
        group, the links as far around it the same way (a ring's or a pipeline's: the
        next rank's, or the previous one's; its two directions carry different traffic);
        else all its siblings, else its own history."""
        if self._by_place is None:
            places: dict[tuple, dict[tuple[int, int], LinkStats]] = defaultdict(dict)
            for j, st in self.links.items():
                pl = self.place(j)
                if pl is not None:
                    places[pl][j] = st
                    places[_around(pl)][j] = st
            self._by_place = {pl: _SiblingMedians(ls) for pl, ls in places.items()}
        pl = self.place(k)
        if pl is not None:
            for key, source in ((pl, "same direction"), (_around(pl), "same way around")):
                ref = self._by_place[key].without(k)
                if ref is not None:
                    return ref, source
        g = self.groups.get(k)
        ref = self.siblings[g.role if g is not None else None].without(k)
        if ref is not None:
            return ref, "siblings"
        hist = self.history.ref(*k)
        return (hist, "history") if hist is not None else None

    def slow_links(self, rank: int, besides: list[int] | None = None) -> list[_Shown]:
        """The links of ``rank``'s connections (other than to ``besides``' ranks) that
        are slow by PORT_RATIO and PORT_MIN_EXCESS, when more than half of its connections
        measured are; empty otherwise."""
        skip = set(besides or ()) - {rank}
        per_peer: dict[int, list[_Shown]] = defaultdict(list)
        for k in self.touching.get(rank, ()):
            peer = k[1] if k[0] == rank else k[0]
            if peer in skip:
                continue
            found = self.reference(k)
            if found is not None and found[0][1] > 0:
                (r_rtt, r_spm), source = found
                per_peer[peer].append((self.links[k], r_rtt, r_spm, source))
        slow = [xs for xs in per_peer.values() if self.slow(xs)]
        if 2 * len(slow) <= len(per_peer):
            return []
        return [x for xs in slow for x in xs if x[0].s_per_mb > x[2]]

    def slow(self, directions: list[_Shown], ratio: float = PORT_RATIO) -> bool:
        """Whether one connection's directions (against their references) are slow."""
        logs, excess = [], 0.0
        for st, r_rtt, r_spm, _ in directions:
            logs.append(math.log(max(st.s_per_mb / r_spm, 1e-6)))  # NCCL waits can be 0
            if self.rtt:
                floor = PORT_RTT_FLOOR_US
                logs.append(math.log((st.rtt_us + floor) / (r_rtt + floor)))
            if st.s_per_mb > 0:
                excess = max(excess, st.busy * (1 - r_spm / st.s_per_mb))
        return math.exp(statistics.fmean(logs)) >= ratio and excess >= PORT_MIN_EXCESS
