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

from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import numpy as np

from ccld_plugin.diagnose.view import GroupIndex, JobView
from ccld_plugin.wire.summary import RankSummary
from ccld_plugin.wire.summary_batch import SummaryTable, table_of
from ccld_plugin.wire.topology import GroupInfo

__all__ = ["ArrivalJoin", "Joined"]

PENDING_TTL_NS = 60_000_000_000  # a sample whose group never completes is dropped after this

# One sample, placed: its group (index into ArrivalJoin.groups), seq, the member, its
# times on the diagnoser's clock, and when the diagnoser first saw it; a column each (rows
# are reordered a few times per round: gathering only the columns needed is cheaper).
_COLUMNS = ("group", "seq", "rank", "enter_ns", "exit_ns", "bytes", "seen_ns")
Rows = dict[str, np.ndarray]


def _no_rows() -> Rows:
    return {c: np.zeros(0, np.int64) for c in _COLUMNS}


class Joined(NamedTuple):
    """One sampled collective seen by all its members (a named tuple: tens of thousands
    are made per round at scale, and a tuple is the cheapest object to make)."""

    group: GroupInfo
    seq: int
    time_ns: int  # the last arrival
    last: int  # the last arriver
    transfer_ns: int
    bytes: int
    members: np.ndarray  # ranks
    enters_ns: np.ndarray  # per member, in the order of members

    @property
    def waits_ns(self) -> dict[int, int]:
        """Per member: how long it waited for the last arriver (built when asked: only
        verdicts and metrics read it)."""
        return dict(
            zip(self.members.tolist(), (self.time_ns - self.enters_ns).tolist(), strict=True)
        )


_new_joined = partial(tuple.__new__, Joined)  # Joined._make without its Python frame


class ArrivalJoin:
    """The samples waiting for members, and the groups they belong to."""

    def __init__(self) -> None:
        self.index = GroupIndex()
        self._sizes = np.zeros(0, np.int64)
        self._pending = _no_rows()

    @property
    def groups(self) -> list[GroupInfo]:
        return self.index.groups

    def add(self, view: JobView, fresh: Sequence[RankSummary]) -> list[Joined]:
        """Take in the samples of ``fresh`` (summaries not seen before; their columns when
        they come as ``Summaries``); the collectives that are now joined, oldest first."""
        rows = self._place(view, table_of(fresh))
        if len(self._pending["group"]):
            rows = {c: np.concatenate([self._pending[c], rows[c]]) for c in _COLUMNS}
        if not len(rows["group"]):
            return []
        if len(self._sizes) < len(self.groups):
            self._sizes = np.array([g.size for g in self.groups], np.int64)
        # By collective (group, seq), then member; a member's duplicate keeps its first.
        order = _collective_order(rows)
        group, seq, rank = (rows[c][order] for c in ("group", "seq", "rank"))
        same = (group[1:] == group[:-1]) & (seq[1:] == seq[:-1]) & (rank[1:] == rank[:-1])
        if same.any():
            first = np.concatenate([[True], ~same])
            order, group, seq = order[first], group[first], seq[first]
        new = np.ones(len(order), bool)
        new[1:] = (group[1:] != group[:-1]) | (seq[1:] != seq[:-1])
        starts = np.flatnonzero(new)
        counts = np.diff(np.append(starts, len(order)))
        complete = counts >= self._sizes[group[starts]]
        first_seen = np.minimum.reduceat(rows["seen_ns"][order], starts)
        keep = ~complete & (view.now_ns - first_seen < PENDING_TTL_NS)
        waiting = order[np.repeat(keep, counts)]
        self._pending = {c: rows[c][waiting] for c in _COLUMNS}
        if not complete.any():
            return []
        done = order[np.repeat(complete, counts)]
        return self._join(
            rows, done, group[starts][complete], seq[starts][complete], counts[complete]
        )

    def _place(self, view: JobView, table: SummaryTable) -> Rows:
        """The samples of ``table`` as placed rows (those of unknown groups dropped)."""
        samples, owner = table.samples, table.sample_rows
        if len(samples) == 0:
            return _no_rows()
        rank = table.ranks[owner]
        slot = samples["slot"].astype(np.int64)
        group = self.index.lookup(view, rank, slot)
        known = group >= 0
        if not known.all():
            samples, owner, rank, group, slot = (
                x[known] for x in (samples, owner, rank, group, slot)
            )
        # a sample's seq counts back from its group's completed seq in the same summary
        # (0 where the summary reports no such group)
        g = table.groups
        width = int(max(g["slot"].max(initial=0), slot.max(initial=0))) + 1
        completed = np.zeros(len(table) * width, np.int64)
        completed[g["row"] * width + g["slot"]] = g["completed_seq"]
        enter = table.heads["time_ns"][owner] + samples["rel_us"].astype(np.int64) * 1000
        return {
            "group": group,
            "seq": completed[owner * width + slot] - samples["back"],
            "rank": rank,
            "enter_ns": enter,
            "exit_ns": enter + samples["dur_us"].astype(np.int64) * 1000,
            "bytes": samples["bytes"].astype(np.int64),
            "seen_ns": np.full(len(rank), view.now_ns, np.int64),
        }

    def _join(
        self, rows: Rows, done: np.ndarray, group: np.ndarray, seq: np.ndarray, counts: np.ndarray
    ) -> list[Joined]:
        """The complete collectives: ``done`` indexes ``rows`` by collective (``group``,
        ``seq``), then member, ``counts`` members each. Oldest first."""
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        enters = rows["enter_ns"][done]
        ranks = rows["rank"][done]
        t_last = np.maximum.reduceat(enters, starts)
        at_last = np.flatnonzero(enters == np.repeat(t_last, counts))
        segment = np.repeat(np.arange(len(starts)), counts)[at_last]
        last = ranks[at_last[np.unique(segment, return_index=True)[1]]]
        transfer = np.maximum(0, np.minimum.reduceat(rows["exit_ns"][done], starts) - t_last)
        nbytes = np.maximum.reduceat(rows["bytes"][done], starts)
        by_time = np.argsort(t_last, kind="stable")
        groups = self.groups
        q, t, r, x, b, i, n = (
            a[by_time].tolist() for a in (seq, t_last, last, transfer, nbytes, starts, counts)
        )
        ends = [a + k for a, k in zip(i, n, strict=True)]
        members = list(map(ranks.__getitem__, map(slice, i, ends)))
        arrivals = list(map(enters.__getitem__, map(slice, i, ends)))
        return list(
            map(
                _new_joined,
                zip(
                    [groups[g] for g in group[by_time].tolist()],
                    q,
                    t,
                    r,
                    x,
                    b,
                    members,
                    arrivals,
                    strict=True,
                ),
            )
        )


def _collective_order(rows: Rows) -> np.ndarray:
    """The order of ``rows`` by (group, seq, rank, enter_ns). One sort of a packed key
    where the span of the values allows it (it does in steady state; four keys sorted
    together cost several times more at hundreds of thousands of rows)."""
    parts = [rows["group"], rows["seq"], rows["rank"]]
    lows = [int(p.min()) for p in parts]
    spans = [int(p.max()) - lo + 1 for p, lo in zip(parts, lows, strict=True)]
    if spans[0] * spans[1] * spans[2] >= 2**62:
        return np.lexsort((rows["enter_ns"], rows["rank"], rows["seq"], rows["group"]))
    key = (parts[0] - lows[0]) * (spans[1] * spans[2])
    key += (parts[1] - lows[1]) * spans[2]
    key += parts[2] - lows[2]
    order = np.argsort(key, kind="stable")
    ordered = key[order]
    if (ordered[1:] == ordered[:-1]).any():  # a member's duplicates: the earliest first
        return np.lexsort((rows["enter_ns"], key))
    return order
