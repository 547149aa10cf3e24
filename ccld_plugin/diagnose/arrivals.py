"""Arrival samples of all ranks, joined per collective.

Each rank samples a few collectives per group per tick (the same seqs on every member:
``agent._samples``): when it entered, how long it took, how many bytes. A sampled
collective whose members have all reported is *joined*: who arrived last, how long each
member waited for it, and the transfer time from the last arrival to the first exit.

At thousands of ranks a round brings hundreds of thousands of samples and joins tens of
thousands of collectives, so neither is made into objects: the encoded rows of every new
summary are read into one numpy array, placed on the diagnoser's clock and in their
groups, and joined with one sort, together with the samples still waiting for a member
from earlier rounds; the joined collectives are columns too (``JoinedTable``), which the
slow detector's windows read as they are.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from ccld_plugin.diagnose.view import GroupIndex, JobView
from ccld_plugin.topology import GroupInfo
from ccld_plugin.wire.summary import RankSummary
from ccld_plugin.wire.summary_batch import SummaryTable, table_of

__all__ = ["MIN_ARRIVAL_SAMPLES", "ArrivalJoin", "Joined", "JoinedTable", "RankJoined"]

# What is judged from joined collectives (a rank's arrival order, a group's bandwidth)
# needs at least this many of them.
MIN_ARRIVAL_SAMPLES = 4

PENDING_TTL_NS = 60_000_000_000  # a sample whose group never completes is dropped after this

# One sample, placed: its group (index into ArrivalJoin.groups), seq, the member, its
# times on the diagnoser's clock, and when the diagnoser first saw it; a column each (rows
# are reordered a few times per round: gathering only the columns needed is cheaper).
_COLUMNS = ("group", "seq", "rank", "enter_ns", "exit_ns", "bytes", "seen_ns")
Rows = dict[str, np.ndarray]


def _no_rows() -> Rows:
    return {c: np.zeros(0, np.int64) for c in _COLUMNS}


class Joined(NamedTuple):
    """One sampled collective seen by all its members: a row of a ``JoinedTable`` as an
    object, for the few readers that want one (the W&B panels, tests)."""

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


class JoinedTable:
    """Joined collectives as columns, in the order they were joined (each round's by the
    time of their last arrival). Per collective: its group (an index into ``groups``) and
    that group's size, seq, the last arrival's time, the last arriver, the transfer time,
    bytes, and where its members' rows are (``first``, ``count``); per member row: the
    rank and when it entered. Immutable: slices share the columns."""

    def __init__(
        self,
        groups: list[GroupInfo],
        group: np.ndarray,
        size: np.ndarray,
        seq: np.ndarray,
        time_ns: np.ndarray,
        last: np.ndarray,
        transfer_ns: np.ndarray,
        nbytes: np.ndarray,
        first: np.ndarray,
        count: np.ndarray,
        ranks: np.ndarray,
        enters_ns: np.ndarray,
    ) -> None:
        # The arrival join's list of groups (shared, it only grows; a group's object is
        # replaced when a rank names its role more precisely).
        self.groups = groups
        self.group, self.size, self.seq, self.time_ns = group, size, seq, time_ns
        self.last, self.transfer_ns, self.bytes = last, transfer_ns, nbytes
        self.first, self.count = first, count
        self.ranks, self.enters_ns = ranks, enters_ns

    @classmethod
    def empty(cls, groups: list[GroupInfo]) -> JoinedTable:
        none = np.zeros(0, np.int64)
        return cls(groups, *([none] * 11))

    @classmethod
    def of(cls, joined: Sequence[Joined]) -> JoinedTable:
        """The table of joined objects (a test's)."""
        groups = list({j.group.group_id: j.group for j in joined}.values())
        index = {g.group_id: i for i, g in enumerate(groups)}
        count = np.array([len(j.members) for j in joined], np.int64)

        def col(values: list[int]) -> np.ndarray:
            return np.array(values, np.int64)

        return cls(
            groups,
            col([index[j.group.group_id] for j in joined]),
            col([j.group.size for j in joined]),
            col([j.seq for j in joined]),
            col([j.time_ns for j in joined]),
            col([j.last for j in joined]),
            col([j.transfer_ns for j in joined]),
            col([j.bytes for j in joined]),
            np.cumsum(count) - count,
            count,
            np.concatenate([col([]), *(np.asarray(j.members, np.int64) for j in joined)]),
            np.concatenate([col([]), *(np.asarray(j.enters_ns, np.int64) for j in joined)]),
        )

    def __len__(self) -> int:
        return len(self.group)

    def __iter__(self) -> Iterator[Joined]:
        groups = self.groups
        cols = (self.group, self.seq, self.time_ns, self.last, self.transfer_ns, self.bytes)
        ends = self.first + self.count
        for g, q, t, r, x, b, a, e in zip(
            *(c.tolist() for c in cols), self.first.tolist(), ends.tolist(), strict=True
        ):
            yield Joined(groups[g], q, t, r, x, b, self.ranks[a:e], self.enters_ns[a:e])

    def sizes_of(self, group_id: int) -> dict[int, int]:
        """The sizes of the collectives of group ``group_id`` kept here: seq -> bytes."""
        mine = np.isin(self.group, [i for i, g in enumerate(self.groups) if g.group_id == group_id])
        return dict(zip(self.seq[mine].tolist(), self.bytes[mine].tolist(), strict=True))

    def since(self, i: int) -> JoinedTable:
        """The collectives from position ``i`` on."""
        if i <= 0:
            return self
        i = min(i, len(self))
        m = int(self.first[i]) if i < len(self) else len(self.ranks)
        return JoinedTable(
            self.groups,
            **{k: c[i:] for k, c in self._collective_columns().items()},
            first=self.first[i:] - m,
            count=self.count[i:],
            ranks=self.ranks[m:],
            enters_ns=self.enters_ns[m:],
        )

    def since_time(self, t_ns: int) -> JoinedTable:
        """Without its first collectives that are older than ``t_ns`` (up to the first
        that is not: the order is that of joining, not of time)."""
        old = self.time_ns < t_ns
        return self.since(len(old) if old.all() else int(np.argmin(old)))

    @staticmethod
    def concat(tables: Sequence[JoinedTable]) -> JoinedTable:
        """``tables`` one after another (their groups are the same list, or made one)."""
        groups = tables[-1].groups
        if any(t.groups is not groups for t in tables):
            index = {g.group_id: i for i, g in enumerate(groups)}
            for t in tables:
                for g in t.groups:
                    index.setdefault(g.group_id, len(index))
            merged = {g.group_id: g for t in tables for g in t.groups}
            groups = [merged[gid] for gid in index]
            tables = [
                JoinedTable(
                    groups,
                    **{
                        **t._collective_columns(),
                        "group": np.array([index[g.group_id] for g in t.groups], np.int64)[t.group],
                    },
                    first=t.first,
                    count=t.count,
                    ranks=t.ranks,
                    enters_ns=t.enters_ns,
                )
                for t in tables
            ]
        offsets = np.cumsum([0] + [len(t.ranks) for t in tables[:-1]])
        columns = [t._collective_columns() for t in tables]
        return JoinedTable(
            groups,
            **{k: np.concatenate([c[k] for c in columns]) for k in columns[0]},
            first=np.concatenate([t.first + o for t, o in zip(tables, offsets, strict=True)]),
            count=np.concatenate([t.count for t in tables]),
            ranks=np.concatenate([t.ranks for t in tables]),
            enters_ns=np.concatenate([t.enters_ns for t in tables]),
        )

    def of_rank(self, rank: int, keep: np.ndarray) -> RankJoined:
        """The collectives where ``keep`` (a bool per collective) that ``rank`` is a member
        of, in order, with its own wait in each and the sum of all members' waits."""
        rows = np.flatnonzero(self.ranks == rank)
        at = np.searchsorted(self.first, rows, side="right") - 1
        mine = keep[at]
        rows, at = rows[mine], at[mine]
        # every member's wait in those collectives, summed per collective
        n = self.count[at]
        starts = np.cumsum(n) - n
        member = np.repeat(self.first[at] - starts, n) + np.arange(int(n.sum()))
        waits = np.repeat(self.time_ns[at], n) - self.enters_ns[member]
        summed = np.add.reduceat(waits, starts) if len(at) else waits
        return RankJoined(
            rank,
            self.groups,
            self.group[at],
            self.seq[at],
            self.time_ns[at],
            self.last[at],
            self.count[at],
            self.time_ns[at] - self.enters_ns[rows],
            summed,
        )

    def _collective_columns(self) -> dict[str, np.ndarray]:
        """The per-collective columns, by the constructor's names."""
        return {
            "group": self.group,
            "size": self.size,
            "seq": self.seq,
            "time_ns": self.time_ns,
            "last": self.last,
            "transfer_ns": self.transfer_ns,
            "nbytes": self.bytes,
        }


class RankJoined:
    """One rank's joined collectives (those of a window), per collective: its group (an
    index into ``groups``), seq and time of the last arrival, the last arriver, the member
    count, the rank's own wait for the last arriver, and the members' waits summed (the
    rank's included)."""

    def __init__(
        self,
        rank: int,
        groups: list[GroupInfo],
        group: np.ndarray,
        seq: np.ndarray,
        time_ns: np.ndarray,
        last: np.ndarray,
        count: np.ndarray,
        own_wait_ns: np.ndarray,
        waits_ns: np.ndarray,
    ) -> None:
        self.rank, self.groups = rank, groups
        self.group, self.seq, self.time_ns = group, seq, time_ns
        self.last, self.count = last, count
        self.own_wait_ns, self.waits_ns = own_wait_ns, waits_ns

    def ops_per_step(self, step_ns: float) -> float:
        """About how many collectives the rank runs a step (steps of ``step_ns``): in each
        of its groups, the seqs its samples span, over the time they span."""
        span_ns = int(self.time_ns.max() - self.time_ns.min()) if len(self) else 0
        if span_ns <= 0 or step_ns <= 0:
            return 1.0
        ops = sum(
            int(seqs.max() - seqs.min())
            for seqs in (self.seq[self.group == g] for g in np.unique(self.group))
        )
        return max(1.0, ops * step_ns / span_ns)

    def __len__(self) -> int:
        return len(self.group)


class ArrivalJoin:
    """The samples waiting for members, and the groups they belong to."""

    def __init__(self, index: GroupIndex | None = None) -> None:
        self.index = index or GroupIndex()
        self._sizes = np.zeros(0, np.int64)
        self._pending = _no_rows()
        # per rank and group slot, the highest seq sampled so far (-1: none)
        self._taken = np.full((0, 0), -1, np.int64)

    @property
    def groups(self) -> list[GroupInfo]:
        return self.index.groups

    def add(self, view: JobView, fresh: Sequence[RankSummary]) -> JoinedTable:
        """Take in the samples of ``fresh`` (summaries not seen before; their columns when
        they come as ``Summaries``); the collectives that are now joined, oldest first."""
        rows = self._place(view, table_of(fresh))
        waited = len(self._pending["group"]) > 0
        if waited:
            rows = {c: np.concatenate([self._pending[c], rows[c]]) for c in _COLUMNS}
        if not len(rows["group"]):
            return JoinedTable.empty(self.groups)
        if len(self._sizes) < len(self.groups):
            self._sizes = np.array([g.size for g in self.groups], np.int64)
        # By collective (group, seq), then member; a member's duplicate keeps its first.
        order, repeat, new = _collective_order(rows)
        if repeat.any():
            first = np.concatenate([[True], ~repeat])
            order, new = order[first], new[first]
        starts = np.flatnonzero(new)
        counts = np.diff(np.append(starts, len(order)))
        group, seq = rows["group"][order[starts]], rows["seq"][order[starts]]
        complete = counts >= self._sizes[group]
        # (all of this round's samples were first seen now)
        first_seen = np.minimum.reduceat(rows["seen_ns"][order], starts) if waited else view.now_ns
        keep = ~complete & (view.now_ns - first_seen < PENDING_TTL_NS)
        waiting = order[np.repeat(keep, counts)]
        self._pending = {c: rows[c][waiting] for c in _COLUMNS}
        if not complete.any():
            return JoinedTable.empty(self.groups)
        done = order[np.repeat(complete, counts)]
        return self._join(rows, done, group[complete], seq[complete], counts[complete])

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
        seq = completed[owner * width + slot] - samples["back"]
        new = self._unseen(rank, slot, seq)
        if not new.all():
            samples, owner, rank, group, slot, seq = (
                x[new] for x in (samples, owner, rank, group, slot, seq)
            )
        enter = table.heads["time_ns"][owner] + samples["rel_us"].astype(np.int64) * 1000
        return {
            "group": group,
            "seq": seq,
            "rank": rank,
            "enter_ns": enter,
            "exit_ns": enter + samples["dur_us"].astype(np.int64) * 1000,
            "bytes": samples["bytes"].astype(np.int64),
            "seen_ns": np.full(len(rank), view.now_ns, np.int64),
        }

    def _unseen(self, rank: np.ndarray, slot: np.ndarray, seq: np.ndarray) -> np.ndarray:
        """Which samples were not taken before: a summary repeats its previous tick's (in
        case a round missed it), and a rank's seqs in a group only grow."""
        if not len(rank):
            return np.ones(0, bool)
        have_ranks, have_slots = self._taken.shape
        ranks, slots = max(have_ranks, int(rank.max()) + 1), max(have_slots, int(slot.max()) + 1)
        if (ranks, slots) != (have_ranks, have_slots):
            grown = np.full((ranks, slots), -1, np.int64)
            grown[:have_ranks, :have_slots] = self._taken
            self._taken = grown
        new = seq > self._taken[rank, slot]
        np.maximum.at(self._taken, (rank[new], slot[new]), seq[new])
        return new

    def _join(
        self, rows: Rows, done: np.ndarray, group: np.ndarray, seq: np.ndarray, counts: np.ndarray
    ) -> JoinedTable:
        """The complete collectives: ``done`` indexes ``rows`` by collective (``group``,
        ``seq``), then member, ``counts`` members each. Oldest first."""
        starts = np.cumsum(counts) - counts
        enters = rows["enter_ns"][done]
        ranks = rows["rank"][done]
        t_last = np.maximum.reduceat(enters, starts)
        at_last = np.flatnonzero(enters == np.repeat(t_last, counts))
        segment = np.repeat(np.arange(len(starts)), counts)[at_last]
        first_at_last = np.ones(len(at_last), bool)  # the first member at the last time
        first_at_last[1:] = segment[1:] != segment[:-1]
        last = ranks[at_last[first_at_last]]
        transfer = np.maximum(0, np.minimum.reduceat(rows["exit_ns"][done], starts) - t_last)
        nbytes = np.maximum.reduceat(rows["bytes"][done], starts)
        by_time = np.argsort(t_last, kind="stable")
        # the members of each collective side by side, in the collectives' new order
        n = counts[by_time]
        first = np.cumsum(n) - n
        member = np.repeat(starts[by_time] - first, n) + np.arange(len(done))
        group = group[by_time]
        return JoinedTable(
            self.groups,
            group,
            self._sizes[group],
            seq[by_time],
            t_last[by_time],
            last[by_time],
            transfer[by_time],
            nbytes[by_time],
            first,
            n,
            ranks[member],
            enters[member],
        )


def _collective_order(rows: Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The order of ``rows`` by (group, seq, rank, enter_ns); and per row in that order,
    whether it repeats the member of the row before (from the second row on) and whether
    it starts a collective. One sort of a packed key where the span of the values allows
    it (it does in steady state; four keys sorted together cost several times more at
    hundreds of thousands of rows)."""
    parts = [rows["group"], rows["seq"], rows["rank"]]
    lows = [int(p.min()) for p in parts]
    spans = [int(p.max()) - lo + 1 for p, lo in zip(parts, lows, strict=True)]
    new = np.ones(len(rows["group"]), bool)
    if spans[0] * spans[1] * spans[2] >= 2**62:
        order = np.lexsort((rows["enter_ns"], rows["rank"], rows["seq"], rows["group"]))
        group, seq, rank = (rows[c][order] for c in ("group", "seq", "rank"))
        same = (group[1:] == group[:-1]) & (seq[1:] == seq[:-1])
        new[1:] = ~same
        return order, same & (rank[1:] == rank[:-1]), new
    key = (parts[0] - lows[0]) * (spans[1] * spans[2])
    key += (parts[1] - lows[1]) * spans[2]
    key += parts[2] - lows[2]
    order = np.argsort(key, kind="stable")
    ordered = key[order]
    repeat = ordered[1:] == ordered[:-1]
    if repeat.any():  # a member's duplicates: the earliest first
        order = np.lexsort((rows["enter_ns"], key))
        ordered = key[order]
    collective = ordered // spans[2]
    new[1:] = collective[1:] != collective[:-1]
    return order, repeat, new
