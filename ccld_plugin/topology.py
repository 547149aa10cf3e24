"""Topology: which process groups exist, what parallelism role each plays, who is in them.

Pure data, no torch: the diagnoser builds a :class:`Topology` from what the ranks publish,
and the tracer keeps one for its own rank. It answers the questions localization asks:
the groups a rank belongs to, the sibling groups of a role, the cohort of a rank (the
ranks that run the same model shard and so should have the same compute time), and the
pipeline stage of a rank.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "GROUP_ROLES",
    "GroupInfo",
    "Topology",
    "group_id_of",
    "role_index",
    "role_name",
    "trace_id",
]

# Order is part of the board format (the role index is written to the board).
GROUP_ROLES: tuple[str, ...] = (
    "other",
    "world",
    "tp",
    "pp",
    "dp",
    "ep",
    "etp",
    "cp",
    "dp_cp",
    "embd",
    "pos_embd",
    "mp",
)
_ROLE_INDEX = {name: i for i, name in enumerate(GROUP_ROLES)}
# A group that is registered twice keeps the more specific role.
_GENERIC_ROLES = frozenset({"other", "world", "mp"})

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def group_id_of(ranks: Iterable[int]) -> int:
    """Stable 64-bit id of a group: FNV-1a over its sorted global ranks (int32 LE)."""
    h = _FNV_OFFSET
    ordered = sorted(ranks)
    for byte in struct.pack(f"<{len(ordered)}i", *ordered):
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def role_index(role: str) -> int:
    if role not in _ROLE_INDEX:
        raise ValueError(f"unknown group role {role!r}; allowed: {', '.join(GROUP_ROLES)}")
    return _ROLE_INDEX[role]


def role_name(index: int) -> str:
    return GROUP_ROLES[index] if 0 <= index < len(GROUP_ROLES) else "other"


def trace_id(group_id: int, seq: int) -> str:
    """One collective of one group, as verdicts and timelines name it: "<group id hex>:<seq>"."""
    return f"{group_id:016x}:{seq}"


def more_specific(current: str, new: str) -> str:
    """The role to keep when the same ranks are registered under two roles."""
    if current in _GENERIC_ROLES and new not in _GENERIC_ROLES:
        return new
    if current == "other" and new != "other":
        return new
    return current


@dataclass(frozen=True, slots=True)
class GroupInfo:
    group_id: int
    role: str
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict:
        return {"role": self.role, "ranks": list(self.ranks), "group_id": f"{self.group_id:016x}"}


@dataclass
class Topology:
    """Groups by id, with the per-rank index the diagnoser needs."""

    groups: dict[int, GroupInfo] = field(default_factory=dict)
    _by_rank: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def add(self, info: GroupInfo) -> GroupInfo:
        known = self.groups.get(info.group_id)
        if known is not None:
            role = more_specific(known.role, info.role)
            if role == known.role:
                return known
            info = GroupInfo(info.group_id, role, known.ranks)
        else:
            for r in info.ranks:
                self._by_rank.setdefault(r, []).append(info.group_id)
        self.groups[info.group_id] = info
        return info

    def get(self, group_id: int) -> GroupInfo | None:
        return self.groups.get(group_id)

    def ranks(self) -> list[int]:
        return sorted(self._by_rank)

    def groups_of(self, rank: int) -> list[GroupInfo]:
        return [self.groups[g] for g in self._by_rank.get(rank, ())]

    def group_of(self, rank: int, role: str) -> GroupInfo | None:
        """The group of ``role`` that ``rank`` is in (the largest, if several)."""
        found = [g for g in self.groups_of(rank) if g.role == role]
        return max(found, key=lambda g: g.size) if found else None

    def siblings(self, role: str) -> list[GroupInfo]:
        """All groups of one role (all TP groups, all DP groups, ...)."""
        return [g for g in self.groups.values() if g.role == role]

    def cohort(self, rank: int) -> list[int]:
        """Ranks that run the same model shard as ``rank``: its data-parallel peers.

        Without a registered DP group, ranks that hold the same position in their TP and
        PP groups are peers; with no parallelism groups at all, every rank is a peer.
        """
        dp = self._data_parallel(rank)
        if dp is not None:
            return list(dp.ranks)
        key = self._shard_key(rank)
        if key is None:
            return self.ranks()
        return [r for r in self.ranks() if self._shard_key(r) == key]

    def placed(self, rank: int) -> bool:
        """Whether a group tells where ``rank`` is in the model (a DP group, or a place in
        a TP, PP, CP or EP group); if none does, ``cohort`` takes every rank for its peer."""
        return self._data_parallel(rank) is not None or self._shard_key(rank) is not None

    def _data_parallel(self, rank: int) -> GroupInfo | None:
        """``rank``'s DP group of more than one rank (else its DP x CP one), if it has one."""
        for role in ("dp", "dp_cp"):
            g = self.group_of(rank, role)
            if g is not None and g.size > 1:
                return g
        return None

    def cohorts(self) -> dict[int, list[int]]:
        """``cohort`` of every rank. The ranks of one DP group share one list (a DP group's
        ranks in a list of each member's own would be 1 GB at 65,536 ranks), and so do
        ranks whose cohorts are equal otherwise."""
        of_group: dict[int, list[int]] = {}  # by id(group): hashing its ranks costs them all
        out: dict[int, list[int]] = {}
        for role in ("dp", "dp_cp"):
            for r, g in self._largest_of_role(role).items():
                if r not in out and g.size > 1:
                    shared = of_group.get(id(g))
                    if shared is None:
                        shared = of_group[id(g)] = list(g.ranks)
                    out[r] = shared
        lists: dict[tuple[int, ...], list[int]] = {}
        for r in self.ranks():
            if r not in out:
                cohort = self.cohort(r)
                out[r] = lists.setdefault(tuple(cohort), cohort)
        return out

    def _largest_of_role(self, role: str) -> dict[int, GroupInfo]:
        """Per rank: ``group_of(rank, role)`` (the first of the largest, in its order)."""
        chosen: dict[int, GroupInfo] = {}
        for g in self.groups.values():  # each rank's groups come in this order
            if g.role != role:
                continue
            if chosen.keys().isdisjoint(g.ranks):
                chosen.update(dict.fromkeys(g.ranks, g))
                continue
            for r in g.ranks:
                known = chosen.get(r)
                if known is None or g.size > known.size:
                    chosen[r] = g
        return chosen

    def _shard_key(self, rank: int) -> tuple[int, ...] | None:
        key = []
        for role in ("tp", "pp", "cp", "ep"):
            g = self.group_of(rank, role)
            if g is not None and g.size > 1:
                key.append(g.ranks.index(rank))
        return tuple(key) if key else None

    def stage_of(self, rank: int) -> int | None:
        """Pipeline stage of ``rank`` (its index in its PP group), or None without PP."""
        g = self.group_of(rank, "pp")
        return g.ranks.index(rank) if g is not None else None

    @classmethod
    def from_groups(cls, groups: Sequence[GroupInfo]) -> Topology:
        topo = cls()
        for g in groups:
            topo.add(g)
        return topo
