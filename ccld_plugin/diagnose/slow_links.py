"""Slow links: which links were slow over a window of time, and the rank they share.

Every rank's channel reports (``peer_channels``, as numpy rows) are kept until the slow
detector's windows have passed them; per window each directed link's intervals that moved
data are summarized and compared with its sibling links of the same role that share no
rank with it, or, without siblings, with its own history. TCP links by their RTT and time
of non-empty send queue per byte; NCCL links by the time their send steps spent handed to
the network per byte (the plugin's per-link totals).
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ccld_plugin.diagnose.records import Evidence
from ccld_plugin.diagnose.robust import RankedValues
from ccld_plugin.diagnose.tcp_evidence import common_culprit
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.wire.codes import DIRECTION_SEND, SOURCE_NCCL, SOURCE_TCP
from ccld_plugin.wire.peer_channels import ChannelRows, channel_rows
from ccld_plugin.wire.summary import RankSummary
from ccld_plugin.wire.topology import GroupInfo

__all__ = ["ChannelHistory", "LinkFinding", "LinkJudgement", "LinkStats", "link_role"]

# Slow links (see ChannelHistory). Only intervals in which a link moved SLOW_MIN_BYTES
# count, at least SLOW_MIN_TICKS of them per judgement: a window of steps shorter than
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
SLOW_MIN_BYTES = 32 * 1024
SLOW_MIN_TICKS = 3
SLOW_RATIO = 6.0
RTT_RATIO = 3.0
SLOW_RTT_EXCESS_US = 1_000
SLOW_BUSY_SHARE = 0.2
# Once one link is slow, its two ends are told apart with softer evidence: the end whose
# other links are slow by LOCATE_RATIO in time per byte (and RTT_RATIO in RTT) while the
# other end's are not is named, however little those links are used (a PP link of a
# TP-heavy job is busy ~10%). It is below the slow ratios: a link that is not LOCATE_RATIO
# over its reference is not slow either (``_locate`` skips it on that bound).
LOCATE_RATIO = 3.0
JIFFY_S = 0.004  # the coarsest kernel timer resolution in use (HZ=250)
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


@dataclass(frozen=True)
class LinkJudgement:
    """What the channel evidence says about one slow-detector window."""

    found: LinkFinding | None
    # False: the reports since the last judgement are too few to judge on; ``found`` is the
    # last judgement's, and the window neither confirms nor clears it.
    fresh: bool
    # The directed links (rank, peer) that moved enough data to be judged: where ``found``
    # is None they were judged healthy.
    measured: frozenset[tuple[int, int]] = frozenset()


class LinkStats(NamedTuple):
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

    def spm_floor(self, k: tuple[int, int]) -> float | None:
        """A lower bound of ``without(k)``'s time per MB from counts alone: at most
        len(touching[a]) + len(touching[b]) - 1 links are left out (``k`` is in both), and
        leaving out more values can only lower the median. None: maybe no link is left."""
        left = self.count - len(self.touching[k[0]]) - len(self.touching[k[1]]) + 1
        return self.spm.values[(left - 1) // 2] if left >= 1 else None

    def without(self, k: tuple[int, int]) -> tuple[float, float] | None:
        """(median RTT, median s per MB) of the links sharing no rank with ``k``; None
        when every link does."""
        left_out = self.touching[k[0]] | self.touching[k[1]]
        if len(left_out) >= self.count:
            return None
        return self.rtt.median_without(left_out), self.spm.median_without(left_out)


class _LinkRoles:
    """``link_role`` of each link, kept while the view's topology stays the same object
    (the diagnoser service builds a new one when a group table changes)."""

    def __init__(self) -> None:
        self.topology: object = None
        self.known: dict[tuple[int, int], GroupInfo | None] = {}

    def __call__(self, view: JobView, k: tuple[int, int]) -> GroupInfo | None:
        if view.topology is not self.topology:
            self.topology, self.known = view.topology, {}
        if k not in self.known:
            self.known[k] = link_role(view, *k)
        return self.known[k]


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
        self.batches: deque[ChannelRows] = deque()  # one per ingest, oldest first
        self.history: dict[tuple[int, int], deque[LinkStats]] = defaultdict(lambda: deque(maxlen=8))
        self.nccl_history: dict[tuple[int, int], deque[LinkStats]] = defaultdict(
            lambda: deque(maxlen=8)
        )
        self.span_start: int | None = None  # of windows not judged yet (too few reports)
        self.roles = _LinkRoles()
        self.last = LinkJudgement(None, True)

    def ingest(self, fresh: Iterable[RankSummary]) -> None:
        """Keep the channel evidence of ``fresh``, the summaries not seen before."""
        rows = channel_rows(fresh)
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

    def slow_links(self, view: JobView, t0: int, t1: int) -> LinkJudgement:
        """Links that were slow on the network during [t0, t1] (diagnoser clock), with any
        earlier windows too short to judge, and the rank or link they have in common
        (``found`` None: every link is healthy). TCP links first; NCCL links where no TCP
        link is slow."""
        start = t0 if self.span_start is None else self.span_start
        rows = self.between(start, t1)
        if not _enough(rows):
            self.span_start = start
            return LinkJudgement(self.last.found, False)
        self.span_start = None
        tcp, nccl = tcp_links(rows), nccl_links(rows)
        found = _locate(view, tcp, self.history, _TCP, self.roles)
        if found is None:
            found = _locate(view, nccl, self.nccl_history, _NCCL, self.roles)
        self.forget_before(start - int(FORGET_S * 1e9))
        self.last = LinkJudgement(found, True, frozenset(tcp) | frozenset(nccl))
        return self.last


def _by_link(e: np.ndarray, order_by: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``e`` sorted by link (rank, peer), then by ``order_by``; each link's first row and
    its number of rows."""
    e = e[np.lexsort((e[order_by], e["peer"], e["rank"]))]
    new = np.ones(len(e), dtype=bool)
    new[1:] = (e["rank"][1:] != e["rank"][:-1]) | (e["peer"][1:] != e["peer"][:-1])
    starts = np.flatnonzero(new)
    return e, starts, np.diff(np.append(starts, len(e)))


def tcp_links(rows: ChannelRows) -> dict[tuple[int, int], LinkStats]:
    """The TCP links that moved SLOW_MIN_BYTES in SLOW_MIN_TICKS of ``rows``' intervals."""
    e = rows.entries
    e = e[(e["source"] == SOURCE_TCP) & (e["sent"] >= SLOW_MIN_BYTES) & (e["rtt_us"] > 0)]
    if not len(e):
        return {}
    e, starts, counts = _by_link(e, "rtt_us")
    rtt = e["rtt_us"].astype(np.float64)
    share = e["busy"] / 255
    # The kernel counts busy time in jiffies: an interval that moved data was busy for at
    # least about one, however little it shows.
    busy_s = np.add.reduceat(np.maximum(e["interval_s"] * share, JIFFY_S), starts)
    sent = np.add.reduceat(e["sent"].astype(np.int64), starts)
    cols = zip(
        e["rank"][starts].tolist(),
        e["peer"][starts].tolist(),
        counts.tolist(),
        ((rtt[starts + (counts - 1) // 2] + rtt[starts + counts // 2]) / 2).tolist(),
        np.minimum.reduceat(e["min_rtt_us"], starts).tolist(),
        (busy_s / (sent / 1e6)).tolist(),
        (np.add.reduceat(share, starts) / counts).tolist(),
        np.maximum.reduceat(e["queued"], starts).tolist(),
        np.add.reduceat(e["retrans"].astype(np.int64), starts).tolist(),
        sent.tolist(),
        strict=True,
    )
    return {(c[0], c[1]): LinkStats(*c) for c in cols if c[2] >= SLOW_MIN_TICKS}


def nccl_links(rows: ChannelRows) -> dict[tuple[int, int], LinkStats]:
    """NCCL send links over ``rows``: ``s_per_mb`` is the time their steps spent handed to
    the network per MB sent, ``busy`` that time over the intervals."""
    e = rows.entries
    e = e[
        (e["source"] == SOURCE_NCCL)
        & (e["direction"] == DIRECTION_SEND)
        & (e["sent"] >= SLOW_MIN_BYTES)
    ]
    if not len(e):
        return {}
    e, starts, counts = _by_link(e, "sent")
    sent = np.add.reduceat(e["sent"].astype(np.int64), starts)
    wait_s = np.add.reduceat(e["net_wait_us"].astype(np.float64), starts) / 1e6
    span_s = np.maximum(np.add.reduceat(e["interval_s"], starts), 1e-9)
    cols = zip(
        e["rank"][starts].tolist(),
        e["peer"][starts].tolist(),
        counts.tolist(),
        (wait_s / (sent / 1e6)).tolist(),
        (wait_s / span_s).tolist(),
        sent.tolist(),
        strict=True,
    )
    return {
        (src, dst): LinkStats(src, dst, n, 0.0, 0, spm, busy, 0, 0, sent)
        for src, dst, n, spm, busy, sent in cols
        if n >= SLOW_MIN_TICKS
    }


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


# What a slow link is compared with, by the ``reference`` of its evidence.
_REFERENCES = {
    "siblings": "links of the same role that share no rank with it",
    "history": "its own history",
}


def _tcp_line(st: LinkStats, r_rtt: float, r_spm: float, ref: str) -> Evidence:
    return Evidence.of(
        "link_slow",
        "rank {rank} -> {peer}: RTT {rtt_ms:.1f} ms (floor {floor_ms:.2f} ms), send queue busy "
        "{busy_share:.0%}, {ms_per_mb:.0f} ms per MB ({mb_s:.1f} MB/s while busy), up to "
        "{queued:bytes} queued, {retransmits} retransmits; {rtt_ratio:.0f}x the RTT and "
        "{time_ratio:.0f}x the time per byte of " + _REFERENCES[ref],
        rank=st.src,
        peer=st.dst,
        rtt_ms=st.rtt_us / 1000,
        floor_ms=st.floor_us / 1000,
        busy_share=st.busy,
        ms_per_mb=st.s_per_mb * 1000,
        mb_s=1 / st.s_per_mb,
        queued=st.queued,
        retransmits=st.retrans,
        rtt_ratio=st.rtt_us / r_rtt,
        time_ratio=st.s_per_mb / r_spm,
        reference=ref,
    )


def _nccl_line(st: LinkStats, r_rtt: float, r_spm: float, ref: str) -> Evidence:
    return Evidence.of(
        "nccl_link_slow",
        "rank {rank} -> {peer} (NCCL): send steps wait {ms_per_mb:.1f} ms per MB handed to "
        "the network, {time_ratio:.0f}x " + _REFERENCES[ref] + " ({ref_ms_per_mb:.2f} ms); "
        "{sent:bytes} sent in {intervals} intervals",
        rank=st.src,
        peer=st.dst,
        ms_per_mb=st.s_per_mb * 1000,
        time_ratio=st.s_per_mb / r_spm,
        ref_ms_per_mb=r_spm * 1000,
        reference=ref,
        sent=st.sent,
        intervals=st.ticks,
    )


_TCP = _Rules(
    eligible=lambda st, r_rtt: (
        st.rtt_us >= RTT_RATIO * r_rtt and st.rtt_us - r_rtt >= SLOW_RTT_EXCESS_US
    ),
    slow=lambda st, r_spm: st.s_per_mb >= SLOW_RATIO * r_spm and st.busy >= SLOW_BUSY_SHARE,
    line=_tcp_line,
)
_NCCL = _Rules(
    eligible=lambda st, r_rtt: True,  # no RTT: the plugin sees steps, not packets
    slow=lambda st, r_spm: (
        st.s_per_mb >= NCCL_SLOW_RATIO * r_spm and st.busy >= NCCL_MIN_WAIT_SHARE
    ),
    line=_nccl_line,
)


def _locate(
    view: JobView,
    links: dict[tuple[int, int], LinkStats],
    history: dict[tuple[int, int], deque[LinkStats]],
    rules: _Rules,
    role_of: Callable[[JobView, tuple[int, int]], GroupInfo | None],
) -> LinkFinding | None:
    """The slow links among ``links`` and the rank or link they have in common."""
    groups = {k: role_of(view, k) for k in links}
    roles = {k: g.role if g is not None else None for k, g in groups.items()}
    by_role: dict[str | None, dict[tuple[int, int], LinkStats]] = defaultdict(dict)
    for k, st in links.items():
        by_role[roles[k]][k] = st
    siblings = {role: _SiblingMedians(ls) for role, ls in by_role.items()}
    slow: list[tuple[LinkStats, float, float, str]] = []
    softer: list[tuple[LinkStats, float, float, str]] = []
    for k, st in links.items():
        role = roles[k]
        floor = siblings[role].spm_floor(k)
        if floor is not None and st.s_per_mb < LOCATE_RATIO * floor:
            continue  # under any median its siblings can have: neither slow nor softer
        ref = siblings[role].without(k)
        source = "siblings"
        if ref is None and history[k]:
            ref = (
                statistics.median(o.rtt_us for o in history[k]),
                statistics.median(o.s_per_mb for o in history[k]),
            )
            source = "history"
        if ref is None or not rules.eligible(st, ref[0]):
            continue
        ref_rtt, ref_spm = ref
        if rules.slow(st, ref_spm):
            slow.append((st, ref_rtt, ref_spm, source))
        if st.s_per_mb >= LOCATE_RATIO * ref_spm:
            softer.append((st, ref_rtt, ref_spm, source))
    slow_keys = {(st.src, st.dst) for st, *_ in softer}
    for k, st in links.items():
        if k not in slow_keys:
            history[k].append(st)
    if not slow:
        return None
    ranks, link = common_culprit([(st.src, st.dst) for st, *_ in slow], set())
    shown = list(slow)
    if link is not None:
        # One slow link: is one end slow on its other links too (its NIC)?
        other = {
            r: [x for x in softer if r in x[0].pair and x[0].pair != tuple(link)] for r in link
        }
        ends = [r for r in link if other[r]]
        if len(ends) == 1:
            ranks, link = ends, None
            shown += other[ends[0]]
    worst, ref_rtt, ref_spm, source = max(slow, key=lambda x: x[0].s_per_mb / x[2])
    evidence = [
        rules.line(st, r_rtt, r_spm, src)
        for st, r_rtt, r_spm, src in sorted(shown, key=lambda x: (x[0].src, x[0].dst))[:4]
    ]
    if link is None and len(ranks) == 1:
        evidence.append(
            Evidence.of(
                "common_rank",
                "every slow link has rank {rank} at one end: its NIC or link",
                rank=ranks[0],
            )
        )
    elif link is not None:
        evidence.append(
            Evidence.of(
                "one_link",
                "one link is slow ({link[0]}<->{link[1]}); the other links of both ranks are not",
                link=link,
            )
        )
    severity = round(worst.s_per_mb / ref_spm, 2) if ref_spm > 0 else 0.0
    return LinkFinding(ranks, link, groups.get((worst.src, worst.dst)), severity, evidence)
