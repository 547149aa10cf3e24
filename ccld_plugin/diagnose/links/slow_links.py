"""Slow links: which links were slow over a window of time, and the rank they share.

Every rank's channel reports (``peer_channels``, as numpy rows) are kept until the slow
detector's windows have passed them; per window each directed link's intervals that moved
data are summarized and compared with its sibling links of the same role that share no
rank with it, or, without siblings, with its own history. TCP links by their RTT and time
of non-empty send queue per byte; NCCL links by the time their send steps spent handed to
the network per byte (the plugin's per-link totals).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ccld_plugin.diagnose.links.link_roles import LinkRoles
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
from ccld_plugin.diagnose.links.ports import Ports, Shown
from ccld_plugin.diagnose.links.tcp_evidence import common_culprit
from ccld_plugin.diagnose.records import Evidence
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.topology import GroupInfo
from ccld_plugin.wire.peer_channels import ChannelRows
from ccld_plugin.wire.summary import RankSummary
from ccld_plugin.wire.summary_batch import table_of

__all__ = [
    "ChannelHistory",
    "LinkFinding",
    "LinkJudgement",
    "MeasuredLinks",
    "common_rank",
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
# A pipeline's connection (both directions of a point-to-point link) among sibling
# pipelines: its one-way flows wait on delayed ACKs and late reads on healthy links too,
# so one direction's time per byte rarely reaches SLOW_RATIO over links that mix both
# directions (a TP1xPP2xDP2 link shaped to 30 Mbit/s, doubling the step: 2.8x and 2.2x).
# Against the same direction of the sibling pipelines' link at its place, the geometric
# mean of both directions' time per byte and RTT ratios (as ports.PORT_RATIO) read 3.7-3.9
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


class ChannelHistory:
    """Every rank's channel reports over time, for the slow detector's windows.

    A directed link is slow in a window when, against the links of the same role that
    share no rank with it (they carry the same traffic pattern, so protocol effects such
    as delayed ACKs on one-way flows are in the reference too) or, without such siblings,
    against its own history, its send-queue time per byte is SLOW_RATIO times higher and
    its RTT RTT_RATIO times (by at least SLOW_RTT_EXCESS_US), and its send queue is busy
    SLOW_BUSY_SHARE of the time. The rank common to the slow links is named; a single
    slow connection is named as a link unless one end's other connections are slow too
    (ports.PORT_RATIO: its port).
    """

    def __init__(self) -> None:
        self.batches: deque[ChannelRows] = deque()  # one per ingest, oldest first
        self.history = LinkHistory()
        self.nccl_history = LinkHistory()
        self.span_start: int | None = None  # of windows not judged yet (too few reports)
        # Start of the first of the consecutive windows with slow links: a port's other
        # connections are judged on all of them (ports.PORT_RATIO).
        self.episode_start: int | None = None
        self.roles = LinkRoles()
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
        [t0, t1], the end whose other connections the channels show slow too (ports.PORT_RATIO,
        as for a slow connection of their own): (its rank, those links and why it is named
        as evidence); (None, [that neither is]) when neither end's are; (None, []) when
        both are, or the job reports no channels; None while they have too few reports of
        [t0, t1] to judge."""
        if not self.batches:
            return None, []
        rows = self.between(t0, t1)
        if not _enough(rows):
            return None
        ports = Ports(view, tcp_links(rows), self.roles, self.history, rtt=True)
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
# The references of the other connections of a slow port's rank (see ports.PORT_RATIO): in the
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


def _locate(
    view: JobView,
    links: LinkTable,
    history: LinkHistory,
    rules: _Rules,
    roles: LinkRoles,
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
    slow: list[Shown] = []
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
    ports = Ports(view, pooled() if pooled is not None else links, roles, history, rules.rtt)
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
    roles: LinkRoles,
    history: LinkHistory,
    group: np.ndarray,
    late: frozenset[int],
) -> list[Shown]:
    """Both directions of each pipeline connection slow by PIPE_RATIO against the same
    direction of its sibling pipelines' link at its place (see PIPE_RATIO)."""
    pp = np.array([g.role == "pp" for g in roles.groups] + [False], bool)[group]
    if not pp.any() or pp.sum() > PIPE_MAX_LINKS:
        return []
    ports = Ports(view, links.select(pp), roles, history, rtt=True)
    slow: list[Shown] = []
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


def _lines(shown: list[Shown], strict: int) -> list[Shown]:
    """The links to show, at most MAX_LINK_LINES: every connection's slower direction
    first (the slow links by the strict test, then a port's other connections, each by
    its ratio), then their other directions."""
    ratio = {(st.src, st.dst): st.s_per_mb / r_spm for st, _, r_spm, _ in shown}
    by_pair: dict[tuple[int, int], list[Shown]] = defaultdict(list)
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
