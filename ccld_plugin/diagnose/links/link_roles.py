"""Which group each directed link belongs to (``LinkRoles``), and the medians of a role's
links that leave out those sharing a rank with the one judged (``SiblingMedians``): the
references the slow-link rules compare a link with.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np

from ccld_plugin.diagnose.links.link_stats import LinkStats, LinkTable
from ccld_plugin.diagnose.robust import RankedValues
from ccld_plugin.diagnose.view import JobView
from ccld_plugin.topology import GroupInfo, Topology

__all__ = ["LinkRoles", "SiblingMedians"]


class SiblingMedians:
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


class LinkRoles:
    """The group of many links at once: of the groups that hold both ends, the smallest
    (the world group only where no other does). Every rank's groups (in the topology's
    order) as one array, kept while the view's topology stays the same object (the
    diagnoser builds a new one when a group table changes)."""

    def __init__(self) -> None:
        self.topology: object = None
        self.groups: list[GroupInfo] = []
        self.member = np.full((0, 0), -1, np.int64)  # rank x its groups: index into groups
        self.rank_of_group = np.zeros(0, np.int64)  # the order the group is picked by
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
        # the key groups are picked by, (role == "world", size), as one number
        self.rank_of_group = np.array(
            [(g.role == "world") * (1 << 40) + g.size for g in self.groups], np.int64
        )
        roles: dict[str, int] = {}
        self.role_id = np.array([roles.setdefault(g.role, len(roles)) for g in self.groups])
        self.role_id = self.role_id.astype(np.int64)
