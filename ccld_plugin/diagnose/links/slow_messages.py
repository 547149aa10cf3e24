"""The slow port or link that pipelines' paired messages (``p2p_transfers``) show, by their
round trips against the job's other connections, against their sibling pipelines', or,
for a job's one connection, against its own past.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import numpy as np

from ccld_plugin.diagnose.links.p2p_transfers import Transfers
from ccld_plugin.diagnose.links.slow_links import LinkFinding
from ccld_plugin.diagnose.records import Evidence
from ccld_plugin.diagnose.robust import RecentFloor
from ccld_plugin.topology import GroupInfo

__all__ = ["LoneConnection", "described_connections", "p2p_cleared", "slow_p2p_port"]

# A directed link is judged on a window with at least this many paired transfers.
MIN_TRANSFERS = 3
# Connections are judged by their round trip: the median transfer one way plus the other,
# which cancels the two ranks' clock offset (a healthy link read 5 ms one way and 0 the
# other on a loaded host). A slow port slows every connection of its rank: each takes
# this many times longer per byte than the median of the job's connections that do not
# touch the rank, and MIN_SLOW_ROUND_TRIP_NS there and back at least. A rank with one
# peer (a pipeline's first or last stage) cannot be told from its one connection: that
# link is named.
# Measured on healthy TP1xPP4 and TP1xPP8 torch and TP1xPP4 Megatron jobs (850 steps,
# 2-core host, 300 of them beside two busy processes), 64 KB messages: a rank's
# connections stood at most 3.1x the others' (round trips up to 3.5 ms), a connection up to
# 7.4x every other (7.8 ms, loaded); shaped to 30 Mbit/s (a rank's port, or one
# connection), 29-31 ms, 29-31x.
PORT_RATIO = 4.0
MIN_SLOW_ROUND_TRIP_NS = 10_000_000
# A reference round trip reads no less than this (healthy ones read ~0 +- the clocks' error).
MIN_REF_ROUND_TRIP_NS = 1_000_000
# A slow connection alone, against every other connection of the job; STEADY_LINK_RATIO
# where its low quartiles reach that ratio too: healthy connections of the false-alarm
# runs (torch and Megatron, pipelines alone and with siblings, some beside busy processes)
# read up to 3.4x the others by their low quartiles, slow ones (30 and 100 Mbit/s) 6.4-31x.
LINK_RATIO = 8.0
STEADY_LINK_RATIO = 5.0
# Among sibling pipelines nearly every message of a slow connection is slow: the low
# quartiles of its transfers there and back read this share of the ratio at least. A busy
# host holds some messages back, a slow link all of them: healthy pipeline connections
# (TP1xPP2xDP4, TP1xPP4xDP2, TP2xPP2, TP2xPP2xDP2; torch and Megatron, 300 steps, some
# beside busy processes) read up to 8.9x the others by their medians but 2.7x by their
# low quartiles; slow ones (a rank's port or one connection shaped to 30 or 100 Mbit/s)
# 7.4-31x. (A lone pipeline's first slow window, half before the onset, would fail it.)
SIBLING_LOW_SHARE = 0.4
# The job's one connection (a two-stage pipeline) against the low tenth of its own last
# windows, once it has MIN_HISTORY_WINDOWS of them. An onset early in a fast job leaves
# one healthy window, and on a busy host it may be a slow one: healthy TP1xPP2 windows
# read 0.2-1.4 ms quiet and -0.2-7.4 ms beside two busy processes (a fresh-clone CI run
# missed a fault at step 8; here such a window read 3.8 ms: 8.3x, at the edge of 8x);
# shaped to 30 Mbit/s, 30-32 ms. The same link against itself needs no margin for links
# that differ.
OWN_PAST_RATIO = 4.0
# Nearly every transfer must be slow: the low quartile of its transfers there plus back
# (the clock offset cancels as in the medians) reads OWN_PAST_RATIO of its past and
# MIN_STEADY_ROUND_TRIP_NS at least. A busy host holds some transfers back, a slow link
# all of them: healthy TP1xPP2 windows beside two busy processes read up to 7.7 ms by
# their medians but 4.3 by their low quartiles (5.8 in one window, alone; a verdict takes
# three in a row); shaped to 100 Mbit/s, 6.7-6.8 ms by both in every window (the job's
# step 30 -> 53 ms, missed at 10 ms). Then it needs no MIN_SLOW_ROUND_TRIP_NS, unless an
# end queues for a CPU (a crowded host delays every message a little: the healthy
# connections of a Megatron TP1xPP4 beside two busy processes read 5.0-5.3 ms by both).
# The same holds against the job's other connections (PORT_RATIO, LINK_RATIO) when the
# low quartiles reach the ratio too: a TP1xPP4 port shaped to 100 Mbit/s read 9.5x the
# others at 9.5 ms (7.6x by the low quartiles); healthy ones up to 2.7x by theirs.
MIN_STEADY_ROUND_TRIP_NS = 5_000_000
HISTORY_QUANTILE = 0.1
HISTORY_WINDOWS = 512
MIN_HISTORY_WINDOWS = 2
# The slow connections cost the job: their messages' excess over the reference adds up to
# this share of the window's time.
MIN_WINDOW_SHARE = 0.05


class _Way(NamedTuple):
    """One direction of a connection over a window: its transfers' median time (on two
    ranks' clocks: off by their offset error) and bytes, how many were paired, and how
    many messages it carried (the span of their seqs: the samples are a subset)."""

    transfer_ns: float
    bytes: float
    paired: int
    messages: int
    low_ns: float  # the low quartile of its transfers' times


class _Connection(NamedTuple):
    """Both directions of the connection between ranks ``a`` < ``b``: the two median
    transfer times add up to a round trip free of the ranks' clock offset (one direction
    reads it as much too long as the other too short)."""

    a: int
    b: int
    there: _Way  # a -> b
    back: _Way  # b -> a
    group: int

    @property
    def round_trip_ns(self) -> float:
        return self.there.transfer_ns + self.back.transfer_ns

    @property
    def low_round_trip_ns(self) -> float:
        """The low quartiles' round trip: what nearly every message took at least."""
        return self.there.low_ns + self.back.low_ns

    @property
    def ns_per_byte(self) -> float:
        return self.round_trip_ns / max(1.0, self.there.bytes + self.back.bytes)

    def reference_ns(self, ref_ns_per_byte: float) -> float:
        """The round trip a reference connection would take for these bytes."""
        bytes_ = self.there.bytes + self.back.bytes
        return max(MIN_REF_ROUND_TRIP_NS, ref_ns_per_byte * bytes_)

    def excess_ns(self, ref_ns_per_byte: float) -> float:
        """Time its messages took beyond the reference (half a round trip's each)."""
        excess = max(0.0, self.round_trip_ns - self.reference_ns(ref_ns_per_byte))
        return (self.there.messages + self.back.messages) * excess / 2


class LoneConnection:
    """A pipeline of two stages has one connection, and nothing to compare it with but its
    own past: the low tenth of its last HISTORY_WINDOWS windows' round trips per byte. It
    is slow when nearly all of its transfers are (their low quartiles), not a few that a
    busy host held back."""

    def __init__(self) -> None:
        self._windows: dict[tuple[int, int], RecentFloor] = {}

    def remember(self, transfers: Transfers, t0: int, t1: int, exclude: frozenset[int]) -> None:
        """Add the connections that the transfers of [t0, t1] measure to their past, not
        judged: the job's first steps, before the first whole window (which an onset at
        step 3 leaves without a healthy one)."""
        for c in _connections(transfers.within(t0, t1), exclude):
            self._past(c).add(c.ns_per_byte)

    def _past(self, c: _Connection) -> RecentFloor:
        return self._windows.setdefault((c.a, c.b), RecentFloor(HISTORY_QUANTILE, HISTORY_WINDOWS))

    def judge(
        self, c: _Connection, window_ns: int, groups: list[GroupInfo], queued: frozenset[int]
    ) -> LinkFinding | None:
        """``c``, the job's one connection this window, against its own earlier windows;
        ``queued``: ranks that waited for a CPU (their host is crowded)."""
        past = self._past(c)
        found = None
        if len(past) >= MIN_HISTORY_WINDOWS and c.low_round_trip_ns >= max(
            MIN_STEADY_ROUND_TRIP_NS, OWN_PAST_RATIO * c.reference_ns(past.value)
        ):
            link = [c.a, c.b]
            found = _finding(
                link,
                link,
                [c],
                past.value,
                OWN_PAST_RATIO,
                window_ns,
                groups,
                "its own past",
                min_round_trip_ns=_steady_floor(link, queued),
            )
        past.add(c.ns_per_byte)
        return found

    def judge_hub(
        self,
        hub: int,
        conns: list[_Connection],
        window_ns: int,
        groups: list[GroupInfo],
        queued: frozenset[int],
    ) -> LinkFinding | None:
        """A pipeline of three stages: both connections go through the middle one, and
        with no third to compare them with, each is judged against its own past. Both
        slow: the middle stage's port (one alone: that link)."""
        found = [f for c in conns if (f := self.judge(c, window_ns, groups, queued))]
        if len(found) < len(conns):
            return found[0] if len(found) == 1 else None
        return LinkFinding(
            [hub],
            None,
            found[0].group,
            min(f.severity for f in found),
            [e for f in found for e in f.evidence],
        )


def slow_p2p_port(
    transfers: Transfers,
    groups: list[GroupInfo],
    t0: int,
    t1: int,
    exclude: frozenset[int],
    lone: LoneConnection | None = None,
    queued: frozenset[int] = frozenset(),
) -> LinkFinding | None:
    """The slow port (a finding with no ``link``: every connection of its rank) or link
    that the transfers of [t0, t1] show, if any (``queued``: ranks that waited for a
    CPU). ``lone``, given where the job is one pipeline: the past of its connections, which
    are judged against it in a pipeline of two or three stages; None among sibling
    pipelines, where nearly every message of a slow connection must be slow
    (SIBLING_LOW_SHARE). Connections touching
    ``exclude`` (ranks computing slower than their cohort: a late reader drains its link
    late) and those measured one way only are not judged."""
    conns = _connections(transfers.within(t0, t1), exclude)
    window_ns = max(1, t1 - t0)
    if len(conns) < 2:
        if conns and lone and _whole_group(conns[0], groups):
            return lone.judge(conns[0], window_ns, groups, queued)
        return None
    hub = _hub(conns, groups)
    if hub is not None:
        return lone.judge_hub(hub, conns, window_ns, groups, queued) if lone else None
    # A rank's port or a link is judged only where every connection of the rank (of both
    # ends) was measured: the samples of one may have come late, and it may be the one
    # that tells a port (all slow) from a link (the others healthy).
    whole = _covered({(c.a, c.b) for c in conns}, _known_connections(transfers))
    low = 0.0 if lone else SIBLING_LOW_SHARE
    peers: dict[int, list[_Connection]] = defaultdict(list)
    for c in conns:
        peers[c.a].append(c)
        peers[c.b].append(c)
    per_byte = np.array([c.ns_per_byte for c in conns])
    ends = np.array([(c.a, c.b) for c in conns], np.int64)
    found: list[LinkFinding] = []
    for r, own in peers.items():
        others = per_byte[(ends != r).all(axis=1)]
        if len(own) >= 2 and len(others) and r in whole:
            ref = float(np.median(others))
            steady = _Steady(PORT_RATIO, _steady_floor([r], queued))
            f = _finding(
                [r], None, own, ref, PORT_RATIO, window_ns, groups, low_share=low, steady=steady
            )
            found += [f] if f is not None else []
    if not found:
        for i, c in enumerate(conns):
            if c.a not in whole or c.b not in whole:
                continue
            ref = float(np.median(np.delete(per_byte, i)))
            link = [c.a, c.b]
            steady = _Steady(STEADY_LINK_RATIO, _steady_floor(link, queued))
            f = _finding(
                link, link, [c], ref, LINK_RATIO, window_ns, groups, low_share=low, steady=steady
            )
            found += [f] if f is not None else []
    return max(found, key=lambda f: f.severity) if found else None


def p2p_cleared(
    transfers: Transfers, groups: list[GroupInfo], t0: int, t1: int, one_pipeline: bool
) -> frozenset[int]:
    """The ranks whose links the transfers of [t0, t1] show healthy: every connection of
    theirs (seen in ``transfers``) measured both ways and fast there and back (under
    MIN_SLOW_ROUND_TRIP_NS, and under MIN_STEADY_ROUND_TRIP_NS by the low quartiles: not
    every message slow; the job's ``one_pipeline`` of two stages: its one connection,
    judged against its own past, found healthy). A finding on other ranks holds: a window
    that lost the samples of a slow rank's links (they came late), or of the connections
    to compare them with, says nothing of them."""
    conns = _connections(transfers.within(t0, t1), frozenset())
    if one_pipeline and len(conns) == 1 and _whole_group(conns[0], groups):
        return frozenset((conns[0].a, conns[0].b))
    fast = {(c.a, c.b) for c in conns if _fast(c)}
    return frozenset(_covered(fast, _known_connections(transfers)))


def described_connections(transfers: Transfers, t0: int, t1: int) -> str:
    """The connections [t0, t1] measured, for a debug log: "1<->2 29.0 ms (41)" (there and
    back, paired transfers) each."""
    conns = _connections(transfers.within(t0, t1), frozenset())
    return (
        ", ".join(
            f"{c.a}<->{c.b} {c.round_trip_ns / 1e6:.1f} ms ({c.there.paired + c.back.paired})"
            for c in conns
        )
        or "none measured"
    )


def _fast(c: _Connection) -> bool:
    return (
        c.round_trip_ns < MIN_SLOW_ROUND_TRIP_NS and c.low_round_trip_ns < MIN_STEADY_ROUND_TRIP_NS
    )


def _known_connections(t: Transfers) -> set[tuple[int, int]]:
    """The connections (a < b) that ``t`` holds transfers of, both ways."""
    ways = set(zip(t.src.tolist(), t.dst.tolist(), strict=True))
    return {(a, b) for a, b in ways if a < b and (b, a) in ways}


def _covered(some: set[tuple[int, int]], known: set[tuple[int, int]]) -> set[int]:
    """The ranks of the connections ``some`` whose every ``known`` connection is in it."""
    return {r for k in some for r in k if all(c in some for c in known if r in c)}


def _hub(conns: list[_Connection], groups: list[GroupInfo]) -> int | None:
    """The middle stage of a three-stage pipeline whose two connections ``conns`` are:
    the one rank both have, in a group of three."""
    if len(conns) != 2 or len(groups[conns[0].group].ranks) != 3:
        return None
    common = {conns[0].a, conns[0].b} & {conns[1].a, conns[1].b}
    return common.pop() if len(common) == 1 else None


class _Steady(NamedTuple):
    """What a connection whose every message is slow (its low quartiles too) needs: this
    ratio, and this round trip."""

    ratio: float
    round_trip_ns: float


def _steady_floor(ranks: list[int], queued: frozenset[int]) -> float:
    """The round trip a connection of ``ranks`` whose every message is slow needs: a
    crowded host delays every message a little (an end in ``queued`` waited for a CPU),
    and there it needs MIN_SLOW_ROUND_TRIP_NS too."""
    return MIN_SLOW_ROUND_TRIP_NS if queued.intersection(ranks) else MIN_STEADY_ROUND_TRIP_NS


def _whole_group(c: _Connection, groups: list[GroupInfo]) -> bool:
    """Whether ``c`` is its group's only connection (a pipeline of two stages)."""
    return len(groups[c.group].ranks) == 2


def _connections(t: Transfers, exclude: frozenset[int]) -> list[_Connection]:
    """The connections ``t`` measured both ways, MIN_TRANSFERS times each way at least,
    leaving out those touching ``exclude``. (Grouped by one sort: a job of 256 ranks
    pairs tens of thousands of messages a window.)"""
    keep = np.ones(len(t.src), bool)
    if exclude:
        out = np.fromiter(exclude, np.int64)
        keep = ~(np.isin(t.src, out) | np.isin(t.dst, out))
    key = t.src[keep] << 32 | t.dst[keep]
    if not len(key):
        return []
    transfer, nbytes = t.transfer_ns[keep], t.bytes[keep]
    by_time = np.lexsort((transfer, key))  # each way's transfers, in order of their times
    by_size = np.lexsort((nbytes, key))
    ordered = key[by_time]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    counts = np.diff(np.r_[starts, len(ordered)])
    seqs, groups = t.seq[keep][by_time], t.group[keep][by_time]
    times, sizes = transfer[by_time].tolist(), nbytes[by_size].tolist()
    ways, group = {}, {}
    for k, s, n in zip(ordered[starts].tolist(), starts.tolist(), counts.tolist(), strict=True):
        if n < MIN_TRANSFERS:
            continue
        way = (k >> 32, k & 0xFFFFFFFF)
        span = seqs[s : s + n]
        ways[way] = _Way(
            _quantile(times, s, n, 0.5),
            _quantile(sizes, s, n, 0.5),
            n,
            max(n, int(span.max() - span.min()) + 1),
            _quantile(times, s, n, 0.25),
        )
        group[way] = int(np.bincount(groups[s : s + n]).argmax())
    return [
        _Connection(a, b, ways[(a, b)], ways[(b, a)], group[(a, b)])
        for a, b in sorted(ways)
        if a < b and (b, a) in ways
    ]


def _quantile(ordered: list[int], start: int, n: int, q: float) -> float:
    """The ``q`` quantile of ``ordered[start:start + n]`` (sorted), between its two
    nearest values as numpy's default does."""
    at = q * (n - 1)
    lo = int(at)
    a, b = ordered[start + lo], ordered[start + min(lo + 1, n - 1)]
    return float(a + (b - a) * (at - lo))


def _finding(
    ranks: list[int],
    link: list[int] | None,
    own: list[_Connection],
    ref_ns_per_byte: float,
    ratio: float,
    window_ns: int,
    groups: list[GroupInfo],
    reference: str = "the job's other connections",
    min_round_trip_ns: float = MIN_SLOW_ROUND_TRIP_NS,
    low_share: float = 0.0,
    steady: _Steady | None = None,
) -> LinkFinding | None:
    """A finding on ``ranks`` when every connection of ``own`` is slow against the
    reference by ``ratio`` (and by ``low_share`` of it in its low quartiles) and
    ``min_round_trip_ns`` there and back, or by ``steady``'s where its low quartiles
    reach that ratio too (nearly every message is slow), and their excess costs the
    window enough; None otherwise."""
    slowest = min(c.round_trip_ns / c.reference_ns(ref_ns_per_byte) for c in own)
    low = min(c.low_round_trip_ns / c.reference_ns(ref_ns_per_byte) for c in own)
    if steady is not None and low >= steady.ratio:
        ratio = min(ratio, steady.ratio)
        min_round_trip_ns = min(min_round_trip_ns, steady.round_trip_ns)
    if slowest < ratio or min(c.round_trip_ns for c in own) < min_round_trip_ns:
        return None
    if low_share and low < ratio * low_share:
        return None
    if sum(c.excess_ns(ref_ns_per_byte) for c in own) < MIN_WINDOW_SHARE * window_ns:
        return None
    evidence = [
        Evidence.of(
            "p2p_transfer",
            "messages between {a} and {b} took {ms:.1f} ms there and back ({kb:.0f} KB each "
            "way, {n} paired), {x:.1f}x {reference} per byte",
            a=c.a,
            b=c.b,
            ms=c.round_trip_ns / 1e6,
            there_ms=c.there.transfer_ns / 1e6,
            back_ms=c.back.transfer_ns / 1e6,
            kb=(c.there.bytes + c.back.bytes) / 2048,
            n=c.there.paired + c.back.paired,
            x=c.round_trip_ns / c.reference_ns(ref_ns_per_byte),
            reference=reference,
        )
        for c in own
    ]
    group = groups[own[0].group]
    return LinkFinding(ranks, link, group, round(slowest, 2), evidence)
