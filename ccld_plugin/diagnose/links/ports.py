"""A slow port or a slow connection: a rank's other connections, judged against the same
direction of their siblings (``Ports``), tell the two ends of one slow connection apart.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from ccld_plugin.diagnose.links.link_roles import LinkRoles, SiblingMedians
from ccld_plugin.diagnose.links.link_stats import LinkHistory, LinkStats, LinkTable
from ccld_plugin.diagnose.view import JobView

__all__ = ["PORT_RATIO", "Ports", "Shown"]

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
# A slow directed link as shown: its stats, its reference's (RTT, time per MB), and which
# reference that is ("siblings", "history", or "same direction" for a port's other links).
Shown = tuple[LinkStats, float, float, str]


def _around(place: tuple) -> tuple:
    """A link's place by how far around its group it goes: (role, size, steps forward)."""
    role, size, src, dst = place
    return (role, size, (dst - src) % size)


class Ports:
    """A rank's other connections, judged against the same direction of their siblings:
    is the rank's port slow (see PORT_RATIO)? Built only in a window with slow links."""

    def __init__(
        self, view: JobView, table: LinkTable, roles: LinkRoles, history: LinkHistory, rtt: bool
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
        self.siblings = {role: SiblingMedians(ls) for role, ls in by_role.items()}
        self.touching: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for k in links:
            self.touching[k[0]].append(k)
            self.touching[k[1]].append(k)
        self._positions: dict[int, dict[int, int]] = {}
        self._by_place: dict[tuple, SiblingMedians] | None = None

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
            self._by_place = {pl: SiblingMedians(ls) for pl, ls in places.items()}
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

    def slow_links(self, rank: int, besides: list[int] | None = None) -> list[Shown]:
        """The links of ``rank``'s connections (other than to ``besides``' ranks) that
        are slow by PORT_RATIO and PORT_MIN_EXCESS, when more than half of its connections
        measured are; empty otherwise."""
        skip = set(besides or ()) - {rank}
        per_peer: dict[int, list[Shown]] = defaultdict(list)
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

    def slow(self, directions: list[Shown], ratio: float = PORT_RATIO) -> bool:
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
