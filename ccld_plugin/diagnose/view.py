"""One round's picture of the job: every rank's latest summary joined with its groups."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ccld_plugin.diagnose.records import Cause, Evidence, Kind, Verdict
from ccld_plugin.topology import GroupInfo, Topology, trace_id
from ccld_plugin.wire.codes import FLAG_P2P, FLAG_SEND, OP_NAMES, STATE_IN_FLIGHT
from ccld_plugin.wire.summary import InFlightOp, RankSummary
from ccld_plugin.wire.summary_batch import SummaryTable

__all__ = ["Blocked", "GroupIndex", "JobView", "topology_of"]


def topology_of(tables: dict[int, list[GroupInfo]]) -> Topology:
    """The job's topology from every rank's group table."""
    topo = Topology()
    for table in tables.values():
        for g in table:
            topo.add(g)
    return topo


@dataclass(frozen=True)
class Blocked:
    """A rank's oldest in-flight op, resolved to its group."""

    rank: int
    op: InFlightOp
    group: GroupInfo
    age_s: float

    @property
    def p2p(self) -> bool:
        return bool(self.op.flags & FLAG_P2P)

    @property
    def sends(self) -> bool:
        return bool(self.op.flags & FLAG_SEND)

    @property
    def op_name(self) -> str:
        return OP_NAMES.get(self.op.op, "unknown")

    @property
    def trace_id(self) -> str:
        return trace_id(self.group.group_id, self.op.seq)

    def waits_in(self) -> Evidence:
        """Where the rank waits, as evidence: its op, seq and group (a transfer's peer)."""
        return Evidence.of(
            "waits_in",
            "rank {rank} waits in {op} seq {seq} on {role}{members}"
            + (" for peer {peer}" if self.p2p else "")
            + " ({wait_s:.1f} s)",
            rank=self.rank,
            op=self.op_name,
            seq=self.op.seq,
            role=self.group.role,
            members=list(self.group.ranks),
            peer=self.op.peer if self.p2p else None,
            wait_s=self.age_s,
        )


@dataclass
class JobView:
    # by rank: a SummaryTable (the live diagnoser's: columns, each summary decoded when
    # looked up) or summary objects (a post-mortem's, a test's)
    summaries: Mapping[int, RankSummary]
    tables: dict[int, list[GroupInfo]]  # per rank: its group table, by slot
    now_ns: int
    job_start_ns: int
    world: int
    gone: set[int] = field(default_factory=set)  # ranks whose process no longer exists
    # Where the view is taken from: the rank whose diagnoser reads it (None for a
    # post-mortem), whether the store lives on its host, and why the store did not answer
    # this round (None: it did). A fault of the observer's own link shows only in these.
    observer: int | None = None
    store_local: bool = False
    store_failed: str | None = None
    # The share of the observer rank's time that the diagnosis' own threads there (its
    # rounds, its lease, the W&B sink) spent on the CPU lately: they hold that rank's GIL,
    # so its compute is slower by up to as much, which is the plugin's doing, not the job's.
    observer_load: float = 0.0
    # ... and when its last round ran (start, end; None: not known, as in older
    # recordings): the steps of its rank that a round overlapped waited for its GIL.
    observer_round_ns: tuple[int, int] | None = None
    # By silent rank: whether its host answered the observer's last TCP handshake
    # (control.reach); a rank not in it was not probed, or its handshake is under way.
    reach: dict[int, bool] = field(default_factory=dict)
    # Nothing more will be reported: a post-mortem's boards, a diagnoser's last round on
    # its way out.
    final: bool = False
    # Built from the tables when not given; a caller whose tables did not change since the
    # last round passes the last one (at 16 k ranks it takes ~0.1 s to build).
    topology: Topology = None  # type: ignore[assignment]
    _resolved: dict[int, list[GroupInfo]] = field(init=False, default_factory=dict, repr=False)
    _columns: tuple[tuple[object, ...], SummaryTable] | None = field(
        init=False, default=None, repr=False
    )

    def __post_init__(self) -> None:
        if self.topology is None:
            self.topology = topology_of(self.tables)

    @property
    def columns(self) -> SummaryTable:
        """The summaries as columns: the table itself, or one made of the objects (again
        when they were replaced since)."""
        if isinstance(self.summaries, SummaryTable):
            return self.summaries
        objs = tuple(self.summaries.values())
        if self._columns is None or not _same(self._columns[0], objs):
            self._columns = (objs, SummaryTable.of(self.summaries))
        return self._columns[1]

    @property
    def steps_marked(self) -> bool:
        """Whether the job marks its steps (a rank past step 0, or steps reported): in a
        job that marks none every rank stays at step 0, which no verdict should tell."""
        t = self.columns
        return bool((t.heads["step"] > 0).any() or len(t.steps))

    def silent(self, min_silent_s: float) -> set[int]:
        """The ranks whose last summary is ``min_silent_s`` old or older (those known gone
        left out: their silence is explained)."""
        t = self.columns
        old = (self.now_ns - t.heads["time_ns"]) / 1e9 >= min_silent_s
        return set(t.ranks[old].tolist()) - self.gone

    def seconds(self, ns: int) -> float:
        """A diagnoser-clock time as seconds since job start."""
        return round((ns - self.job_start_ns) / 1e9, 3)

    def groups_at(self, rank: int) -> list[GroupInfo]:
        """The rank's group table, by slot, as the topology knows each group (the most
        specific role any rank registered). Resolved once per rank and view: the slow
        detector looks up every arrival sample."""
        table = self._resolved.get(rank)
        if table is None:
            table = self._resolved[rank] = [
                self.topology.get(g.group_id) or g for g in self.tables.get(rank, [])
            ]
        return table

    def group(self, rank: int, slot: int) -> GroupInfo | None:
        table = self.groups_at(rank)
        return table[slot] if 0 <= slot < len(table) else None

    def entered_seq(self, rank: int, group_id: int) -> int | None:
        s = self.summaries.get(rank)
        if s is None:
            return None
        for gp in s.groups:
            g = self.group(rank, gp.slot)
            if g is not None and g.group_id == group_id:
                return gp.entered_seq
        return None

    def ops_of(self, rank: int, state: int | None = None) -> list[tuple[InFlightOp, GroupInfo]]:
        s = self.summaries.get(rank)
        out = []
        for op in s.in_flight if s else []:
            g = self.group(rank, op.slot)
            if g is not None and (state is None or op.state == state):
                out.append((op, g))
        return out

    def in_ops(self, state: int | None = None) -> set[int]:
        """The ranks with an op in their summary (of ``state``, when given)."""
        t = self.columns
        rows = t.flights["row"]
        if state is not None:
            rows = rows[t.flights["state"] == state]
        return set(t.ranks[rows].tolist())

    def blocked(self) -> dict[int, Blocked]:
        """Each rank's oldest op still in flight (ranks in no op are absent)."""
        out = {}
        candidates = self.in_ops(STATE_IN_FLIGHT)
        for rank in [r for r in self.summaries if r in candidates] if candidates else []:
            flights = self.ops_of(rank, state=1)
            if flights:
                op, g = min(flights, key=lambda x: x[0].enter_ns)
                out[rank] = Blocked(rank, op, g, max(0.0, (self.now_ns - op.enter_ns) / 1e9))
        return out

    def idle_s(self, rank: int) -> float:
        """Seconds since the rank last made progress (an op completed or a step began)."""
        s = self.summaries[rank]
        return max(0.0, (self.now_ns - s.last_progress_ns) / 1e9)


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


class GroupIndex:
    """Every rank's group table as one array, ``slots[rank, slot]``: the group's index
    into ``groups`` (-1: no such slot), for looking up the groups of many records at once.
    Rebuilt only when the view's tables or topology are other objects than last time (the
    live diagnoser keeps both while no table changes); a group keeps its index for good."""

    def __init__(self) -> None:
        self.groups: list[GroupInfo] = []
        self.index: dict[int, int] = {}  # group id -> index into groups
        self.slots = np.full((0, 0), -1, np.int64)
        self._source: tuple[object, object] = (None, None)

    def of(self, view: JobView) -> np.ndarray:
        """``slots`` for ``view``."""
        source = (view.tables, view.topology)
        if source[0] is self._source[0] and source[1] is self._source[1]:
            return self.slots
        self._source = source
        # A group is one object in all its members' tables (the service keeps them so):
        # each is resolved once, and the slots filled with one scatter.
        resolved: dict[int, int] = {}  # id(group object) -> its index
        ranks = [r for r in view.tables if r >= 0]
        lens = np.fromiter((len(view.tables[r]) for r in ranks), np.int64, len(ranks))
        flat = []
        for r in ranks:
            for g in view.tables[r]:
                i = resolved.get(id(g))
                if i is None:
                    i = resolved[id(g)] = self._group_index(view.topology.get(g.group_id) or g)
                flat.append(i)
        width = int(lens.max()) if len(lens) else 0
        slots = np.full((max(ranks, default=-1) + 1, width), -1, np.int64)
        starts = np.cumsum(lens) - lens
        col = np.arange(len(flat)) - np.repeat(starts, lens)
        slots[np.repeat(np.array(ranks, np.int64), lens), col] = flat
        self.slots = slots
        return slots

    def lookup(self, view: JobView, ranks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Per record (its rank and slot): its group's index, or -1."""
        table = self.of(view)
        rows, width = table.shape
        if not len(ranks) or not width:
            return np.full(len(ranks), -1, np.int64)
        if ranks.min() >= 0 and ranks.max() < rows and slots.min() >= 0 and slots.max() < width:
            return table.ravel()[ranks * width + slots]  # all inside: one gather
        known = (ranks >= 0) & (ranks < rows) & (slots >= 0) & (slots < width)
        out = np.full(len(ranks), -1, np.int64)
        out[known] = table[ranks[known], slots[known]]
        return out

    def _group_index(self, g: GroupInfo) -> int:
        i = self.index.get(g.group_id)
        if i is None:
            i = self.index[g.group_id] = len(self.groups)
            self.groups.append(g)
        elif self.groups[i] is not g:
            self.groups[i] = g  # the same ranks with a more specific role
        return i


def verdict_at(
    view: JobView,
    b: Blocked,
    kind: Kind,
    cause: Cause,
    ranks: list[int],
    evidence: list[Evidence],
    severity: float | None = None,
) -> Verdict:
    """A verdict on ``ranks`` found at the op ``b`` waits in: its group, op and step, from
    when ``b`` entered it."""
    return Verdict(
        kind=kind,
        cause=cause,
        ranks=ranks,
        group=b.group.to_dict(),
        op=b.op_name,
        trace_id=b.trace_id,
        step=view.summaries[b.rank].step,
        onset_s=view.seconds(b.op.enter_ns),
        detected_s=view.seconds(view.now_ns),
        severity=severity,
        evidence=evidence,
    )
