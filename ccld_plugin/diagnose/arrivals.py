"""Arrival samples of all ranks, joined per collective.

Each rank samples a few collectives per group per tick (the same seqs on every member:
``agent._samples``): when it entered, how long it took, how many bytes. A sampled
collective whose members have all reported is *joined*: who arrived last, how long each
member waited for it, and the transfer time from the last arrival to the first exit.

At thousands of ranks a round brings hundreds of thousands of samples, so they are never
made into objects: the encoded rows of every new summary are read into one numpy array,
placed on the diagnoser's clock and in their groups, and joined with one sort, together
with the samples still waiting for a member from earlier rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ccld_plugin.diagnose.view import JobView
from ccld_plugin.wire.summary import SAMPLE_DTYPE, RankSummary, encoded_samples
from ccld_plugin.wire.topology import GroupInfo

__all__ = ["ArrivalJoin", "Joined"]

PENDING_TTL_NS = 60_000_000_000  # a sample whose group never completes is dropped after this

# One sample, placed: its group (index into ArrivalJoin.groups), seq, the member, its
# times on the diagnoser's clock, and when the diagnoser first saw it.
_ROW = np.dtype(
    [
        ("group", "<i8"),
        ("seq", "<i8"),
        ("rank", "<i8"),
        ("enter_ns", "<i8"),
        ("exit_ns", "<i8"),
        ("bytes", "<i8"),
        ("seen_ns", "<i8"),
    ]
)


@dataclass(slots=True)
class Joined:
    """One sampled collective seen by all its members."""

    group: GroupInfo
    seq: int
    time_ns: int  # the last arrival
    last: int  # the last arriver
    transfer_ns: int
    bytes: int
    members: np.ndarray = field(repr=False)  # ranks
    enters_ns: np.ndarray = field(repr=False)  # per member, in the order of members

    @property
    def waits_ns(self) -> dict[int, int]:
        """Per member: how long it waited for the last arriver (built when asked: only
        verdicts and metrics read it)."""
        return dict(
            zip(self.members.tolist(), (self.time_ns - self.enters_ns).tolist(), strict=True)
        )


class ArrivalJoin:
    """The samples waiting for members, and the groups they belong to."""

    def __init__(self) -> None:
        self.groups: list[GroupInfo] = []
        self._index: dict[int, int] = {}  # group id -> index into groups
        self._sizes = np.zeros(0, np.int64)
        self._pending = np.zeros(0, _ROW)
        self._tables: dict[int, tuple[tuple[object, object], list[int]]] = {}

    def _group_index(self, g: GroupInfo) -> int:
        i = self._index.get(g.group_id)
        if i is None:
            i = self._index[g.group_id] = len(self.groups)
            self.groups.append(g)
        elif self.groups[i] is not g:
            self.groups[i] = g  # the same ranks with a more specific role
        return i

    def _slot_groups(self, view: JobView, rank: int) -> list[int]:
        """The rank's group table as indices into ``groups``; kept while neither the table
        nor the topology that resolves its roles changes (both stay the same objects,
        round after round, until some rank republishes its table)."""
        source = (view.tables.get(rank), view.topology)
        known = self._tables.get(rank)
        if known is None or known[0][0] is not source[0] or known[0][1] is not source[1]:
            known = self._tables[rank] = (
                source,
                [self._group_index(g) for g in view.groups_at(rank)],
            )
        return known[1]

    def add(self, view: JobView, fresh: list[RankSummary]) -> list[Joined]:
        """Take in the samples of ``fresh`` (summaries not seen before); the collectives
        that are now joined, oldest first."""
        rows = self._place(view, fresh)
        if len(rows) == 0 and len(self._pending) == 0:
            return []
        if len(self._sizes) < len(self.groups):
            self._sizes = np.array([g.size for g in self.groups], np.int64)
        rows = np.concatenate([self._pending, rows]) if len(self._pending) else rows
        # By collective (group, seq), then member; a member's duplicate keeps its first.
        rows = rows[np.lexsort((rows["enter_ns"], rows["rank"], rows["seq"], rows["group"]))]
        if len(rows) > 1:
            same = (
                (rows["group"][1:] == rows["group"][:-1])
                & (rows["seq"][1:] == rows["seq"][:-1])
                & (rows["rank"][1:] == rows["rank"][:-1])
            )
            rows = rows[np.concatenate([[True], ~same])]
        new = np.ones(len(rows), bool)
        new[1:] = (rows["group"][1:] != rows["group"][:-1]) | (rows["seq"][1:] != rows["seq"][:-1])
        starts = np.flatnonzero(new)
        counts = np.diff(np.append(starts, len(rows)))
        complete = counts >= self._sizes[rows["group"][starts]]
        first_seen = np.minimum.reduceat(rows["seen_ns"], starts)
        keep = ~complete & (view.now_ns - first_seen < PENDING_TTL_NS)
        self._pending = rows[np.repeat(keep, counts)]
        return self._join(rows, complete, counts)

    def _place(self, view: JobView, fresh: list[RankSummary]) -> np.ndarray:
        """The fresh summaries' samples as placed rows (those of unknown groups dropped)."""
        raws, owners, slot_group, slot_seq = [], [], [], []
        base = 0
        for s in fresh:
            raw = encoded_samples(s)
            if not raw:
                continue
            groups = self._slot_groups(view, s.rank)
            completed = {gp.slot: gp.completed_seq for gp in s.groups}
            raws.append(raw)
            owners.append((s.rank, s.time_ns, len(raw) // SAMPLE_DTYPE.itemsize, len(groups), base))
            slot_group += groups
            slot_seq += [completed.get(i, 0) for i in range(len(groups))]
            base += len(groups)
        if not raws:
            return np.zeros(0, _ROW)
        samples = np.frombuffer(b"".join(raws), SAMPLE_DTYPE)
        rank, time_ns, n, n_slots, first_slot = (
            np.array(c, np.int64) for c in zip(*owners, strict=True)
        )
        owner = np.repeat(np.arange(len(owners)), n)
        slot = samples["slot"].astype(np.int64)
        known = slot < n_slots[owner]
        samples, owner, slot = samples[known], owner[known], slot[known]
        at = first_slot[owner] + slot
        rows = np.zeros(len(samples), _ROW)
        rows["group"] = np.array(slot_group, np.int64)[at]
        rows["seq"] = np.array(slot_seq, np.int64)[at] - samples["back"]
        rows["rank"] = rank[owner]
        rows["enter_ns"] = time_ns[owner] + samples["rel_us"].astype(np.int64) * 1000
        rows["exit_ns"] = rows["enter_ns"] + samples["dur_us"].astype(np.int64) * 1000
        rows["bytes"] = samples["bytes"]
        rows["seen_ns"] = view.now_ns
        return rows

    def _join(self, rows: np.ndarray, complete: np.ndarray, counts: np.ndarray) -> list[Joined]:
        """The complete collectives (``complete`` per segment of ``rows``), oldest first."""
        if not complete.any():
            return []
        rows = rows[np.repeat(complete, counts)]
        counts = counts[complete]
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        enters = rows["enter_ns"]
        t_last = np.maximum.reduceat(enters, starts)
        at_last = np.flatnonzero(enters == np.repeat(t_last, counts))
        segment = np.repeat(np.arange(len(starts)), counts)[at_last]
        last = rows["rank"][at_last[np.unique(segment, return_index=True)[1]]]
        transfer = np.maximum(0, np.minimum.reduceat(rows["exit_ns"], starts) - t_last)
        nbytes = np.maximum.reduceat(rows["bytes"], starts)
        ranks = rows["rank"]
        out = [
            Joined(self.groups[g], q, t, r, x, b, ranks[i : i + n], enters[i : i + n])
            for g, q, t, r, x, b, i, n in zip(
                rows["group"][starts].tolist(),
                rows["seq"][starts].tolist(),
                t_last.tolist(),
                last.tolist(),
                transfer.tolist(),
                nbytes.tolist(),
                starts.tolist(),
                counts.tolist(),
                strict=True,
            )
        ]
        out.sort(key=lambda j: j.time_ns)
        return out
